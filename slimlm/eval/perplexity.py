"""Perplexity over fixed, non-overlapping windows of a text source, computed by the runtime that serves
the checkpoint (so it measures what is served: the runtime's kernels, scales and dtype).

Method: passages in file order, tokenized and joined with EOS (slimlm.data.token_stream), cut into
consecutive windows of `seq_len` tokens; the first `max_tokens // seq_len` windows are scored. Each window is
an independent prompt, so every token but its first is predicted from the tokens before it in the window:
`windows × (seq_len − 1)` tokens are scored. ppl = exp(mean negative log-likelihood).
"""

from __future__ import annotations

import math
import time

from slimlm import data, devices, models
from slimlm.errors import FieldError, SlimlmError
from slimlm.eval import batch
from slimlm.runtime.engine import Engine, EngineConfig
from slimlm.runtime.sampling import SamplingParams


def engine_for(model: str, seq_len: int, **config) -> Engine:
    """An engine sized for scoring windows of `seq_len` (its context need not be the model's)."""
    check_window(seq_len, models.context_length(models.read_config(models.resolve(model))))
    try:
        return Engine(model, EngineConfig(max_model_len=seq_len + 1, **config))
    except FieldError as e:  # the engine's max_model_len is the window
        raise FieldError(e.field, e.problem.replace("{max_model_len}", "{seq_len}")) from None


def check_window(seq_len: int, context: int) -> None:
    if seq_len >= context:
        raise FieldError(
            "seq_len",
            f"{seq_len} exceeds the model's context ({context} tokens) less the one the runtime generates; use at "
            f"most {context - 1}",
        )


def perplexity(
    engine: Engine, source: str = "wiki", seq_len: int = 512, max_tokens: int = 16384, progress: bool = True
) -> dict:
    check_window(seq_len, engine.max_model_len)
    ids = data.token_stream(data.passages(source), engine.tokenizer, max_tokens=max_tokens)
    windows = data.windows(ids, seq_len, max(1, max_tokens // seq_len)).tolist()
    if not windows:
        raise FieldError("seq_len", f"'{source}' has fewer than {seq_len} tokens; lower {{seq_len}}")
    start = time.time()
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outputs = batch.run(engine, windows, [params] * len(windows), desc=f"ppl {source}", progress=progress)
    nll = -math.fsum(lp for out in outputs for lp in out.prompt_logprobs)
    if not math.isfinite(nll):
        raise SlimlmError("the model produced non-finite log-probabilities; the weights are broken")
    scored = len(windows) * (seq_len - 1)
    seconds = time.time() - start
    return {
        "source": source,
        "perplexity": math.exp(nll / scored),
        "seq_len": seq_len,
        "windows": len(windows),
        "tokens_scored": scored,
        "seconds": round(seconds, 2),
        "tokens_per_second": round(len(windows) * seq_len / seconds, 1),
        "engine": {"dtype": devices.dtype_name(engine.dtype), "device": str(engine.device)},
        "method": "non-overlapping windows of a passage stream joined with EOS; all but each window's first "
        "token scored, through the slimlm runtime",
    }
