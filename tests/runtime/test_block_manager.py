import pytest
import torch

from slimlm.runtime import block_manager
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
    assert b.num_computed == 7  # all but the last token, which must run for the logits
    assert b.block_table == a.block_table  # the second block lends three of its tokens
    assert bm.append(b, 1) and b.block_table[1] != a.block_table[1]  # and is copied before b writes


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


def forked(bm: BlockManager) -> tuple[Sequence, Sequence]:
    """A six-token prompt prefilled (blocks [0..3] [4, 5]) and its fork."""
    parent = seq(list(range(6)))
    run_prefill(bm, parent)
    child = seq(list(range(6)), seq_id=1)
    bm.fork(parent, child)
    return parent, child


def test_fork_shares_the_partial_block_and_copies_it_before_a_write():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent, child = forked(bm)
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


def test_release_last_of_a_shared_block_copies_before_writing_and_keeps_it_cached():
    bm = BlockManager(num_blocks=20, block_size=4)
    a = seq(list(range(8)))
    run_prefill(bm, a)
    b = seq(list(range(8)) + [1], seq_id=1)
    run_prefill(bm, b)  # shares both of a's blocks
    shared = b.block_table[1]
    bm.release_last(b, 2)  # back into the shared block
    assert b.num_computed == 7 and bm.blocks[shared].ref_count == 2
    c = seq(list(range(8)) + [5], seq_id=2)  # a's full blocks stay cached for the others
    bm.allocate_prefix(c)
    assert c.num_computed == 8 and c.block_table == a.block_table
    assert bm.append(b, 1) and b.block_table[1] != shared and bm.pending_copies == [(shared, b.block_table[1])]


def test_the_least_recently_freed_cached_block_is_evicted_first():
    bm = BlockManager(num_blocks=3, block_size=4)
    old, new = seq(list(range(5))), seq([9, 9, 9, 9, 9], seq_id=1)
    run_prefill(bm, old)  # blocks: [0..3] + a partial one
    bm.free_sequence(old)
    run_prefill(bm, new)  # takes the one never-used block and old's partial one
    bm.free_sequence(new)
    run_prefill(bm, seq([7], seq_id=2))  # one block: the oldest freed, old's [0..3], not new's [9 9 9 9]
    again_old, again_new = seq(list(range(5)), seq_id=3), seq([9, 9, 9, 9, 9], seq_id=4)
    bm.allocate_prefix(again_old)
    bm.allocate_prefix(again_new)
    assert again_old.num_computed == 0 and again_new.num_computed == 4


def test_recycling_a_duplicate_block_keeps_the_original_cached():
    """Two sequences that computed the same prefix side by side each hold their own copy; only the first is
    registered. Handing out the duplicate again must not drop the original's cache entry."""
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = seq(list(range(5))), seq(list(range(5)), seq_id=1)
    for s in (a, b):
        bm.allocate_prefix(s)
    for s in (a, b):  # both scheduled in the same step: neither found the other's block
        assert bm.append(s, 5)
        s.num_computed = 5
        bm.register_full_blocks(s)
    assert a.block_table[0] != b.block_table[0] and bm.blocks[b.block_table[0]].hash is not None
    bm.free_sequence(b)  # b's blocks are the oldest free ones now...
    run_prefill(bm, seq([8] * 8, seq_id=2))  # ...and are handed out again
    c = seq(list(range(5)), seq_id=3)
    bm.allocate_prefix(c)
    assert c.block_table == a.block_table[:1] and c.num_computed == 4


@pytest.mark.parametrize("logprobs_from, reused", [(8, 7), (9, 8), (13, 12)])
def test_prompt_logprobs_leave_the_scored_positions_to_compute(logprobs_from, reused):
    """Scoring prompt token i needs the logits of position i − 1, so it must not come from the cache; the
    blocks before it come from another scored sequence's, never from a plain one's (see chain_root)."""
    bm = BlockManager(num_blocks=20, block_size=4)
    run_prefill(bm, seq(list(range(16))))
    plain_first = seq(list(range(16)), seq_id=1, prompt_logprobs=0, prompt_logprobs_from=logprobs_from)
    bm.allocate_prefix(plain_first)
    assert plain_first.num_computed == 0
    run_prefill(bm, seq(list(range(16)), seq_id=2, prompt_logprobs=0))
    s = seq(list(range(16)), seq_id=3, prompt_logprobs=0, prompt_logprobs_from=logprobs_from)
    bm.allocate_prefix(s)
    assert s.num_computed == reused and s.num_cached_tokens == reused


def test_a_partial_prefix_hit_is_recorded_and_chains_on():
    """A hit on the first blocks only still counts as cached, and the blocks computed after it chain their
    hashes on the hit ones: a third sequence finds all of them."""
    bm = BlockManager(num_blocks=20, block_size=4)
    run_prefill(bm, seq(list(range(4)) + [50]))
    b = seq(list(range(13)), seq_id=1)
    run_prefill(bm, b)
    assert b.num_cached_tokens == 4
    c = seq(list(range(13)), seq_id=2)
    bm.allocate_prefix(c)
    assert c.num_computed == 12 and c.block_table == b.block_table[:3]


def test_appending_nothing_to_a_forked_sequence_copies_nothing():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent, child = seq(list(range(6))), seq(list(range(6)), seq_id=1)
    run_prefill(bm, parent)
    bm.fork(parent, child)
    free = bm.num_free
    assert bm.can_append(child, 0) and bm.append(child, 0)
    assert child.block_table == parent.block_table and bm.pending_copies == [] and bm.num_free == free


def test_a_copy_on_write_needs_its_block_counted():
    """A forked sequence about to write into its shared partial block and cross into a new one needs two
    free blocks: with one, append refuses and changes nothing."""
    bm = BlockManager(num_blocks=3, block_size=4)
    parent, child = seq(list(range(6))), seq(list(range(6)), seq_id=1)
    run_prefill(bm, parent)
    bm.fork(parent, child)
    assert bm.num_free == 1
    child.token_ids += [1, 2, 3]
    assert not bm.can_append(child, 3) and not bm.append(child, 3)
    assert child.block_table == parent.block_table and bm.num_free == 1 and bm.pending_copies == []


def test_release_last_takes_none_to_all_and_refuses_more():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq(list(range(9)))
    run_prefill(bm, s)
    bm.release_last(s, 0)  # every drafted token accepted
    assert s.num_computed == 9 and len(s.block_table) == 3
    with pytest.raises(ValueError) as caught:
        bm.release_last(s, 10)
    assert str(caught.value) == "cannot release 10 of 9 resident tokens"
    with pytest.raises(ValueError):
        bm.release_last(s, -1)
    bm.release_last(s, 9)
    assert s.num_computed == 0 and s.block_table == [] and bm.num_free == 10


def test_a_freed_sequence_holds_nothing():
    """A preempted sequence waits with no KV at all: nothing computed, no blocks, no hashes."""
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq(list(range(9)))
    run_prefill(bm, s)
    bm.free_sequence(s)
    assert (s.block_table, s.block_hashes, s.num_computed) == ([], [], 0) and bm.num_free == 10


def test_evicted_blocks_go_back_to_the_pool_and_stay_in_the_prefix_cache():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq(list(range(18)))  # five blocks, the last with two tokens
    run_prefill(bm, s)
    table = list(s.block_table)
    bm.evict(s, 1, 2)
    assert s.block_table == [table[0], *table[3:]] and s.num_evicted == 8 and s.num_resident == 10
    assert bm.num_free == 7 and not s.block_hashes  # it publishes nothing from now on
    s.token_ids += [90, 91]
    assert bm.append(s, 2) and s.block_table == [table[0], *table[3:]]  # the last block had room for both
    s.num_computed += 2
    bm.register_full_blocks(s)
    assert not s.block_hashes and bm.blocks[table[4]].hash is None  # its K/V saw a history others would not
    again = seq(list(range(18)), seq_id=1)
    bm.allocate_prefix(again)  # the evicted blocks are still what they were: another request reuses them
    assert again.block_table == table[:4] and again.num_computed == 16


@pytest.mark.parametrize("first, count", [(-1, 1), (0, 0), (4, 1), (3, 2), (0, 5)])
def test_eviction_takes_whole_blocks_before_the_last_or_refuses(first, count):
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq(list(range(17)))  # five blocks: the fifth holds one token
    run_prefill(bm, s)
    with pytest.raises(ValueError, match=f"cannot evict blocks {first}..{first + count - 1} of 17 resident"):
        bm.evict(s, first, count)
    assert s.num_evicted == 0 and len(s.block_table) == 5
    bm.evict(s, 0, 4)  # all four before the last
    assert s.num_resident == 1 and bm.num_free == 9


def test_compaction_moves_the_kept_tokens_to_fresh_blocks_and_refuses_when_the_pool_is_short():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(14)))  # three full blocks and one with two tokens
    run_prefill(bm, a)
    b = seq(list(range(14)), seq_id=1)
    run_prefill(bm, b)  # shares a's three full blocks, computes its last two tokens in a block of its own
    assert bm.num_free == 3
    old = list(b.block_table)
    tables = bm.compact(b, 6)
    assert tables == (old, b.block_table) and len(b.block_table) == 2 and not set(b.block_table) & set(old)
    assert b.num_evicted == 8 and b.num_resident == 6 and not b.block_hashes
    assert bm.num_free == 2  # two taken; of the old four, only b's private last block came free
    assert [bm.blocks[i].ref_count for i in old] == [1, 1, 1, 0]  # a still holds the shared ones
    short = BlockManager(num_blocks=5, block_size=4)
    t = seq(list(range(16)))
    run_prefill(short, t)
    assert short.compact(t, 8) is None and t.num_evicted == 0 and short.num_free == 1  # nothing changed
    for bad in (0, 16, 17):
        with pytest.raises(ValueError, match=f"cannot keep {bad} of 16 resident tokens"):
            short.compact(t, bad)


def test_a_freed_sequences_partial_block_lends_its_tokens_and_is_copied_before_a_write():
    """The answers of a multiple-choice question: each takes the question's full blocks and the tokens of its
    partial last block it shares, and copies that block before writing its own tokens into it. The block stays
    filed for the next answer; what a sequence needs to compute (its scored positions) is never taken."""
    bm = BlockManager(num_blocks=12, block_size=4)
    a = seq(list(range(10)))  # [0..3] [4..7] [8, 9]
    run_prefill(bm, a)
    table, partial = list(a.block_table), a.block_table[2]
    bm.free_sequence(a)
    b = seq(list(range(9)) + [70, 71], seq_id=1)  # shares token 8 of the partial block's 8, 9
    bm.allocate_prefix(b)
    assert b.num_computed == 9 and b.block_table == table
    assert bm.append(b, 2)
    assert b.block_table[2] != partial and bm.pending_copies == [(partial, b.block_table[2])]
    assert bm.blocks[partial].ref_count == 0 and bm.filed  # back in the pool, still filed
    c = seq(list(range(10)) + [5], seq_id=2, prompt_logprobs=0, prompt_logprobs_from=10)
    bm.allocate_prefix(c)
    assert c.num_computed == 0  # a scored prompt chains from its own root: a's blocks are not its
    d = seq(list(range(10)) + [5, 6], seq_id=3, prompt_logprobs=0, prompt_logprobs_from=10)
    bm.allocate_prefix(d)
    assert d.num_computed == 0
    e = seq(list(range(10)) + [5], seq_id=4)
    bm.allocate_prefix(e)
    assert e.num_computed == 10 and e.block_table[2] == partial  # both of its tokens
    f = seq(list(range(8)) + [9, 9], seq_id=5)
    bm.allocate_prefix(f)
    assert f.num_computed == 8  # its first token after the full blocks differs: the partial block lends none


def test_a_partial_block_is_filed_only_when_nobody_holds_it_and_forgotten_once_handed_out():
    bm = BlockManager(num_blocks=4, block_size=4)
    parent, child = forked(bm)
    partial = parent.block_table[1]
    bm.free_sequence(parent)  # the child still holds (and may write) the partial block
    assert partial not in bm.filed_under
    bm.free_sequence(child)
    after_first_block = bm.filed_under[partial]
    assert bm.filed[after_first_block] == [partial]
    taker = seq(list(range(5)) + [9], seq_id=2)  # shares token 4 of the partial block's 4, 5
    bm.allocate_prefix(taker)
    assert taker.num_computed == 5
    bm.free_sequence(taker)  # taken but never written (the scheduler gave it back): still filed, unchanged
    assert partial in bm.filed_under and bm.blocks[partial].tokens == (4, 5)
    filler = seq([99] * 16, seq_id=3)  # needs every block: the partial one is recycled
    run_prefill(bm, filler)
    assert partial not in bm.filed.get(after_first_block, [])
    bm.free_sequence(filler)
    again = seq(list(range(6)) + [9], seq_id=4)
    bm.allocate_prefix(again)
    assert again.num_computed == 0


def test_the_best_of_the_blocks_filed_after_a_prefix_is_taken_and_only_the_latest_few_are_kept():
    """Every prompt's first block is filed after the same root: a new prompt takes the one it shares the most
    with, not merely the latest; only the last FILED_PER_PREFIX are kept."""
    bm = BlockManager(num_blocks=64, block_size=4)
    starts = [[1, 2, 3], [1, 2, 7], [5, 6, 7]]  # three short prompts, freed in turn: [5, 6, 7] is filed last
    for i, tokens in enumerate(starts):
        s = seq(tokens, seq_id=i)
        run_prefill(bm, s)
        bm.free_sequence(s)
    c = seq([1, 2, 3, 4, 0], seq_id=9)
    bm.allocate_prefix(c)
    assert c.num_computed == 3 and bm.blocks[c.block_table[0]].tokens == (1, 2, 3)
    bm.free_sequence(c)
    for i in range(block_manager.FILED_PER_PREFIX):  # as many more after the root: the first three go
        s = seq([20 + i], seq_id=10 + i)
        run_prefill(bm, s)
        bm.free_sequence(s)
    assert len(bm.filed[None]) == block_manager.FILED_PER_PREFIX
    d = seq([1, 2, 3, 4, 0], seq_id=30)
    bm.allocate_prefix(d)
    assert d.num_computed == 0
