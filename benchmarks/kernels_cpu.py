"""CPU quantized linears vs dense fp32 and bf16 matmul, all measured in the same run.

Shapes: the default model's linear layers (SmolLM2-135M: hidden 576, 3 KV heads × 64, MLP 1536, vocab 49152),
one whole decoder layer's seven linears back to back, and one Llama-7B-sized matrix (8192×4096) where the
weight bytes, not call overhead, decide. Weights are random Gaussians quantized by the real RTN quantizer
(4-bit and 8-bit, groups of 64, asymmetric). Each cell is the median of repeated calls after a warm-up,
with all the candidates of a cell timed in turn.

    .venv/bin/python benchmarks/kernels_cpu.py [--threads 2] [--rows 1,4,16,64,256]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from slimlm.kernels import cpu_gemm, reference
from tests.kernels.problems import quantized_weight, relative_error

SMOLLM2 = {
    "q_proj/o_proj": (576, 576),
    "k_proj/v_proj": (192, 576),
    "gate/up_proj": (1536, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}
LAYER = [
    "q_proj/o_proj",
    "k_proj/v_proj",
    "k_proj/v_proj",
    "q_proj/o_proj",
    "gate/up_proj",
    "gate/up_proj",
    "down_proj",
]
LARGE = {"8192x4096": (8192, 4096)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def interleaved_ms(fns: dict, budget_s: float = 1.0) -> dict[str, float]:
    """Median ms of each candidate, timed round-robin so that the baseline and the quantized paths share the
    machine's moods (on a shared VM single timings drift by ±30% within a minute)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end or min(len(t) for t in times.values()) < 5:
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def dense_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T


def each(matmul, xs: list, ws: list):
    """One call that runs every (input, weight) pair: a shape list is timed as a whole."""
    return lambda: [matmul(x, w) for x, w in zip(xs, ws, strict=True)]


def run(shapes: dict[str, list[tuple[int, int]]], rows: list[int]) -> list[dict]:
    results = []
    for name, mats in shapes.items():
        dense = [torch.randn(n, k) for n, k in mats]
        dense_bf16 = [w.bfloat16() for w in dense]
        packed = {
            bits: [quantized_weight(n, k, bits, 64, sym=False, seed=i)[1] for i, (n, k) in enumerate(mats)]
            for bits in (4, 8)
        }
        for m in rows:
            xs = [torch.randn(m, k) for _, k in mats]
            xs_bf16 = [x.bfloat16() for x in xs]
            fns = {"fp32": each(dense_mm, xs, dense), "bf16": each(dense_mm, xs_bf16, dense_bf16)}
            for bits in (4, 8):  # the quantized paths with fp32 and with bf16 activations
                fns[f"int{bits} fp32"] = each(cpu_gemm.quant_matmul, xs, packed[bits])
                fns[f"int{bits} bf16"] = each(cpu_gemm.quant_matmul, xs_bf16, packed[bits])
            t = interleaved_ms(fns)
            row = {"shape": name, "M": m, "k": mats[0][1], "fp32_ms": t["fp32"], "bf16_ms": t["bf16"]}
            for bits in (4, 8):
                w = packed[bits][0]
                best = "fp32" if t[f"int{bits} fp32"] <= t[f"int{bits} bf16"] else "bf16"
                row[f"int{bits}_ms"] = t[f"int{bits} {best}"]
                row[f"int{bits}_path"] = f"{best} " + cpu_gemm.path(m, DTYPES[best], w)
                for kind, x in (("fp32", xs[0]), ("bf16", xs_bf16[0])):
                    exact = reference.quant_matmul(x.double(), w)
                    row[f"int{bits}_err_{kind}"] = relative_error(cpu_gemm.quant_matmul(x, w).float(), exact)
            results.append(row)
            print(format_row(row), flush=True)
    return results


HEADER = (
    f"{'shape':<14}{'M':>4}{'fp32 ms':>9}{'bf16 ms':>9}{'int8 ms':>9}{'÷fp32':>7}{'÷bf16':>7}"
    f"{'int4 ms':>9}{'÷fp32':>7}{'÷bf16':>7}  {'int4 path':<18} int8 path"
)


def format_row(r: dict) -> str:
    cells = [f"{r['shape']:<14}{r['M']:>4}{r['fp32_ms']:>9.3f}{r['bf16_ms']:>9.3f}"]
    for bits in (8, 4):
        t = r[f"int{bits}_ms"]
        cells.append(f"{t:>9.3f}{r['fp32_ms'] / t:>6.2f}×{r['bf16_ms'] / t:>6.2f}×")
    return "".join(cells) + f"  {r['int4_path']:<18} {r['int8_path']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [int(m) for m in args.rows.split(",")]
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads")
    print("ratios: dense time ÷ quantized time (above 1: the quantized path is faster). int err: rel. error vs float64")
    print(HEADER)
    shapes = {name: [shape] for name, shape in {**SMOLLM2, **LARGE}.items()}
    shapes["decoder layer"] = [SMOLLM2[n] for n in LAYER]
    results = run(shapes, rows)
    for kind, bound in (("fp32", "1e-5: fp32 accumulation"), ("bf16", "bf16 output rounding")):
        worst = max(r[f"int{bits}_err_{kind}"] for r in results for bits in (4, 8))
        print(f"largest relative error vs float64, {kind} x: {worst:.1e} ({bound})")
    for shape in ("8192x4096", "decoder layer"):
        cells = {r["M"]: r for r in results if r["shape"] == shape}
        for bits in (4, 8):
            worst = min(cells.values(), key=lambda r: r["bf16_ms"] / r[f"int{bits}_ms"])
            print(
                f"{shape} int{bits}: ≥ {worst['bf16_ms'] / worst[f'int{bits}_ms']:.2f}× dense bf16 at every M "
                f"(lowest at M={worst['M']}; want ≥ 1.0)"
            )
        if 1 in cells:
            print(f"{shape} int4 at M=1: {cells[1]['fp32_ms'] / cells[1]['int4_ms']:.2f}× dense fp32 (want ≥ 3)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
