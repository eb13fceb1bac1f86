"""Everything the GPU must tell us, in one run (called by benchmarks/device_check.sh; see shared/device/README.md).

1. ceilings: device-to-device copy bandwidth and dense bf16 matmul rate;
2. correctness of every Triton kernel against its float64 reference on the GPU (fresh random inputs,
   outputs poisoned with NaN);
3. W4A16 GEMM vs torch bf16 matmul (cuBLAS) for M = 1..256 at Llama-8B/70B shapes;
4. paged decode attention: achieved KV bandwidth vs the copy bandwidth, batch 1..64, context 512..8192.
Results go to $OUT/device_check.json; a short ratio table is printed last.

--dry-run runs the same code on CPU through the Triton interpreter, with tiny shapes and every timing
replaced by one untimed call, so the script can be checked end to end without a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from slimlm.kernels import reference, triton_attention, triton_gemm  # noqa: E402
from slimlm.kernels.packed import BLOCK_N, PackedWeight  # noqa: E402
from slimlm.kernels.problems import paged_problem, poisoned_allocations, quantized_weight, relative_error  # noqa: E402

GEMM_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # (K, N)
GEMM_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
ATTN_BATCH = [1, 4, 16, 64]
ATTN_CONTEXT = [512, 2048, 8192]
LLAMA8B_ATTN = dict(heads=32, kv_heads=8, head_dim=128)


def bench_ms(fn) -> float:
    """Median milliseconds over CUDA-event-timed repeats (L2 flushed before each); NaN in a dry run."""
    if DRY:
        fn()
        return math.nan
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def ceilings(device: str) -> dict:
    n = (1 << 28) if not DRY else (1 << 12)  # 1 GiB of fp32
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    size = 8192 if not DRY else 64
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    mm_ms = bench_ms(lambda: a @ b)
    return {"copy_GBps": 2 * src.nbytes / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * size**3 / mm_ms / 1e9}


def correctness(device: str) -> list[dict]:
    """The kernel tests' cases, on the GPU: worst relative error per kernel and dtype vs float64."""
    results = []
    dtypes = [torch.float16, torch.bfloat16, torch.float32] if not DRY else [torch.float16, torch.float32]
    for bits, group, sym, act_order in [(4, 128, True, False), (4, 64, False, True), (8, -1, True, False)]:
        _, w = quantized_weight(300, 512, bits, group, sym, act_order, seed=bits)
        w = w.to(device)
        for dtype in dtypes:
            worst = 0.0
            for m in (1, 7, 33, 130):
                x = torch.randn(m, 512, device=device).to(dtype)
                with poisoned_allocations():
                    out = triton_gemm.quant_matmul(x, w)
                worst = max(worst, relative_error(out, reference.quant_matmul(x.double(), w)))
            name = f"w{bits}a16 g{group} {'sym' if sym else 'asym'}{' act-order' if act_order else ''}"
            results.append({"kernel": name, "dtype": str(dtype), "rel_err": worst})
    for kv_dtype in [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8]:
        for q_dtype in dtypes:
            for name, q_lens in (("decode", [1] * 5), ("prefill", [30, 17, 1, 64, 5])):
                problem = paged_problem([30, 90, 16, 200, 9], q_lens, 8, 2, 128, 16, kv_dtype, q_dtype, device, 1)
                with poisoned_allocations():
                    out = triton_attention.paged_attention(*problem.args())
                ref = reference.paged_attention(*problem.args(), dtype=torch.float64)
                results.append({"kernel": f"paged {name} kv={kv_dtype}".replace("torch.", ""), "dtype": str(q_dtype),
                                "rel_err": relative_error(out, ref)})  # fmt: skip
    return results


def random_w4(k: int, n: int, device: str, group: int = 128) -> PackedWeight:
    """A W4 g128 weight of real shape with random codes and scales: quantizing 235M floats on the host
    would eat the time budget, and the kernel's speed does not depend on where the codes came from."""
    blocks = n // BLOCK_N
    return PackedWeight(
        codes=torch.randint(0, 256, (blocks, k, BLOCK_N // 2), dtype=torch.uint8, device=device),
        scales=(torch.rand(blocks, k // group, BLOCK_N, device=device) * 0.01 + 0.001).half(),
        zeros=torch.randint(0, 16, (blocks, k // group, BLOCK_N), dtype=torch.uint8, device=device),
        bits=4, group_size=group, out_features=n,
    )  # fmt: skip


def gemm(device: str) -> list[dict]:
    shapes = GEMM_SHAPES if not DRY else [(256, 128)]
    rows = GEMM_ROWS if not DRY else [1, 16, 130]
    results = []
    for k, n in shapes:
        w = random_w4(k, n, device)
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            t_q = bench_ms(functools.partial(triton_gemm.quant_matmul, x, w))
            t_bf16 = bench_ms(functools.partial(torch.matmul, x, dense.T))
            launch = triton_gemm.config(m, k, n // BLOCK_N)
            results.append({"K": k, "N": n, "M": m, "w4a16_ms": t_q, "bf16_ms": t_bf16, "speedup": t_bf16 / t_q,
                            "w4a16_GBps": w.nbytes() / t_q / 1e6, "launch": launch})  # fmt: skip
            print(f"gemm K={k} N={n} M={m}: w4a16 {t_q:.4f} ms  bf16 {t_bf16:.4f} ms  {t_bf16 / t_q:.2f}×", flush=True)
    return results


def decode_attention(device: str, copy_gbps: float) -> list[dict]:
    batches = ATTN_BATCH if not DRY else [1, 3]
    contexts = ATTN_CONTEXT if not DRY else [40]
    shape = LLAMA8B_ATTN if not DRY else dict(heads=4, kv_heads=2, head_dim=64)
    results = []
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for batch in batches:
            for context in contexts:
                p = paged_problem([context] * batch, [1] * batch, **shape, block_size=16, kv_dtype=kv_dtype,
                                  q_dtype=torch.bfloat16 if not DRY else torch.float32, device=device)  # fmt: skip
                t = bench_ms(functools.partial(triton_attention.paged_attention, *p.args()))
                gbps = p.kv_bytes() / t / 1e6
                results.append({"kv_dtype": str(kv_dtype), "batch": batch, "context": context, "ms": t,
                                "GBps": gbps, "of_copy_bw": gbps / copy_gbps})  # fmt: skip
                print(f"decode attn {kv_dtype} batch={batch} ctx={context}: {t:.4f} ms {gbps:.0f} GB/s", flush=True)
    return results


def summary(report: dict) -> str:
    ceil = report["ceilings"]
    lines = [f"copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
             f"correctness: worst rel. error {max(r['rel_err'] for r in report['correctness']):.2e} over "
             f"{len(report['correctness'])} kernel/dtype cases",
             "W4A16 ÷ bf16 cuBLAS time (speedup), per M:",
             "  K×N".ljust(16) + "".join(f"{m:>7}" for m in sorted({r['M'] for r in report['gemm']}))]  # fmt: skip
    for k, n in sorted({(r["K"], r["N"]) for r in report["gemm"]}):
        cells = [r for r in report["gemm"] if (r["K"], r["N"]) == (k, n)]
        lines.append(f"  {k}×{n}".ljust(16) + "".join(f"{r['speedup']:>6.2f}×" for r in cells))
    lines.append("paged decode attention, share of copy bandwidth (batch × context):")
    for r in report["decode_attention"]:
        lines.append(f"  {r['kv_dtype']:<20} b={r['batch']:<3} ctx={r['context']:<5} {r['GBps']:>7.0f} GB/s "
                     f"{r['of_copy_bw']:>6.0%}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timings")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/device_check"))
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device; run with --dry-run to check the script on CPU")
    torch.manual_seed(0)
    start = time.time()
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.machine() + " (dry run)",
              "torch": torch.__version__, "triton": triton.__version__, "dry_run": args.dry_run}  # fmt: skip
    report["ceilings"] = ceilings(device)
    print("ceilings:", report["ceilings"], flush=True)
    report["correctness"] = correctness(device)
    bad = [r for r in report["correctness"] if not r["rel_err"] < (1e-5 if "float32" in r["dtype"] else 2e-2)]
    print(f"correctness: {len(report['correctness'])} cases, {len(bad)} above tolerance", flush=True)
    report["gemm"] = gemm(device)
    report["decode_attention"] = decode_attention(device, report["ceilings"]["copy_GBps"])
    report["seconds"] = time.time() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_check.json").write_text(json.dumps(report, indent=1, default=str))
    print()
    print(summary(report))
    if bad:
        print("FAILED correctness:", *(f"{r['kernel']} {r['dtype']}: {r['rel_err']:.2e}" for r in bad), sep="\n  ")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
