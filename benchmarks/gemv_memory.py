"""One-row quantized GEMMs on weights read from memory, not cache: Llama-3-8B-shaped layers against dense bf16
and against a plain read of memory, measured in one run.

The default model's weights (~90 MB at W4) fit in this VM's L3 (480 MB here), so its decode step reads them
from cache once the steps run back to back. A user's 8B model does not: every step streams ~4.5 GB (W4) from
memory. This measures that case: --layers decoder layers of the 8B shapes (q 4096², k/v 1024×4096, o 4096²,
gate/up 14336×4096, down 4096×14336), each matrix in its own memory, all of them multiplied by one row of x in
turn, so that every byte comes from memory (the set is checked against the L3 size). Candidates, interleaved
round by round: dense bf16 through torch's linear and through the C loops (packed as the runtime packs it on
CPUs with the bf16 dot product: packed.pack_dense), 4-bit and 8-bit groups of 128 (cpu_gemm.quant_matmul,
bf16 x), and the read bandwidth (a sum over 1 GiB: the most that loads alone move here).

    PYTHONPATH=. .venv/bin/python benchmarks/gemv_memory.py [--layers 8] [--rows 1] [--seconds 40]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from slimlm.kernels import cpu_gemm
from slimlm.kernels.packed import PackedWeight, pack_dense
from tests.kernels.problems import quantized_weight

LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]


def l3_bytes() -> int:
    size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    return int(size.read_text().strip().rstrip("K")) * 1024 if size.exists() else 0


def copies(w: PackedWeight, n: int) -> list[PackedWeight]:
    """n copies of w, each in its own memory (quantizing every layer anew would take minutes; the speed
    does not depend on the values)."""
    return [
        PackedWeight(w.codes.clone(), w.scales.clone(), w.zeros.clone(), w.bits, w.group_size, w.out_features)
        for _ in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    sets = {"torch bf16": [torch.randn(n, k, generator=g).bfloat16() for n, k in LAYER for _ in range(args.layers)]}
    if cpu_gemm.dense_fits(sets["torch bf16"][0]):
        sets["C bf16"] = [pack_dense(w) for w in sets["torch bf16"]]
    for bits in (4, 8):
        sets[f"W{bits} g128"] = [
            c for n, k in LAYER for c in copies(quantized_weight(n, k, bits, 128, True)[1], args.layers)
        ]
    nbytes = {
        name: sum(
            sum(t.nbytes for t in ((w,) if isinstance(w, torch.Tensor) else (w.codes, w.scales, w.zeros))) for w in ws
        )
        for name, ws in sets.items()
    }
    smallest = min(nbytes.values())
    if smallest < l3_bytes():
        print(
            f"warning: {smallest / 1e6:.0f} MB per pass against an L3 of {l3_bytes() / 1e6:.0f} MB: "
            "part of it may come from cache (raise --layers)"
        )
    x = {k: torch.randn(args.rows, k, generator=g).bfloat16() for k in (4096, 14336)}

    def dense(ws):
        for w in ws:
            torch.nn.functional.linear(x[w.shape[1]], w)

    def quantized(ws):
        for w in ws:
            cpu_gemm.quant_matmul(x[w.in_features], w)

    big = torch.ones(1 << 28)
    passes = {
        name: functools.partial(dense if isinstance(ws[0], torch.Tensor) else quantized, ws)
        for name, ws in sets.items()
    }
    passes["read 1 GiB"] = lambda: big.sum()
    nbytes["read 1 GiB"] = big.nbytes
    times = {name: [] for name in passes}
    for fn in passes.values():
        fn()
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end or min(map(len, times.values())) < 5:
        for name, fn in passes.items():  # in turn: every candidate shares the machine's moods
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    rate = {name: nbytes[name] / statistics.median(ts) for name, ts in times.items()}
    dense_s = statistics.median(times["torch bf16"])
    print(
        f"{args.layers} layers of Llama-3-8B shapes, {args.rows} row(s) of bf16 x, {args.threads} threads; "
        f"L3 {l3_bytes() / 1e6:.0f} MB"
    )
    print(f"{'':12s} {'MB/pass':>8s} {'ms/pass':>8s} {'GB/s':>6s} {'÷read':>6s} {'speedup':>8s}")
    for name, ts in times.items():
        ms = 1e3 * statistics.median(ts)
        speed = "" if name.startswith("read") else f"{dense_s / statistics.median(ts):7.2f}×"
        print(
            f"{name:12s} {nbytes[name] / 1e6:8.0f} {ms:8.2f} {rate[name] / 1e9:6.1f} "
            f"{rate[name] / rate['read 1 GiB']:6.2f} {speed:>8s}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "bytes": nbytes, "seconds": times}, f, indent=1)


if __name__ == "__main__":
    main()
