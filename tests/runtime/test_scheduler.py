import random

import pytest
import torch

from slimlm.runtime.block_manager import BlockManager
from slimlm.runtime.sampling import SamplingParams
from slimlm.runtime.scheduler import Scheduler
from slimlm.runtime.sequence import Sequence, Status


def seq(n: int, seq_id: int) -> Sequence:
    tokens = [seq_id * 1000 + i for i in range(n)]  # distinct: no prefix sharing between sequences
    return Sequence(seq_id, f"r{seq_id}", tokens, n, SamplingParams(), torch.Generator())


def advance(batch) -> None:
    """What the engine does after a forward pass: tokens computed, a token sampled where a step reached the end."""
    for item in batch.items:
        samples = item.samples
        item.seq.num_computed += item.num_tokens
        if samples:
            item.seq.token_ids.append(7)


def test_long_prompts_are_chunked_and_decodes_keep_running():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a = seq(3, 0)
    sched.add(a)
    advance(sched.schedule())  # a's prompt
    b = seq(25, 1)
    sched.add(b)
    sizes = []
    for _ in range(3):
        batch = sched.schedule()
        sizes.append([(i.seq.seq_id, i.num_tokens) for i in batch.items])
        advance(batch)
    assert sizes == [[(0, 1), (1, 9)], [(0, 1), (1, 9)], [(0, 1), (1, 7)]]  # a decodes every step
    assert b.num_computed == 25 and b.num_tokens == 26


def test_admission_is_first_come_first_served_and_capped():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [seq(5, i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [i.seq.seq_id for i in batch.items] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2, 3]


def test_preemption_frees_the_youngest_and_requeues_it_first():
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    old, young = seq(8, 0), seq(8, 1)  # two blocks each, then a third each once they decode past 8 tokens
    sched.add(old)
    sched.add(young)
    advance(sched.schedule())  # both prefilled: 4 blocks used, next tokens land in new blocks
    batch = sched.schedule()  # old takes block 5, young block 6
    advance(batch)
    for _ in range(4):
        batch = sched.schedule()
        advance(batch)
    assert young.status == Status.WAITING and young.num_preemptions == 1 and young.block_table == []
    assert sched.waiting[0] is young and old.status == Status.RUNNING
    sched.finish(old, "stop")
    assert bm.num_free == 6
    advance(sched.schedule())  # young is recomputed: prompt and outputs so far
    assert young.status == Status.RUNNING and young.num_computed == young.num_tokens - 1


def test_the_youngest_of_three_is_preempted_and_reported():
    bm = BlockManager(7, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    seqs = [seq(8, i) for i in range(3)]  # two blocks each: 6 of 7 used after prefill
    for s in seqs:
        sched.add(s)
    advance(sched.schedule())
    batch = sched.schedule()  # each now needs a third block and one is free: the youngest makes room
    assert batch.preempted == [seqs[2]] and [i.seq for i in batch.items] == seqs[:2]
    assert [s.status for s in seqs] == [Status.RUNNING, Status.RUNNING, Status.WAITING]


def test_a_budget_of_one_token_still_admits_and_finishes_a_prompt():
    sched = Scheduler(BlockManager(8, 4), max_num_seqs=2, max_num_batched_tokens=1)
    s = seq(3, 0)
    sched.add(s)
    for _ in range(3):
        batch = sched.schedule()
        assert [(i.seq, i.num_tokens) for i in batch.items] == [(s, 1)]
        advance(batch)
    assert s.num_computed == 3 and s.num_tokens == 4


def test_a_pool_too_small_for_one_sequence_is_an_error_not_a_hang():
    sched = Scheduler(BlockManager(1, 4), max_num_seqs=2, max_num_batched_tokens=16)
    sched.add(seq(9, 0))
    with pytest.raises(RuntimeError) as caught:
        sched.schedule()
    assert str(caught.value) == "KV cache pool cannot hold a single waiting sequence"


def test_finishing_from_any_state_returns_every_block():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=6)
    seqs = [seq(9, i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    advance(sched.schedule())  # one full prompt chunk, another partially
    for s in seqs:  # running, mid-prefill, waiting
        sched.finish(s, "abort")
    assert bm.num_free == 16 and not sched.has_work()


class Cache:
    """What each KV block would hold: the position and token written into each slot, as the model runner would
    write them (each new token after the sequence's resident ones)."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.slots: dict[int, list[tuple[int, int] | None]] = {b.block_id: [None] * bm.block_size for b in bm.blocks}

    def write(self, s: Sequence, n: int) -> None:
        size = self.bm.block_size
        for i in range(n):
            r, pos = s.num_resident + i, s.num_computed + i
            self.slots[s.block_table[r // size]][r % size] = (pos, s.token_ids[pos])

    def copy(self, copies) -> None:
        for src, dst in copies:
            self.slots[dst] = list(self.slots[src])

    def move(self, old: list[int], new: list[int], kept: list[int]) -> None:
        """What the runner's move_kv does (one selection for every head here)."""
        size = self.bm.block_size
        values = [self.slots[old[r // size]][r % size] for r in kept]
        for i, value in enumerate(values):
            self.slots[new[i // size]][i % size] = value

    def read(self, s: Sequence) -> list[tuple[int, int] | None]:
        size = self.bm.block_size
        return [self.slots[s.block_table[r // size]][r % size] for r in range(s.num_resident)]


def check_invariants(
    bm: BlockManager, sched: Scheduler, live: list[Sequence], cache: Cache, kept_positions: dict[int, list[int]]
) -> None:
    refs = [0] * len(bm.blocks)
    for s in live:
        for b in s.block_table:
            refs[b] += 1
    assert [b.ref_count for b in bm.blocks] == refs  # every reference counted, none leaked
    assert set(bm.free) == {b.block_id for b in bm.blocks if b.ref_count == 0}
    assert all(bm.blocks[b].hash == h for h, b in bm.cached.items())
    assert len(sched.running) <= sched.max_num_seqs
    for s in sched.waiting:
        assert s.status == Status.WAITING and not s.block_table  # a waiting sequence holds no blocks
    for s in sched.running:
        assert len(s.block_table) == bm.blocks_needed(s.num_resident)
        published = s.num_computed // bm.block_size if bm.prefix_caching and not s.num_evicted else 0
        assert len(s.block_hashes) == published  # a sequence that evicted anything publishes nothing
        # The KV a sequence attends over is its own tokens, whoever computed them: shared prefixes,
        # copies-on-write and evictions must never let another sequence's tokens in, nor lose a kept one.
        kept = kept_positions.get(s.seq_id, range(s.num_computed)) if s.num_evicted else range(s.num_computed)
        assert cache.read(s) == [(p, s.token_ids[p]) for p in kept]


def resident_positions(s: Sequence, kept: dict[int, list[int]]) -> list[int]:
    return list(kept[s.seq_id]) if s.num_evicted else list(range(s.num_computed))


def rolls_back(s: Sequence, kept: dict[int, list[int]]) -> int:
    """How many tokens a rejected draft could take back: up to 3 of the last computed ones, all still resident
    (a policy keeps the newest tokens, which are the only ones a draft writes), and never the first."""
    positions = resident_positions(s, kept)
    newest = next((i for i in range(len(positions)) if positions[-1 - i] != s.num_computed - 1 - i), len(positions))
    return min(3, newest, s.num_resident - 1)


def evict_some(rng: random.Random, bm: BlockManager, cache: Cache, s: Sequence, kept: dict[int, list[int]]) -> None:
    """What a KV policy does to a sequence: drop some full blocks (window), or keep a selection in fresh blocks
    (SnapKV); `kept` follows which positions stay."""
    positions = resident_positions(s, kept)
    full = (s.num_resident - 1) // bm.block_size  # blocks before the last
    if rng.random() < 0.6 and full:
        first = rng.randrange(full)
        count = rng.randint(1, full - first)
        bm.evict(s, first, count)
        del positions[first * bm.block_size : (first + count) * bm.block_size]
    else:
        chosen = sorted(rng.sample(range(s.num_resident), rng.randint(1, s.num_resident - 1)))
        tables = bm.compact(s, len(chosen))
        if tables is None:
            return
        cache.move(*tables, chosen)
        positions = [positions[i] for i in chosen]
    kept[s.seq_id] = positions


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_every_sequence_s_kv_its_own(seed):
    """Arrivals with shared prefixes, chunked prefill, preemption, forks, speculative roll-backs and KV policy
    evictions on a small pool, against a model of what each block holds."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=rng.randint(10, 24), block_size=4, prefix_caching=rng.random() < 0.8)
    sched = Scheduler(bm, max_num_seqs=rng.randint(2, 5), max_num_batched_tokens=rng.randint(4, 16))
    cache = Cache(bm)
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    live: list[Sequence] = []
    want: dict[int, int] = {}  # seq_id -> output tokens it stops at
    preempted: dict[int, int] = {}  # seq_id -> times reported preempted
    kept: dict[int, list[int]] = {}  # seq_id -> the positions still resident, once it evicted any
    next_id = 0
    for _ in range(400):
        if next_id < 30 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randint(1, 8))]
            s = Sequence(next_id, f"r{next_id}", prompt, len(prompt), SamplingParams(), torch.Generator())
            want[next_id], next_id = rng.randint(1, 10), next_id + 1
            sched.add(s)
            live.append(s)
        batch = sched.schedule()
        assert sum(item.num_tokens for item in batch.items) <= sched.max_num_batched_tokens
        assert all(item.num_tokens > 0 for item in batch.items)
        cache.copy(batch.copies)
        for s in batch.preempted:
            preempted[s.seq_id] = preempted.get(s.seq_id, 0) + 1
        assert sched.num_preemptions == sum(preempted.values())
        assert all(s.num_preemptions == preempted.get(s.seq_id, 0) for s in live)
        for item in batch.items:
            s, samples = item.seq, item.samples
            cache.write(s, item.num_tokens)
            if s.num_evicted:
                kept[s.seq_id] += range(s.num_computed, s.num_computed + item.num_tokens)
            s.num_computed += item.num_tokens
            bm.register_full_blocks(s)
            if not samples:
                continue
            s.token_ids.append(rng.randrange(5))
            if len(s.output_ids) >= want[s.seq_id]:
                sched.finish(s, "length")
                live.remove(s)
            elif rng.random() < 0.15 and rolls_back(s, kept) > 0:  # a speculative step whose drafts were rejected
                k = rng.randint(1, rolls_back(s, kept))
                bm.release_last(s, k)
                del s.token_ids[s.num_computed + 1 :]
                if s.num_evicted:
                    del kept[s.seq_id][-k:]
            elif rng.random() < 0.15 and s.num_resident > 1:
                evict_some(rng, bm, cache, s, kept)
            elif rng.random() < 0.1 and next_id < 30 and len(sched.running) < sched.max_num_seqs:
                child = Sequence(
                    next_id, f"r{next_id}", list(s.token_ids), s.num_prompt_tokens, s.params, torch.Generator()
                )
                want[next_id], next_id = want[s.seq_id], next_id + 1
                sched.fork(s, child)
                live.append(child)
                if s.num_evicted:
                    kept[child.seq_id] = list(kept[s.seq_id])
        check_invariants(bm, sched, live, cache, kept)
        if next_id >= 30 and not sched.has_work():
            break
    assert not sched.has_work(), "the workload did not drain"
    assert bm.num_free == len(bm.blocks)
