"""Greedy generation through a quantized KV cache against the same checkpoint's float32 cache, in one run.

Perplexity scores prompts only (prefill); this decodes, so it sees the decode paths (the one-call decode stack
included). For each checkpoint: 8 wiki prompts of 96 tokens, 64 greedy tokens each, with the checkpoint's own
KV cache (`kv_cache_dtype="auto"`) and with a float32 one; prints how many tokens each keeps in common from
the start, and the share of positions that agree.

    .venv/bin/python benchmarks/kv_greedy_agreement.py DIR [DIR ...] [--prompts 8] [--tokens 64]
"""

from __future__ import annotations

import argparse

from slimlm import data
from slimlm.runtime.llm import LLM
from slimlm.runtime.sampling import SamplingParams


def greedy(model: str, kv: str, texts: list[str], prompt_len: int, tokens: int) -> list[list[int]]:
    llm = LLM(model, dtype="float32", kv_cache_dtype=kv)
    ids = [llm.tokenizer.encode(t)[:prompt_len] for t in texts]
    outs = llm.generate(ids, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="+", help="checkpoint directories with a kv_cache_scheme")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    texts = data.passages("wiki")[: a.prompts * 50 : 50]
    for model in a.checkpoints:
        ref = greedy(model, "float32", texts, a.prompt_len, a.tokens)
        got = greedy(model, "auto", texts, a.prompt_len, a.tokens)
        prefixes = [common_prefix(x, y) for x, y in zip(ref, got, strict=True)]
        agree = sum(x == y for r, g in zip(ref, got, strict=True) for x, y in zip(r, g, strict=True))
        print(
            f"{model}: common prefix with the float32 cache {prefixes}, mean {sum(prefixes) / len(prefixes):.1f} "
            f"of {a.tokens}; positions agreeing {agree / sum(map(len, ref)):.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
