"""A draft model for speculative decoding: a smaller model with the target's tokenizer, its own weights and
its own paged KV cache (same block size; the target's --kv-cache-memory again, for its own pool).

Every decoding sequence has a shadow in the draft's cache (with its own prefix cache: a prompt many
requests share is computed once). Before proposing, the shadow forgets the KV of
the drafts the target rejected (BlockManager.release_last), takes the tokens the target emitted, computes
the ones it has not seen (the whole prompt the first time), then drafts k tokens, one batched draft step
per token, each drawn from the draft's distribution under the request's own temperature/top-k/top-p.
"""

from __future__ import annotations

import torch

from slimlm import models
from slimlm.errors import SlimlmError
from slimlm.runtime.block_manager import BlockManager
from slimlm.runtime.model_runner import ModelRunner
from slimlm.runtime.scheduler import Batch, ScheduledSeq
from slimlm.runtime.sequence import Sequence, common_prefix
from slimlm.runtime.speculative import Proposal, distributions


class DraftProposer:
    def __init__(self, model: str, engine, k: int) -> None:
        model_dir = models.resolve(model)
        models.check(model_dir)
        tokenizer = models.load_tokenizer(model_dir)
        if tokenizer.get_vocab() != engine.tokenizer.get_vocab():
            raise SlimlmError(
                f"the draft model {model_dir} ({len(tokenizer)} tokens) does not share the target "
                f"{engine.model_dir}'s tokenizer ({len(engine.tokenizer)} tokens); speculative "
                "decoding needs the same vocabulary"
            )
        config = engine.config
        self.runner = ModelRunner(
            model_dir,
            engine.dtype,
            str(engine.device),
            config.kv_cache_memory,
            config.block_size,
            engine.max_model_len,
        )
        vocab = self.runner.model.config.vocab_size
        if vocab != engine.vocab_size:
            raise SlimlmError(
                f"the draft model {model_dir} has {vocab} logits per token, the target "
                f"{engine.model_dir} {engine.vocab_size}; speculative decoding needs the same vocabulary"
            )
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.prefix_caching)
        self.k = k
        self.shadows: dict[int, Sequence] = {}  # by the target sequence's seq_id

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        live = {s.seq_id for s in seqs}
        for seq_id in [i for i in self.shadows if i not in live]:  # finished, aborted or preempted
            self.blocks.free_sequence(self.shadows.pop(seq_id))
        want: dict[int, int] = {}
        for seq, budget in zip(seqs, budgets, strict=True):
            if min(self.k, budget) > 0:
                want[seq.seq_id] = min(self.k, budget)
                self._sync(seq)
        drafts: dict[int, list[int]] = {i: [] for i in want}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in want}
        while True:
            shadows = [self.shadows[i] for i, k in want.items() if len(drafts[i]) < k and i in self.shadows]
            items = []
            for shadow in shadows:
                n = shadow.num_tokens - shadow.num_computed
                if self.blocks.append(shadow, n):
                    items.append(ScheduledSeq(shadow, n))
                else:  # the draft's pool is full: this sequence drafts no further this step
                    want[shadow.seq_id] = len(drafts[shadow.seq_id])
            if not items:
                break
            ends = torch.tensor([item.num_tokens for item in items]).cumsum(0) - 1
            copies, self.blocks.pending_copies = self.blocks.pending_copies, []  # blocks a shadow took to the token
            logits = self.runner.run(Batch(items, copies), ends.tolist())
            # a greedy request's draft distribution is a point mass at the argmax: drawn and kept as that
            sampled = [i for i, item in enumerate(items) if not item.seq.params.greedy]
            dist = dict(
                zip(sampled, distributions(logits[sampled], [items[i].seq.params for i in sampled]), strict=True)
            )
            best = logits.argmax(-1).tolist()
            for i, item in enumerate(items):
                shadow = item.seq
                token = int(torch.multinomial(dist[i], 1, generator=shadow.generator)) if i in dist else best[i]
                shadow.num_computed += item.num_tokens
                self.blocks.register_full_blocks(shadow)  # before the draft joins: what was computed
                shadow.token_ids.append(token)
                drafts[shadow.seq_id].append(token)
                if i in dist:
                    probs[shadow.seq_id].append(dist[i])
        return [
            Proposal(drafts[s.seq_id], torch.stack(probs[s.seq_id]) if probs[s.seq_id] else None)
            if drafts.get(s.seq_id)
            else Proposal([], None)
            for s in seqs
        ]

    def _sync(self, seq: Sequence) -> None:
        """The shadow keeps the KV of what it shares with the target's tokens and takes the rest of them."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:  # a shared prompt is computed by the draft once, too (its prefix cache)
            shadow = Sequence(
                seq.seq_id, seq.request_id, list(seq.token_ids), seq.num_prompt_tokens, seq.params, seq.generator
            )
            self.blocks.allocate_prefix(shadow)
            self.shadows[seq.seq_id] = shadow
        # the last token is always recomputed, even when its KV is there: its logits give the first draft
        keep = min(common_prefix(shadow.token_ids, seq.token_ids), len(seq.token_ids) - 1)
        if shadow.num_computed > keep:
            self.blocks.release_last(shadow, shadow.num_computed - keep)
        shadow.token_ids = list(seq.token_ids)
