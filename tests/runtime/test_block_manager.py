import torch

from slimlm.runtime.block_manager import BlockManager
from slimlm.runtime.sampling import SamplingParams
from slimlm.runtime.sequence import Sequence


def seq(tokens: list[int], seq_id: int = 0, **params) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), len(tokens), SamplingParams(**params), torch.Generator())


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    bm.allocate_prefix(s)
    assert bm.append(s, s.num_tokens - s.num_computed)
    s.num_computed = s.num_tokens
    bm.register_full_blocks(s)


def test_full_prefix_blocks_are_shared_and_the_rest_is_private():
    bm = BlockManager(num_blocks=20, block_size=4)
    a = seq(list(range(10)))  # blocks: [0..3] [4..7] [8, 9]
    run_prefill(bm, a)
    assert bm.num_free == 17
    b = seq(list(range(8)) + [50, 51, 52], seq_id=1)  # same first two blocks, then different
    bm.allocate_prefix(b)
    assert b.num_computed == 8 and b.block_table == a.block_table[:2]
    assert bm.append(b, 3)
    assert b.block_table[2] != a.block_table[2] and bm.num_free == 16
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:2])


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(8)))
    run_prefill(bm, a)
    b = seq(list(range(8)), seq_id=1)
    bm.allocate_prefix(b)
    assert b.num_computed == 4  # the second block is not taken: its last token must run for the logits


def test_freed_blocks_stay_reusable_until_handed_out_again():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq(list(range(9)))
    run_prefill(bm, a)
    first_two = a.block_table[:2]
    bm.free_sequence(a)
    assert bm.num_free == 6
    b = seq(list(range(9)), seq_id=1)
    bm.allocate_prefix(b)
    assert b.block_table == first_two and b.num_computed == 8
    bm.free_sequence(b)
    c = seq([99] * 23, seq_id=2)  # needs all six blocks: every cached block is recycled
    run_prefill(bm, c)
    d = seq(list(range(9)), seq_id=3)
    bm.free_sequence(c)
    bm.allocate_prefix(d)
    assert d.num_computed == 0 and not bm.cached.keys() & set(b.block_hashes)


def test_fork_shares_the_partial_block_and_copies_it_before_a_write():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent = seq(list(range(6)))
    run_prefill(bm, parent)
    child = seq(list(range(6)), seq_id=1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and bm.blocks[parent.block_table[1]].ref_count == 2
    free = bm.num_free
    for s, token in ((parent, 7), (child, 8)):  # each appends its own token into the shared partial block
        s.token_ids.append(token)
        assert bm.append(s, 1)
    assert parent.block_table[0] == child.block_table[0]  # the full block stays shared
    assert parent.block_table[1] != child.block_table[1]
    assert bm.pending_copies == [(parent.block_table[1], child.block_table[1])] or bm.pending_copies == [
        (child.block_table[1], parent.block_table[1])
    ]
    assert bm.num_free == free - 1
    assert all(bm.blocks[b].ref_count == 1 for b in (parent.block_table[1], child.block_table[1]))


def test_append_refuses_without_changing_anything_when_blocks_run_out():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(list(range(12)))
    bm.allocate_prefix(s)
    assert not bm.append(s, 12)
    assert s.block_table == [] and bm.num_free == 2


def test_release_last_rolls_back_rejected_tokens():
    bm = BlockManager(num_blocks=20, block_size=4)
    a = seq(list(range(10)))
    run_prefill(bm, a)  # blocks [0..3] [4..7] [8, 9]
    a.token_ids += [10, 11, 12, 13]  # four drafted tokens, computed
    assert bm.append(a, 4)
    a.num_computed = 14
    bm.register_full_blocks(a)
    assert len(a.block_table) == 4 and len(a.block_hashes) == 3
    third = a.block_table[2]
    bm.release_last(a, 5)  # the target rejected all but... 9 tokens kept
    del a.token_ids[9:]
    assert a.num_computed == 9 and len(a.block_table) == 3 and bm.num_free == 17
    assert len(a.block_hashes) == 2 and bm.blocks[third].hash is None  # no longer full: not shareable
    b = seq(list(range(8)) + [8, 99, 98, 97], seq_id=1)  # must not find a.block 2 in the cache any more
    bm.allocate_prefix(b)
    assert b.num_computed == 8
    a.token_ids.append(42)
    assert bm.append(a, 1) and a.block_table[2] == third  # a writes on into its own third block
    bm.free_sequence(a)
    bm.free_sequence(b)
    assert bm.num_free == 20


def test_release_last_of_a_shared_block_copies_before_writing():
    bm = BlockManager(num_blocks=20, block_size=4)
    a = seq(list(range(8)))
    run_prefill(bm, a)
    b = seq(list(range(8)) + [1], seq_id=1)
    run_prefill(bm, b)  # shares both of a's blocks
    shared = b.block_table[1]
    bm.release_last(b, 2)  # back into the shared block
    assert b.num_computed == 7 and bm.blocks[shared].ref_count == 2
    assert bm.append(b, 1) and b.block_table[1] != shared and bm.pending_copies == [(shared, b.block_table[1])]
