"""Maps sequences to fixed-size KV cache blocks: refcounts, prefix sharing by hash, copy-on-write.

A block holds the K/V of `block_size` consecutive tokens. A full block is identified by the chained hash of
its tokens and all tokens before it, so two sequences with the same prefix map to the same blocks and the
prefix is computed once. Freed blocks keep their hash until they are handed out again (least recently
freed first), so a prefix can be reused after the sequence that computed it is gone. Sequences that score
their prompt (prompt_logprobs) chain from a root of their own: their prompts run with exact activations
(model_runner), so they never take blocks another sequence's prompt filled through AVX2's int8 loop, and
an evaluation does not depend on what the engine served before it.

Only a sequence's last block is ever written. It is private unless the sequence was forked (n > 1); a
shared last block is copied before the write (copy-on-write), and the runner performs the copies listed in
`pending_copies` before the next forward pass.

Sharing reaches the token, not only the block. Each block filled after a prefix of full blocks is filed
under that prefix's hash (the last FILED_PER_PREFIX of them), the partial last block of a finished sequence
too: a later sequence whose own blocks stop matching there takes as many tokens as it shares with the best of
them, and copies that block before it writes its own. The candidate answers of a multiple-choice question
thus share all of the question, not only its full blocks.

A KV policy (kv_policy.py) may drop blocks from the middle of a sequence's table (`evict`) or move a selection
of its tokens into fresh blocks (`compact`): the table then holds the sequence's resident tokens in order, and
every count here is of resident tokens. Such a sequence publishes no more blocks: what it computes next saw a
history that another request with the same tokens would not.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from slimlm.runtime.sequence import Sequence, common_prefix

FILED_PER_PREFIX = 8  # blocks filed after one prefix: every prompt's first block is filed after the same root


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered for sharing
    tokens: tuple[int, ...] = ()  # the tokens behind `hash`, to rule out collisions


def chain_hash(parent: int | str | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


def chain_root(seq: Sequence) -> str | None:
    """What a sequence's first block hashes from (see the module doc)."""
    return "scored" if seq.scores_prompt else None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # chain hash -> block id
        self.filed: dict[int | str | None, list[int]] = {}  # chain hash -> blocks filled after it, oldest first
        self.filed_under: dict[int, int | str | None] = {}  # the reverse
        self.pending_copies: list[tuple[int, int]] = []  # (source, destination) block ids

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> Block:
        block = self.blocks[self.free.popitem(last=False)[0]]
        if block.hash is not None and self.cached.get(block.hash) == block.block_id:
            del self.cached[block.hash]  # its old contents are about to be overwritten
        self._unfile(block.block_id)
        block.hash, block.tokens, block.ref_count = None, (), 1
        return block

    def _unfile(self, block_id: int) -> None:
        if block_id in self.filed_under:
            parent = self.filed_under.pop(block_id)
            self.filed[parent].remove(block_id)
            if not self.filed[parent]:
                del self.filed[parent]

    def _share(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free[block.block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None  # most recently freed last: evicted last

    def allocate_prefix(self, seq: Sequence) -> None:
        """Give a sequence without blocks the cached blocks of its longest cached prefix of full blocks.

        The last token is always left to compute (its logits are needed), so a fully cached prompt still
        runs one token; the blocks it writes into are never shared ones. With prompt log-probabilities, every
        position from prompt_logprobs_from - 1 on is computed too: its logits score the next token; under
        kv_policy snapkv, the observation window's positions: their queries choose what stays.
        """
        assert not seq.block_table
        seq.num_computed = 0
        if not self.prefix_caching:
            return
        reusable = seq.num_tokens - 1
        if seq.params.prompt_logprobs is not None:
            reusable = min(reusable, seq.params.prompt_logprobs_from - 1)
        observed = seq.kv_policy.observed_from(seq.num_prompt_tokens)  # SnapKV reads these positions' queries
        if observed is not None:
            reusable = min(reusable, observed)
        parent = chain_root(seq)
        for start in range(0, reusable - self.block_size + 1, self.block_size):
            tokens = tuple(seq.token_ids[start : start + self.block_size])
            h = chain_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            self._share(self.blocks[block_id])
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            seq.num_computed += self.block_size
            parent = h
        self._take_partial(seq, parent, reusable)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed

    def _take_partial(self, seq: Sequence, parent: int | str | None, reusable: int) -> None:
        """Of the blocks filed after `parent`, the one that starts with the most of the sequence's next tokens
        (the latest of equals): shared, to be copied before the sequence writes into it."""
        start = seq.num_computed
        wanted = seq.token_ids[start : max(start, reusable)]
        best, best_id = 0, None
        for block_id in self.filed.get(parent, ()):
            shared = common_prefix(self.blocks[block_id].tokens, wanted)
            if shared and shared >= best:
                best, best_id = shared, block_id
        if best_id is not None:
            self._share(self.blocks[best_id])
            seq.block_table.append(best_id)
            seq.num_computed += best

    def can_append(self, seq: Sequence, num_new: int) -> bool:
        needed = self.blocks_needed(seq.num_resident + num_new) - len(seq.block_table)
        return needed + self._needs_copy(seq, num_new) <= self.num_free

    def _needs_copy(self, seq: Sequence, num_new: int) -> int:
        written = seq.num_resident // self.block_size  # index of the block the first new token lands in
        if num_new == 0 or written >= len(seq.block_table):
            return 0
        block_id = seq.block_table[written]  # a filed block is shared with whoever takes it next
        return int(self.blocks[block_id].ref_count > 1 or block_id in self.filed_under)

    def append(self, seq: Sequence, num_new: int) -> bool:
        """Blocks for `num_new` more tokens of `seq` (copying a shared block before it is written).
        False, changing nothing, when there are not enough free blocks."""
        if not self.can_append(seq, num_new):
            return False
        written = seq.num_resident // self.block_size
        if self._needs_copy(seq, num_new):
            old = seq.block_table[written]
            new = self._take_free()
            self.pending_copies.append((old, new.block_id))
            self._release(old)
            seq.block_table[written] = new.block_id
            del seq.block_hashes[written:]  # the copy is private: registered again once full
        while len(seq.block_table) < self.blocks_needed(seq.num_resident + num_new):
            seq.block_table.append(self._take_free().block_id)
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: hash the blocks that became full so later sequences can share them."""
        if not self.prefix_caching or seq.num_evicted:
            return
        while len(seq.block_hashes) < seq.num_computed // self.block_size:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else chain_root(seq), tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.tokens = h, tokens
                self.cached.setdefault(h, block.block_id)
                self._file(block.block_id, seq.block_hashes[-2] if i else chain_root(seq))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all of the parent's blocks, including the partial last one."""
        for block_id in parent.block_table:
            self._share(self.blocks[block_id])
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed, child.num_evicted = parent.num_computed, parent.num_evicted

    def release_last(self, seq: Sequence, k: int) -> None:
        """Forget the KV of the sequence's last `k` computed tokens (rejected speculative tokens): blocks no
        longer needed go back to the pool, and a block that is no longer full is no longer shareable."""
        if not 0 <= k <= seq.num_resident:
            raise ValueError(f"cannot release {k} of {seq.num_resident} resident tokens")
        seq.num_computed -= k
        keep = self.blocks_needed(seq.num_resident)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]
        full = seq.num_resident // self.block_size
        if len(seq.block_hashes) > full:
            last = self.blocks[seq.block_table[full]] if full < len(seq.block_table) else None
            if last is not None and last.ref_count == 1 and last.hash is not None:
                if self.cached.get(last.hash) == last.block_id:
                    del self.cached[last.hash]  # about to be overwritten with other tokens
                self._unfile(last.block_id)
                last.hash, last.tokens = None, ()
            del seq.block_hashes[full:]

    def evict(self, seq: Sequence, first: int, count: int) -> None:
        """Drop `count` full blocks of the sequence's table from index `first` (a window policy's oldest after
        its sink); they go back to the pool, still in the prefix cache when they were registered there."""
        if not (0 <= first and count > 0 and (first + count) * self.block_size < seq.num_resident):
            raise ValueError(f"cannot evict blocks {first}..{first + count - 1} of {seq.num_resident} resident tokens")
        for block_id in seq.block_table[first : first + count]:
            self._release(block_id)
        del seq.block_table[first : first + count]
        seq.num_evicted += count * self.block_size
        seq.block_hashes = []

    def compact(self, seq: Sequence, num_kept: int) -> tuple[list[int], list[int]] | None:
        """Fresh blocks for the `num_kept` tokens a policy keeps of the sequence's resident ones (the caller
        copies them in, in order, before anything else is allocated): (old table, new table), the old blocks
        already released (their contents are intact until handed out again). None, changing nothing, when the
        pool lacks the blocks."""
        if not 0 < num_kept < seq.num_resident:  # keeping all of them is no compaction
            raise ValueError(f"cannot keep {num_kept} of {seq.num_resident} resident tokens")
        if self.blocks_needed(num_kept) > self.num_free:
            return None
        old = seq.block_table
        seq.block_table = [self._take_free().block_id for _ in range(self.blocks_needed(num_kept))]
        for block_id in reversed(old):
            self._release(block_id)
        seq.num_evicted += seq.num_resident - num_kept
        seq.block_hashes = []
        return old, seq.block_table

    def free_sequence(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):  # the tail is least likely to be shared: evict it first
            self._release(block_id)
        self._file_partial(seq)
        seq.block_table, seq.block_hashes, seq.num_computed, seq.num_evicted = [], [], 0, 0

    def _file_partial(self, seq: Sequence) -> None:
        """File a freed sequence's partial last block under the full blocks before it, if nobody holds it
        (a forked sibling still writing into it would change it)."""
        full, extra = divmod(seq.num_computed, self.block_size)
        if not (self.prefix_caching and extra and not seq.num_evicted and len(seq.block_hashes) == full):
            return
        if full >= len(seq.block_table) or self.blocks[seq.block_table[full]].ref_count:
            return
        block = self.blocks[seq.block_table[full]]
        if block.block_id in self.filed_under:  # taken from the files and given back unwritten
            return
        block.tokens = tuple(seq.token_ids[full * self.block_size : seq.num_computed])
        self._file(block.block_id, seq.block_hashes[-1] if full else chain_root(seq))

    def _file(self, block_id: int, parent: int | str | None) -> None:
        blocks = self.filed.setdefault(parent, [])
        blocks.append(block_id)
        self.filed_under[block_id] = parent
        if len(blocks) > FILED_PER_PREFIX:
            del self.filed_under[blocks.pop(0)]
