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

