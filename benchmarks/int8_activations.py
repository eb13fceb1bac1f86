"""What AVX2's 4-bit loop gains in batch-1 decode and in prompt processing, and costs in perplexity, by
quantizing x to int8 (cpu_gemm's "int8" loop, against the fp32 loops it replaced), on one checkpoint loaded
once, in one run.

Decode: steps at batch 1 with 256 cached tokens (random KV), the two loops in turns, against the bandwidth
floor (the packed weights read once per step, at the read bandwidth measured here). Prompt: the time to the
first token of a --prompt-tokens prompt through the engine (a request with max_tokens 1), its prompt step
run exact (the fused loop and fp32 slices, as a scored prompt runs) or not (the int8 loop, as every other
prompt runs), in turns. Perplexity: the same
windows through each loop, with the loop forced for every row count, so the prefill that scores the windows
multiplies x̂ exactly as a decode step does. On a CPU with AVX-512, SLIMLM_CPU_MARCH=haswell runs the AVX2
build (the machine's memory, AVX2's instructions; torch's own matmuls keep this CPU's).

    SLIMLM_CPU_MARCH=haswell PYTHONPATH=. .venv/bin/python benchmarks/int8_activations.py CKPT \
        [--max-tokens 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

from slimlm import kernels
from slimlm.eval import perplexity
from slimlm.kernels import cpu_gemm, cpu_library
from slimlm.kernels.packed import PackedWeight
from slimlm.perf.offline import decode_inputs
from slimlm.runtime.sampling import SamplingParams

CONTEXT = 256
RUN = 10  # steps back to back per loop and turn


@contextlib.contextmanager
def forced(loop: str):
    """cpu_gemm.path answering `loop` wherever the int8 loop would run a decode step, prompt tokens included."""
    path = cpu_gemm.path

    def int8_here(dtype, w) -> bool:
        with cpu_gemm.exact_activations(False):
            return path(1, dtype, w) == "int8"

    cpu_gemm.path = lambda rows, dtype, w: loop if int8_here(dtype, w) else path(rows, dtype, w)
    try:
        yield
    finally:
        cpu_gemm.path = path


def read_bandwidth() -> float:
    big = torch.ones(1 << 28)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - start)
    return big.nbytes / statistics.median(times)


def weight_bytes(model) -> int:
    total = 0
    for module in model.modules():
        packed: PackedWeight | None = getattr(module, "packed", None)
        if packed is not None:
            total += packed.codes.nbytes + packed.scales.nbytes + packed.zeros.nbytes
        elif getattr(module, "weight", None) is not None and module is not model.model.embed_tokens:
            total += module.weight.nbytes
    return total


def first_token_s(engine, prompt: list[int], exact: bool) -> float:
    """One request's time to its first token; `exact`: its prompt step run as a scored prompt's (and, before
    2026-12-04, every prompt's) with exact activations, by making the runner's choice always exact."""
    chosen = kernels.exact_activations
    if exact:
        kernels.exact_activations = lambda scored=True: chosen(True)
    try:
        start = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step(detokenize=False)
        return time.perf_counter() - start
    finally:
        kernels.exact_activations = chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_library.vector_bits() != 256:
        raise SystemExit("this CPU runs the AVX-512 build; set SLIMLM_CPU_MARCH=haswell to measure the AVX2 one")
    engine = perplexity.engine_for(
        args.model, max(args.seq_len, args.prompt_tokens), dtype="float32", prefix_caching=False
    )
    runner, loops = engine.runner, ("fused", "int8")
    runner.kv_cache.normal_()
    ids, step = decode_inputs(1, CONTEXT, engine.config.block_size)
    times = {loop: [] for loop in loops}
    with torch.inference_mode():
        for _ in range(args.turns):
            for loop in loops:
                with forced(loop):
                    runner.model.logits(runner.model(ids, step, runner.kv_cache))  # warm
                    for _ in range(RUN):
                        start = time.perf_counter()
                        runner.model.logits(runner.model(ids, step, runner.kv_cache))
                        times[loop].append(time.perf_counter() - start)
    prompt = torch.randint(3, 1000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    ttft = {"exact": [], "int8": []}
    first_token_s(engine, prompt, False)  # warm
    for _ in range(args.turns):
        for name, exact in (("exact", True), ("int8", False)):
            ttft[name].append(first_token_s(engine, prompt, exact))
    nbytes, bandwidth = weight_bytes(runner.model), read_bandwidth()
    floor = nbytes / bandwidth
    ppl = {}
    for loop in loops:
        with forced(loop):
            ppl[loop] = perplexity.perplexity(engine, "wiki", args.seq_len, args.max_tokens, progress=False)
    step_s = {loop: statistics.median(times[loop]) for loop in loops}
    print(
        f"{args.model}: {args.threads} threads, fp32, -march={os.environ.get('SLIMLM_CPU_MARCH', 'native')} "
        f"(vector bits {cpu_library.vector_bits()}); floor {floor * 1e3:.1f} ms per step "
        f"({nbytes / 1e6:.0f} MB of weights at {bandwidth / 1e9:.1f} GB/s)"
    )
    print(f"{'loop':8s} {'ms/step':>8s} {'tok/s':>7s} {'÷floor':>7s} {'wiki ppl':>9s}")
    for loop in loops:
        print(
            f"{loop:8s} {step_s[loop] * 1e3:8.1f} {1 / step_s[loop]:7.2f} {step_s[loop] / floor:7.2f} "
            f"{ppl[loop]['perplexity']:9.4f}"
        )
    print(
        f"int8 / fused: decode {step_s['fused'] / step_s['int8']:.2f}× faster, perplexity "
        f"{100 * (ppl['int8']['perplexity'] / ppl['fused']['perplexity'] - 1):+.3f}% "
        f"({ppl['int8']['tokens_scored']} tokens)"
    )
    best = {name: min(t) for name, t in ttft.items()}
    print(
        f"prompt of {args.prompt_tokens} tokens, first token: exact {best['exact']:.2f} s "
        f"({args.prompt_tokens / best['exact']:.1f} tok/s), int8 {best['int8']:.2f} s "
        f"({args.prompt_tokens / best['int8']:.1f} tok/s): {best['exact'] / best['int8']:.2f}× faster"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "step_seconds": times,
                    "first_token_seconds": ttft,
                    "floor_seconds": floor,
                    "weight_bytes": nbytes,
                    "read_bandwidth": bandwidth,
                    "perplexity": ppl,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
