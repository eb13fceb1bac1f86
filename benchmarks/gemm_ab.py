"""One quantized GEMM with the CPU kernels of two or more git revisions, interleaved, beside dense matmul.

kernels_ab.py compares revisions on a whole decode step; this compares them on single matrices (say the
8192×4096 shape of kernels_cpu.py), where a change to one loop shows above the drift of a shared VM. Each
revision's kernel sources are built into their own library (kernels_ab.build) and the calls take turns, with
torch's dense matmul of a random matrix of the same shape, in x's dtype, as the last turn. Weights: 4- or 8-bit
RTN, asymmetric, groups of --group-size, or (--bits 16) that matrix in bf16 packed as the runtime packs a float
checkpoint's. SLIMLM_CPU_MARCH=haswell builds and dispatches the AVX2 kernels (what an AVX2 machine runs).

    PYTHONPATH=. .venv/bin/python benchmarks/gemm_ab.py HEAD~1 HEAD --shapes 8192x4096,3072x576 --rows 64,256
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.kernels_ab import build
from benchmarks.kernels_cpu import interleaved_ms
from slimlm.kernels import cpu_gemm, cpu_library
from slimlm.kernels.packed import pack_dense
from tests.kernels.problems import quantized_weight


def with_library(lib, x: torch.Tensor, w):
    def call():
        original, cpu_library.load = cpu_library.load, lambda: lib  # every kernel call asks cpu_library.load()
        try:
            cpu_gemm.quant_matmul(x, w)
        finally:
            cpu_library.load = original

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="+", help="git revisions; ratios are against the first")
    parser.add_argument("--shapes", default="8192x4096,3072x576", help="N×K (outputs × inputs)")
    parser.add_argument("--rows", default="64,256,512")
    parser.add_argument("--bits", default="4,8", help="4, 8, or 16: the dense bf16 weight itself, packed")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="x's, and the dense matmul's"
    )
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=3.0, help="per cell")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_library.has_amx()  # the dispatch's one-time questions, asked of the working tree's library
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {rev: build(rev, Path(tmp)) for rev in args.revs}
        print(
            f"{args.dtype} x, {args.threads} threads; ms (median, interleaved); ratios: first revision's time ÷ "
            "each one's, and the dense matmul's (x's dtype) ÷ the last revision's"
        )
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            dense = torch.randn(n, k).to(dtype)
            for bits in map(int, args.bits.split(",")):
                w = (
                    pack_dense(dense.bfloat16())
                    if bits == 16
                    else quantized_weight(n, k, bits, args.group_size, False, False)[1]
                )
                for m in map(int, args.rows.split(",")):
                    x = torch.randn(m, k).to(dtype)
                    fns = {rev: with_library(lib, x, w) for rev, lib in libs.items()}
                    fns["dense"] = lambda x=x, dense=dense: torch.nn.functional.linear(x, dense)
                    ms = interleaved_ms(fns, args.seconds)
                    first, last = ms[args.revs[0]], ms[args.revs[-1]]
                    cells = "  ".join(f"{rev} {ms[rev]:8.3f} ({first / ms[rev]:.2f}×)" for rev in args.revs)
                    print(
                        f"{shape:>10s} int{bits} M={m:4d}  {cells}  dense {args.dtype} {ms['dense']:8.3f} "
                        f"({ms['dense'] / last:.2f}×)",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
