"""What a sequence keeps of its KV history: all of it, a sliding window, or what its prompt's end attends to.

- full: every token (the default).
- window (StreamingLLM, Xiao et al. 2023): the first block, whose first tokens are the "attention sinks" a
  model leans on, plus the most recent tokens; older blocks are evicted whole as the sequence grows, so a
  request holds at most `budget` tokens (rounded up to a block) however long it runs.
- snapkv (Li et al. 2024): once the prompt is in, each layer and KV head keeps the prompt positions the
  prompt's last OBSERVATION queries attend to most (attention summed over those queries and the head's group
  of query heads, smoothed over POOL neighbours), plus the observation window itself: `budget` tokens in all.
  Generated tokens are all kept after that, as in the paper: it bounds the prompt, not the output.

Both act only once the whole prompt has been computed with the full cache (as SnapKV and kvpress do), so the
first generated token is the full cache's, and a policy that evicts nothing leaves the output unchanged. In the
paged cache an eviction is block bookkeeping (BlockManager.evict, .compact): positions stay absolute (RoPE is
already in the cached keys), attention reads the resident tokens in order, and a sequence that evicted
anything stops publishing blocks to the prefix cache, since its later K/V were computed over a history
another request would not have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slimlm.errors import FieldError

KINDS = ("full", "window", "snapkv")
OBSERVATION = 32  # SnapKV's observation window: the prompt's last queries, whose attention picks what stays
POOL = 5  # positions averaged around each one, so a kept token brings its neighbours (kvpress' default too)
SINK_BLOCKS = 1  # window: the first block stays; StreamingLLM's four sink tokens are in it


@dataclass(frozen=True)
class KVPolicy:
    kind: str = "full"
    budget: int = 1024  # tokens of history a sequence keeps (window, snapkv)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FieldError("kv_policy", f"{self.kind!r} is not one of {', '.join(KINDS)}")
        if type(self.budget) is not int or self.budget <= 0:
            raise FieldError("kv_budget", f"must be a positive integer, got {self.budget!r}")

    def __str__(self) -> str:
        """As --kv-policy/--policies write it: full, window:512, snapkv:1024."""
        return self.kind if self.kind == "full" else f"{self.kind}:{self.budget}"

    def check(self, block_size: int) -> None:
        """Refuse a budget too small for the policy's fixed parts."""
        least = {"full": 1, "window": (SINK_BLOCKS + 1) * block_size, "snapkv": 2 * OBSERVATION}[self.kind]
        if self.budget < least:
            raise FieldError(
                "kv_budget",
                f"{{kv_budget}} {self.budget} is too small for {{kv_policy}} {self.kind}: it keeps at least "
                f"{least} tokens"
                + (f" (the sink block and one more of {block_size})" if self.kind == "window" else "")
                + f"; give {{kv_budget}} >= {least}",
            )

    def observed_from(self, prompt_len: int) -> int | None:
        """The first prompt position whose query SnapKV reads, so it must be computed rather than taken from the
        prefix cache; None when the policy observes nothing of such a prompt (it fits the budget)."""
        return prompt_len - OBSERVATION if self.kind == "snapkv" and prompt_len > self.budget else None

    def drafts(self, resident: int, room: int) -> int:
        """Of `room` drafted tokens, how many one speculative step may verify for a sequence holding `resident`
        tokens and still give plain decoding's output: a window evicts after any token that takes it past its
        budget, while one pass computes all its tokens over one resident set, so drafts stop at that point."""
        return max(0, min(room, self.budget - resident)) if self.kind == "window" else room


def window_eviction(budget: int, resident: int, block_size: int) -> int:
    """How many whole blocks after the sink a window sequence with `resident` tokens gives up to get back
    within `budget`. With a budget of at least two blocks (check) that is never the last block, which may be
    partial and is where a rejected draft rolls back: resident - budget <= resident - 2 blocks."""
    return max(0, -(-(resident - budget) // block_size))


def snapkv_keep(queries: torch.Tensor, keys: torch.Tensor, prompt_len: int, scale: float, budget: int) -> torch.Tensor:
    """The positions one layer keeps, sorted, per KV head: int64 [kv_heads, n].

    queries [W, heads, D]: the prompt's last W queries (rotated), at positions prompt_len-W..prompt_len-1;
    keys [L, kv_heads, D]: the layer's cached keys (rotated), L >= prompt_len. The window and every token after
    the prompt stay; of the positions before the window, the most attended fill the rest of `budget`. A
    constant added to every key (a 4-bit cache stores keys less an offset) changes no softmax, so keys may come
    as the cache holds them."""
    w, heads, dim = queries.shape
    length, kv_heads = keys.shape[0], keys.shape[1]
    start = prompt_len - w  # the window's first position
    q = queries.float().reshape(w, kv_heads, heads // kv_heads, dim)  # query head h reads KV head h // group
    logits = torch.einsum("wkgd,lkd->kgwl", q, keys[:prompt_len].float()) * scale
    future = torch.arange(prompt_len)[None, :] > torch.arange(start, prompt_len)[:, None]  # [W, prompt_len]
    attention = logits.masked_fill(future, float("-inf")).softmax(-1).sum((1, 2))[:, :start]  # [kv_heads, start]
    pooled = F.avg_pool1d(attention[:, None], POOL, stride=1, padding=POOL // 2, count_include_pad=False)[:, 0]
    chosen = max(0, min(start, budget - (length - start)))
    top = pooled.topk(chosen, dim=-1).indices.sort(-1).values
    return torch.cat([top, torch.arange(start, length).expand(kv_heads, -1)], dim=-1)
