import gc
import weakref

import pytest

from slimlm.compress.memory import objects_alive_now_frozen, return_freed_memory


class Node:
    pass


def test_objects_alive_at_the_start_are_frozen_and_cycles_made_during_the_run_still_collected():
    before = Node()
    seen = {}

    @objects_alive_now_frozen
    def run(x):
        seen["frozen"] = gc.get_freeze_count()
        a, b = Node(), Node()
        a.other, b.other = b, a  # a reference cycle: only the collector frees it
        ref = weakref.ref(a)
        del a, b
        return_freed_memory()
        seen["collected"] = ref() is None
        return x + 1

    assert run(1) == 2
    assert seen["frozen"] > 0 and seen["collected"]
    assert gc.get_freeze_count() == 0
    assert before is not None


def test_objects_are_unfrozen_when_the_run_raises():
    @objects_alive_now_frozen
    def run():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run()
    assert gc.get_freeze_count() == 0
