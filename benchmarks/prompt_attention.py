"""Prompt-chunk attention on CPU: the C flash kernel (cpu_attention.c, slimlm_paged_prefill) against the PyTorch
path it replaced (one sequence at a time: batched matmuls and a masked softmax), interleaved in one run.

Shapes are the default model's (9 query heads, 3 KV heads, head_dim 64) over a paged cache of 16-token blocks
in random order: a step of S sequences adding N prompt tokens each after C cached ones. Each cell is the
median ms per layer; the ratio is torch's time ÷ the C kernel's. On a CPU with AMX the bf16 rows also time
the C kernel's AVX-512 loops (its path without the tile unit), as "C vec", with its time ÷ the C kernel's.

    PYTHONPATH=. .venv/bin/python benchmarks/prompt_attention.py [--threads 2]
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.kernels_cpu import interleaved_ms
from slimlm.kernels import cpu_attention, cpu_library
from tests.kernels.problems import paged_problem, relative_error

STEPS = [(4, 128, 0), (2, 256, 0), (1, 512, 0), (4, 128, 256), (1, 64, 1024)]  # S sequences, N new, C cached


def without_amx(fn):
    """fn, called as on a CPU without the tile unit"""

    def call():
        saved, cpu_library.has_amx = cpu_library.has_amx, lambda: False
        try:
            return fn()
        finally:
            cpu_library.has_amx = saved

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=2.0, help="per cell")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads; ms per layer (median, interleaved); ratio: torch ÷ C")
    for dtype in (torch.bfloat16, torch.float32):
        for s, n, c in STEPS:
            p = paged_problem([c + n] * s, [n] * s, 9, 3, 64, 16, dtype, dtype, seed=n)
            fns = {
                name: functools.partial(cpu_attention.paged_attention, *p.args(), native=native)
                for name, native in (("C", True), ("torch", False))
            }
            if dtype == torch.bfloat16 and cpu_library.has_amx():
                fns["C vec"] = without_amx(fns["C"])
            error = relative_error(fns["C"](), fns["torch"]().double())
            ms = interleaved_ms(fns, args.seconds)
            vec = f"  C vec {ms['C vec']:7.3f}  ({ms['C vec'] / ms['C']:.1f}×)" if "C vec" in ms else ""
            print(
                f"{str(dtype).removeprefix('torch.'):9s} {s} × {n:3d} new after {c:4d}:  C {ms['C']:7.3f}  "
                f"torch {ms['torch']:7.3f}  ({ms['torch'] / ms['C']:.1f}×){vec}  rel. diff {error:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
