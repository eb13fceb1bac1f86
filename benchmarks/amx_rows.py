"""Where the AMX tile unit should take over from the code tiles (cpu_gemm.AMX_MIN_ROWS): one quantized linear
at 1-16 bf16 rows with each loop forced, calls alternating, medians of 7, with the two outputs' largest
difference (bf16 rounding of the same exact products). Shapes: Qwen2.5-1.5B's joined q/k/v, gate/up and
down_proj at 4 bits g128, and with --head its 8-bit lm_head. Needs an AMX CPU.

    PYTHONPATH=. .venv/bin/python benchmarks/amx_rows.py [--head] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from slimlm.kernels import cpu_gemm, cpu_library
from tests.kernels.problems import quantized_weight

SHAPES = {"qkv 2048x1536": (2048, 1536, 4), "gate_up 17920x1536": (17920, 1536, 4), "down 1536x8960": (1536, 8960, 4)}
ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", action="store_true", help="also the 8-bit 151936x1536 lm_head")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if not cpu_library.has_amx():
        raise SystemExit("this CPU has no AMX tile unit")
    torch.set_num_threads(a.threads)
    shapes = SHAPES | ({"head8 151936x1536": (151936, 1536, 8)} if a.head else {})
    for name, (n, k, bits) in shapes.items():
        _, w = quantized_weight(n, k, bits, 128, sym=False, seed=0)
        print(name, flush=True)
        for rows in ROWS:
            x = torch.randn(rows, k).to(torch.bfloat16)
            times, outs = {"codes": [], "amx": []}, {}
            for _ in range(7):
                for kind, minimum in (("codes", 99), ("amx", 1)):
                    cpu_gemm.AMX_MIN_ROWS[bits] = minimum
                    start = time.perf_counter()
                    outs[kind] = cpu_gemm.quant_matmul(x, w)
                    times[kind].append(time.perf_counter() - start)
            c, t = (1e3 * statistics.median(times[kind]) for kind in ("codes", "amx"))
            diff = (outs["codes"].float() - outs["amx"].float()).abs().max() / outs["codes"].float().abs().max()
            print(f"  rows {rows:2d}: code tiles {c:7.3f} ms  tile unit {t:7.3f} ms  ({t / c:.2f}x)  diff {diff:.1e}")


if __name__ == "__main__":
    main()
