"""NVIDIA kvpress on the long-context cases slimlm generated, in kvpress' own venv (python + transformers only).

    /path/to/kvpress-venv/bin/python benchmarks/peers/kvpress_run.py cases.json out.json

cases.json (written by benchmarks/long_context.py): {"model": dir, "budgets": [...], "cases": [{"prompt": ids,
"answer": text, "max_tokens": n, ...}]}. Each case runs as slimlm runs it: the whole prompt (question
included) prefilled with the press compressing each layer's cache to `budget` prompt tokens (SnapKVPress with
slimlm's window of 32 and pooling of 5; StreamingLLMPress with its 4 sink tokens), the first token from that
prefill, then greedy decoding at the tokens' own positions (kvpress' pipeline does the same). Writes one row per
case and press, in slimlm's long-context row format.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

import torch
from kvpress import SnapKVPress, StreamingLLMPress
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache


def greedy(model, prompt: list[int], press, max_tokens: int) -> tuple[list[int], int]:
    """The tokens, and the cache length (tokens kept) after the prompt."""
    cache = DynamicCache()
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            logits = model(torch.tensor([prompt]), past_key_values=cache, logits_to_keep=1).logits
        kept = cache.get_seq_length()
        tokens = [int(logits[0, -1].argmax())]
        for i in range(max_tokens - 1):
            position = torch.tensor([[len(prompt) + i]])
            logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=position).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens, kept


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    dtype = getattr(torch, spec.get("dtype", "float32"))  # slimlm's activation dtype, so the caches weigh the same
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    per_token = spec["kv_bytes_per_token"]
    rows, start = [], time.perf_counter()
    for n, case in enumerate(spec["cases"], 1):
        prompt = case["prompt"]
        for name, budget in [(kind, b) for b in spec["budgets"] for kind in ("kvpress-streaming", "kvpress-snapkv")]:
            if budget >= len(prompt):
                continue
            ratio = 1 - budget / len(prompt)
            if name == "kvpress-snapkv":
                press = SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=5)
            else:
                press = StreamingLLMPress(compression_ratio=ratio, n_sink=4)
            tokens, kept = greedy(model, prompt, press, case["max_tokens"])
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            rows.append(
                {
                    "task": case["task"],
                    "length": case["length"],
                    "depth": case["depth"],
                    "policy": name,
                    "budget": budget,
                    "correct": text.strip().startswith(case["answer"].strip()),
                    "output_tokens": len(tokens),
                    "kv_tokens": kept + len(tokens) - 1,
                    "kv_bytes": (kept + len(tokens) - 1) * per_token,
                }
            )
        print(f"  kvpress case {n}/{len(spec['cases'])}: {time.perf_counter() - start:.0f} s", flush=True)
    json.dump({"rows": rows, "seconds": time.perf_counter() - start}, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
