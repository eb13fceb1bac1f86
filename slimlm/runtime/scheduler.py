"""Decides, at every step, which sequences run and how many of their tokens (continuous batching).

Each step has a token budget. Running sequences go first, oldest first: a decoding sequence takes one
token, a sequence still in its prompt takes the next chunk that fits (chunked prefill), so a long prompt
never stalls the decodes around it. Waiting sequences are then admitted in arrival order while budget,
`max_num_seqs` and free blocks allow; admission stops at the first one that does not fit, so nobody is
overtaken forever. When blocks run out for a running sequence, the youngest running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later
(cheaply, when its blocks are still in the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from slimlm.runtime.block_manager import BlockManager
from slimlm.runtime.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so its logits give the next token."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


@dataclass
class Batch:
    items: list[ScheduledSeq]
    copies: list[tuple[int, int]] = field(default_factory=list)  # KV blocks to copy before the forward pass
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: oldest first
        self.num_preemptions = 0  # since start, for the server's metrics

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        items: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.blocks.append(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status == Status.RUNNING:
                items.append(ScheduledSeq(seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.blocks.allocate_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.blocks.append(seq, n):
                if not self.running:  # the engine checks the pool holds a max-length sequence: cannot happen
                    raise RuntimeError("KV cache pool cannot hold a single waiting sequence")
                self.blocks.free_sequence(seq)  # give back the prefix blocks it was lent; retry next step
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            items.append(ScheduledSeq(seq, n))
            budget -= n
        copies, self.blocks.pending_copies = self.blocks.pending_copies, []
        return Batch(items, copies, preempted)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A running sequence's copy (n > 1): shares every block, runs from the next step on."""
        self.blocks.fork(parent, child)
        child.status = Status.RUNNING
        self.running.append(child)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_sequence(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finished or aborted: release its blocks, whatever state it is in."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
