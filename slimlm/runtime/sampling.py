"""What a request asks for (SamplingParams) and how the next token is drawn from the logits (sample)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slimlm import SlimlmError


@dataclass
class SamplingParams:
    """vLLM's names and meanings. temperature 0 is greedy; top_k 0 or -1 and top_p 1 disable those filters."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1  # independent samples sharing the prompt's KV blocks (copy-on-write when they diverge)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # log-probability of each sampled token under the model (before temperature)
    prompt_logprobs: bool = False  # log-probability of each prompt token given the ones before it

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        problems = []
        if not (isinstance(self.max_tokens, int) and self.max_tokens > 0):
            problems.append(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.top_k, int) and self.top_k >= -1):
            problems.append(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not (isinstance(self.n, int) and self.n >= 1):
            problems.append(f"n must be a positive integer, got {self.n!r}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if problems:
            raise SlimlmError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (smallest set of tokens whose probability reaches top_p)."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p  # mass before this token already enough
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """One token per row of `logits` [B, V] and its log-probability under the unmodified model.

    Greedy rows never leave the logits' device; sampled rows are drawn on the host, where each request's
    seeded generator lives."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1).tolist()
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            probs = filter_logits(logits[i].cpu(), p).softmax(-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=g))
    rows = torch.arange(len(tokens), device=logits.device)
    return tokens, logprobs[rows, torch.tensor(tokens, device=logits.device)].tolist()
