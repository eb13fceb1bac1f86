"""Perplexity over fixed, non-overlapping windows of a text source.

Method: passages in file order, tokenized and joined with EOS (slimlm.data.token_stream), cut into
consecutive windows of `seq_len` tokens; the first `max_tokens // seq_len` windows are scored. Each window is
an independent sequence, so every token but its first is predicted from the tokens before it in the window:
`windows × (seq_len − 1)` tokens are scored. ppl = exp(mean negative log-likelihood).
"""

from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm

from slimlm import SlimlmError, data


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    tokenizer,
    source: str = "wiki",
    seq_len: int = 512,
    max_tokens: int = 16384,
    batch_size: int = 4,
    progress: bool = True,
) -> dict:
    ids = data.token_stream(data.passages(source), tokenizer, max_tokens=max_tokens)
    batch = data.windows(ids, seq_len, max(1, max_tokens // seq_len))
    if len(batch) == 0:
        raise SlimlmError(f"'{source}' has fewer than {seq_len} tokens; lower --seq-len")
    device = next(model.parameters()).device
    nll = 0.0
    start = time.time()
    for i in tqdm(range(0, len(batch), batch_size), desc=f"ppl {source}", unit="batch", disable=not progress):
        x = batch[i : i + batch_size].to(device)
        logits = model(input_ids=x, use_cache=False).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        nll -= logp.gather(-1, x[:, 1:, None]).double().sum().item()
        if not math.isfinite(nll):
            raise SlimlmError("the model produced non-finite log-probabilities; the weights are broken")
    scored = len(batch) * (seq_len - 1)
    return {
        "source": source,
        "perplexity": math.exp(nll / scored),
        "seq_len": seq_len,
        "windows": len(batch),
        "tokens_scored": scored,
        "seconds": round(time.time() - start, 2),
        "method": "non-overlapping windows of a passage stream joined with EOS; all but each window's first "
        "token scored",
    }
