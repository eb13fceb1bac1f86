"""Speculative decoding: cheap proposals, one target pass to verify them, and the exact acceptance rule.

A proposer drafts up to k tokens x_1..x_k after a decoding sequence's last token, with draft distributions
p_1..p_k (after the request's temperature/top-k/top-p). The target scores the last token and the k drafts
in one forward pass (k + 1 query positions of one sequence: the varlen attention already takes them),
giving q_1..q_{k+1} under the same transform. Then (Leviathan et al. 2023, Chen et al. 2023):

    for i = 1..k: accept x_i with probability min(1, q_i(x_i) / p_i(x_i));
                  on the first rejection, draw from max(0, q_i − p_i) / Z instead and stop;
    if all k were accepted, draw one bonus token from q_{k+1}.

Every emitted token is then distributed exactly as the target alone would draw it. Greedy requests have a
one-hot q (the argmax), so a draft is accepted iff it is the argmax and the correction is the argmax: the
output is the non-speculative greedy output. Proposers:
  NgramProposer   prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
                  last n tokens (its prompt and output); a point-mass p, so p(x) = 1
  DraftProposer   a smaller model with the same tokenizer and its own paged KV cache (draft.py)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimlm.runtime.sampling import SamplingParams, filter_logits
from slimlm.runtime.sequence import Sequence


@dataclass
class Proposal:
    tokens: list[int]  # the drafted tokens, possibly none
    probs: torch.Tensor | None  # [len(tokens), V] the draft distributions; None: point masses on `tokens`


def distributions(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row's token is drawn from, [R, V]: one-hot at the argmax for greedy rows,
    else softmax of the temperature/top-k/top-p filtered logits (what sampling.sample draws from)."""
    logits = logits.float()
    probs = torch.zeros_like(logits)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    rest = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        probs[idx] = probs[idx].scatter(1, logits[idx].argmax(-1, keepdim=True), 1.0)
    if rest:
        idx = torch.tensor(rest, device=logits.device)
        probs[idx] = filter_logits(logits[idx], [params[i] for i in rest]).softmax(-1)
    return probs


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def residual(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """What a rejection draws from: max(0, q − p), unnormalised (multinomial normalises). If q = p on the
    support, nothing can be rejected; q is returned anyway rather than an all-zero vector."""
    r = (q - p).clamp_(min=0)
    return r if r.sum() > 0 else q


def verify(q: torch.Tensor, proposal: Proposal, generator: torch.Generator) -> tuple[list[int], int]:
    """The exact rule above. q [k + 1, V] target distributions at the last token and after each draft.
    Returns (tokens to emit: the accepted drafts, then one correction or bonus token; drafts accepted)."""
    drafts = proposal.tokens
    k = len(drafts)
    index = torch.arange(k, device=q.device)
    ids = torch.tensor(drafts, device=q.device, dtype=torch.long)
    q_x = q[index, ids]
    p = proposal.probs
    p_x = torch.ones_like(q_x) if p is None else p[index, ids]
    u = torch.rand(k, generator=generator, device=q.device)
    rejected = (u * p_x >= q_x).tolist()  # u < q/p, written without dividing by p (p_x > 0: x was drawn from p)
    for i, reject in enumerate(rejected):
        if reject:
            p_i = torch.zeros_like(q[i]).index_fill_(0, ids[i : i + 1], 1.0) if p is None else p[i]
            return drafts[:i] + [_draw(residual(q[i], p_i), generator)], i
    return drafts + [_draw(q[k], generator)], k


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> tuple[list[int], int]:
    """verify() for a greedy request, without its distributions: q is one-hot at each row's argmax and a greedy
    draft's p a point mass, so the drafts are accepted while they are the argmax, and the argmax follows."""
    best = logits.argmax(-1).tolist()
    accepted = next(
        (i for i, (draft, top) in enumerate(zip(drafts, best[:-1], strict=True)) if draft != top), len(drafts)
    )
    return drafts[:accepted] + [best[accepted]], accepted


class NgramProposer:
    """Prompt lookup decoding: match the last n tokens (n from max_n down to min_n) against the sequence's
    earlier tokens, latest occurrence first, and propose the k tokens that followed it."""

    def __init__(self, k: int, max_n: int = 3, min_n: int = 1) -> None:
        self.k, self.max_n, self.min_n = k, max_n, min_n

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        return [Proposal(self._lookup(s.token_ids, min(self.k, b)), None) for s, b in zip(seqs, budgets, strict=True)]

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + k]
        return []
