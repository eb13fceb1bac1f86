"""CPU quantized linears vs dense fp32 and bf16 matmul, all measured in the same run.

Shapes: the default model's linear layers (SmolLM2-135M: hidden 576, 3 KV heads × 64, MLP 1536, vocab 49152),
one whole decoder layer's seven linears back to back, and one Llama-7B-sized matrix (8192×4096) where the
weight bytes, not call overhead, decide. Weights are random Gaussians quantized by the real RTN quantizer
(4-bit and 8-bit, groups of 64, asymmetric). Each cell is the median of repeated calls after a warm-up.

    .venv/bin/python benchmarks/kernels_cpu.py [--threads 2] [--rows 1,4,16,64]
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

SMOLLM2 = {"q_proj/o_proj": (576, 576), "k_proj/v_proj": (192, 576), "gate/up_proj": (1536, 576),
           "down_proj": (576, 1536), "lm_head": (49152, 576)}  # fmt: skip
LAYER = ["q_proj/o_proj", "k_proj/v_proj", "k_proj/v_proj", "q_proj/o_proj", "gate/up_proj", "gate/up_proj",
         "down_proj"]  # fmt: skip
LARGE = {"8192x4096": (8192, 4096)}


def median_ms(fn, budget_s: float = 0.25) -> float:
    fn()
    times = []
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


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
        packed = {bits: [quantized_weight(n, k, bits, 64, sym=False, seed=i)[1] for i, (n, k) in enumerate(mats)]
                  for bits in (4, 8)}  # fmt: skip
        k_in = mats[0][1]
        for m in rows:
            xs = [torch.randn(m, k) for _, k in mats]
            xs_bf16 = [x.bfloat16() for x in xs]
            row = {"shape": name, "M": m, "fp32_ms": median_ms(each(dense_mm, xs, dense)),
                   "bf16_ms": median_ms(each(dense_mm, xs_bf16, dense_bf16))}  # fmt: skip
            for bits in (4, 8):
                ws = packed[bits]
                # the better of fp32 and bf16 activations, each on the path quant_matmul takes for it
                t32 = median_ms(each(cpu_gemm.quant_matmul, xs, ws))
                t16 = median_ms(each(cpu_gemm.quant_matmul, xs_bf16, ws))
                best, best_x = (
                    (t32, "fp32 " + path(m, torch.float32)) if t32 <= t16 else (t16, "bf16 " + path(m, torch.bfloat16))
                )
                row[f"int{bits}_ms"], row[f"int{bits}_path"] = best, best_x
                exact = reference.quant_matmul(xs[0].double(), ws[0])
                row[f"int{bits}_err"] = relative_error(cpu_gemm.quant_matmul(xs[0], ws[0]), exact)
            row["k"] = k_in
            results.append(row)
            print(format_row(row), flush=True)
    return results


def path(m: int, dtype: torch.dtype) -> str:
    return "dequant-slices+matmul" if cpu_gemm.dequantizes_slices(m, dtype) else "fused"


HEADER = (f"{'shape':<14}{'M':>4}{'fp32 ms':>9}{'bf16 ms':>9}{'int8 ms':>9}{'÷fp32':>7}{'÷bf16':>7}"
          f"{'int4 ms':>9}{'÷fp32':>7}{'÷bf16':>7}  int4 path")  # fmt: skip


def format_row(r: dict) -> str:
    cells = [f"{r['shape']:<14}{r['M']:>4}{r['fp32_ms']:>9.3f}{r['bf16_ms']:>9.3f}"]
    for bits in (8, 4):
        t = r[f"int{bits}_ms"]
        cells.append(f"{t:>9.3f}{r['fp32_ms'] / t:>6.2f}×{r['bf16_ms'] / t:>6.2f}×")
    return "".join(cells) + f"  {r['int4_path']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,64")
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
    worst = max(max(r["int4_err"], r["int8_err"]) for r in results)
    print(f"largest relative error of any quantized path vs float64: {worst:.1e}")
    large = {r["M"]: r for r in results if r["shape"] in LARGE}
    if 1 in large:
        r = large[1]
        print(f"target (8192x4096, M=1): int4 {r['fp32_ms'] / r['int4_ms']:.2f}× fp32 (want ≥ 2), "
              f"{r['bf16_ms'] / r['int4_ms']:.2f}× bf16 (want > 1)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
