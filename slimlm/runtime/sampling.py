"""What a request asks for (SamplingParams) and how the next token is drawn from the logits (sample)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slimlm.errors import SlimlmError
from slimlm.runtime.kv_policy import KVPolicy

MAX_LOGPROBS = 20  # vLLM's default bound on top-N log-probabilities per token
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as in vLLM): dividing by them overflows


def _is_int(x) -> bool:
    return type(x) is int  # bool is an int subclass; True is not a count


@dataclass
class SamplingParams:
    """vLLM's names and meanings. temperature 0 is greedy; top_k 0 or -1 and top_p 1 disable those filters.

    logprobs / prompt_logprobs: None (off) or N in 0..MAX_LOGPROBS: each token's own log-probability under
    the model (before temperature), plus the N most likely tokens' when N > 0. prompt_logprobs_from: the first
    prompt position scored (default 1, the whole prompt); the prompt before it may come from the prefix
    cache, which is how scoring continuations of a shared context (lm-eval) reuses the context's KV."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1  # independent samples sharing the prompt's KV blocks (copy-on-write when they diverge)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_from: int = 1
    kv_policy: KVPolicy | None = None  # what this request keeps of its KV history (default: the engine's)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        problems = []
        if not (_is_int(self.max_tokens) and self.max_tokens > 0):
            problems.append(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if type(self.temperature) not in (int, float) or not self.temperature >= 0 or self.temperature == float("inf"):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if type(self.top_p) not in (int, float) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_is_int(self.top_k) and self.top_k >= -1):
            problems.append(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not (_is_int(self.n) and self.n >= 1):
            problems.append(f"n must be a positive integer, got {self.n!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            problems.append(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            problems.append("stop_token_ids must be a list of token ids (integers >= 0)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                problems.append(f"{name} must be None or an integer in 0..{MAX_LOGPROBS}, got {value!r}")
        if not (_is_int(self.prompt_logprobs_from) and self.prompt_logprobs_from >= 1):
            problems.append(f"prompt_logprobs_from must be an integer >= 1, got {self.prompt_logprobs_from!r}")
        if self.kv_policy is not None and not isinstance(self.kv_policy, KVPolicy):
            problems.append(f"kv_policy must be None or a KVPolicy, got {type(self.kv_policy).__name__}")
        if problems:
            raise SlimlmError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Per row: temperature, then top-k, then top-p (smallest set of tokens whose probability reaches top_p)."""
    device, vocab = logits.device, logits.shape[-1]
    logits = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    if min(ks) < vocab or min(top_ps) < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        kth = sorted_logits.gather(1, torch.tensor(ks, device=device)[:, None] - 1)
        drop = logits < kth  # top-k: tokens tied with the k-th stay (as in vLLM and transformers)
        probs = sorted_logits.masked_fill(sorted_logits < kth, float("-inf")).softmax(-1)
        # top-p: a token goes once the mass before it already reaches top_p (rows asking for it only:
        # rounding in the cumulative sum must not cut the tail of a row with top_p = 1)
        top_p = torch.tensor(top_ps, device=device)[:, None]
        sorted_drop = (probs.cumsum(-1) - probs >= top_p) & (top_p < 1)
        sorted_drop[:, 0] = False  # the most likely token always stays (a top_p below fp32's range reads as 0)
        drop |= torch.zeros_like(sorted_drop).scatter(1, order, sorted_drop)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]  # of each chosen token, under the unmodified model
    top: list[list[tuple[int, float]] | None]  # the N most likely (token, logprob) where asked for


def top_logprobs(logprobs: torch.Tensor, counts: list[int | None]) -> list[list[tuple[int, float]] | None]:
    """For rows of log-probabilities [R, V], the `count` most likely (token, logprob) pairs (one host copy)."""
    n = max((c for c in counts if c), default=0)
    if n == 0:
        return [[] if c == 0 else None for c in counts]
    values, ids = logprobs.topk(n, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [None if c is None else list(zip(ids[i][:c], values[i][:c], strict=True)) for i, c in enumerate(counts)]


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> Sampled:
    """One token per row of `logits` [B, V], drawn on the logits' device (each row with its own seeded
    generator, which lives there too); the results cross to the host once for the whole batch.

    A sampled row takes argmax(p / E) with E_i ~ Exp(1) drawn by its generator: the index of the smallest
    E_i / p_i, which is token i with probability p_i (the exponential race), without a host round trip."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        probs = filter_logits(logits[idx], [params[i] for i in rows]).softmax(-1)
        noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=generators[i]) for i in rows])
        tokens[idx] = (probs / noise).argmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    top = top_logprobs(logprobs, [p.logprobs for p in params])
    return Sampled(tokens.tolist(), chosen.tolist(), top)
