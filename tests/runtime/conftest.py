"""Helpers for comparing the runtime with a reference model through log-probabilities of given tokens."""

from __future__ import annotations

import torch


def next_token_logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """log p(ids[i+1] | ids[..i]) from logits [len(ids), vocab]."""
    return torch.log_softmax(logits.float(), -1)[torch.arange(len(ids) - 1), ids[1:]]


def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The same, from a transformers-style model (ours dequantized, or theirs)."""
    with torch.no_grad():
        return next_token_logprobs(model(torch.tensor([ids])).logits[0], ids)


def transformers_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens of a transformers model, end-of-sequence included like any token (as ignore_eos does;
    generate()'s min_new_tokens instead forbids it, which changes the text)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]
