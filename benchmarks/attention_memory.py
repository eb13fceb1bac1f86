"""Paged decode attention on a KV cache read from memory: the bytes it moves against a plain read, in one run.

At 32 sequences of 512 tokens the default model's decode step reads ~377 MB of KV (30 layers, K and V) and
spends about half its time in attention, so the rate attention reads the cache at bounds batched serving.
Here each layer's cache is its own memory (as the runtime's pool lays them out), every sequence owns
consecutive blocks, and one pass runs the decode kernel over every layer; the read loop (a sum over 1 GiB)
is the most that loads alone move here. Passes alternate with the read loop, so both share the machine's
moods. Given git revisions, each one's kernel library (built as benchmarks/kernels_ab.py builds it) takes a
turn, and the ratios are against the first.

    PYTHONPATH=. .venv/bin/python benchmarks/attention_memory.py --batch 32 --context 512 --kv bfloat16
    PYTHONPATH=. .venv/bin/python benchmarks/attention_memory.py HEAD~1 HEAD
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.kernels_ab import build
from slimlm.kernels import cpu_attention, cpu_library

SHAPES = {"smollm2": (30, 9, 3, 64), "llama3-8b": (32, 32, 8, 128)}  # layers, query heads, KV heads, head dim
BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="*", help="git revisions (default: the working tree's kernels)")
    parser.add_argument("--shape", choices=SHAPES, default="smollm2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--kv", default="bfloat16", choices=["float32", "bfloat16", "int8", "float8_e4m3fn"])
    parser.add_argument("--query", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers, heads, kv_heads, dim = SHAPES[args.shape]
    kv, query = getattr(torch, args.kv), getattr(torch, args.query)
    per_seq = -(-args.context // BLOCK)
    blocks = args.batch * per_seq
    g = torch.Generator().manual_seed(0)

    def cache() -> torch.Tensor:
        x = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g)
        return (x * 16).clamp(-100, 100).to(kv) if kv.itemsize == 1 else x.to(kv)

    caches = [(cache(), cache()) for _ in range(layers)]
    scales = (torch.full((kv_heads,), 1 / 16), torch.full((kv_heads,), 1 / 16)) if kv.itemsize == 1 else (None, None)
    tables = torch.arange(blocks, dtype=torch.int32).view(args.batch, per_seq)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch, heads, dim, generator=g).to(query)
    starts = torch.arange(args.batch + 1, dtype=torch.int32)
    lengths = [1] * args.batch

    def attention(lib) -> None:
        cpu_library.load = lambda: lib  # every kernel call asks cpu_library.load()
        for k, v in caches:
            cpu_attention.paged_attention(q, k, v, tables, lens, starts, dim**-0.5, *scales, query_lens=lengths)

    cpu_library.has_amx()  # the dispatch's one-time questions, asked of the working tree's library
    tmp = tempfile.TemporaryDirectory()
    libs = {rev: build(rev, Path(tmp.name)) for rev in args.revs} or {"attention": cpu_library.load()}
    big = torch.ones(1 << 28)
    passes = {rev: lambda lib=lib: attention(lib) for rev, lib in libs.items()}
    passes["read 1 GiB"] = big.sum
    nbytes = {rev: sum(k.nbytes + v.nbytes for k, v in caches) for rev in libs} | {"read 1 GiB": big.nbytes}
    times = {name: [] for name in passes}
    for fn in passes.values():
        fn()
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end or min(map(len, times.values())) < 5:
        for name, fn in passes.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    rate = {name: nbytes[name] / statistics.median(ts) for name, ts in times.items()}
    print(
        f"{args.shape}: {layers} layers, {heads}/{kv_heads} heads of {dim}, {args.batch} × {args.context} tokens, "
        f"{args.kv} KV, {args.query} queries, {args.threads} threads"
    )
    first = statistics.median(times[next(iter(libs))])
    for name, ts in times.items():
        speed = "" if name.startswith("read") else f"{first / statistics.median(ts):6.2f}×"
        print(
            f"{name:12s} {nbytes[name] / 1e6:8.0f} MB {1e3 * statistics.median(ts):8.2f} ms "
            f"{rate[name] / 1e9:6.1f} GB/s {rate[name] / rate['read 1 GiB']:6.2f} of read {speed}"
        )


if __name__ == "__main__":
    main()
