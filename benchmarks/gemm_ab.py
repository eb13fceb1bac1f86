"""One quantized GEMM with the CPU kernels of two or more git revisions, interleaved, beside dense bf16 matmul.

kernels_ab.py compares revisions on a whole decode step; this compares them on single matrices (say the
8192×4096 shape of kernels_cpu.py), where a change to one loop shows above the drift of a shared VM. Each
revision's kernel sources are built into their own library (kernels_ab.build) and the calls take turns, with
torch's dense bf16 matmul of a random matrix of the same shape as the last turn. Weights: 4- or 8-bit RTN,
groups of 64, asymmetric, or (--bits 16) that bf16 matrix packed as the runtime packs a float checkpoint's.

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
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
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
            "each one's, and dense bf16's ÷ the last revision's"
        )
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            dense = torch.randn(n, k).bfloat16()
            for bits in map(int, args.bits.split(",")):
                w = pack_dense(dense) if bits == 16 else quantized_weight(n, k, bits, 64, False, False)[1]
                for m in map(int, args.rows.split(",")):
                    x = torch.randn(m, k).to(dtype)
                    xb = x.bfloat16()
                    fns = {rev: with_library(lib, x, w) for rev, lib in libs.items()}
                    fns["dense bf16"] = lambda xb=xb, dense=dense: torch.nn.functional.linear(xb, dense)
                    ms = interleaved_ms(fns, args.seconds)
                    first, last = ms[args.revs[0]], ms[args.revs[-1]]
                    cells = "  ".join(f"{rev} {ms[rev]:8.3f} ({first / ms[rev]:.2f}×)" for rev in args.revs)
                    print(
                        f"{shape:>10s} int{bits} M={m:4d}  {cells}  dense bf16 {ms['dense bf16']:8.3f} "
                        f"({ms['dense bf16'] / last:.2f}×)",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
