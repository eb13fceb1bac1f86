"""The decode step with the CPU kernels of two or more git revisions, interleaved in one process.

On a shared 2-core VM, timings drift by ±30% within minutes, so a kernel change measured in two runs proves
little. Here each revision's kernel sources (slimlm/kernels/*.c) are built into their own library, all are
loaded at once, and the decode step of one model runs with each library in turn, step after step: the
ratios come from the same minutes. Everything but the C kernels (Python, torch) is the working tree's.

    PYTHONPATH=. .venv/bin/python benchmarks/kernels_ab.py out/speed/w4h8 ff5c49d HEAD --batch 1,8,32
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from slimlm.kernels import cpu_library
from slimlm.perf.config import BenchConfig, engine_for
from slimlm.perf.offline import decode_inputs


def build(rev: str, out: Path) -> ctypes.CDLL:
    """The kernel library of `rev`, built as cpu_library builds the working tree's ($SLIMLM_CPU_MARCH too)."""
    sources = []
    for source in cpu_library.SOURCES:
        path = out / rev / source.name
        path.parent.mkdir(parents=True, exist_ok=True)
        relative = source.relative_to(Path(__file__).resolve().parents[1])
        shown = subprocess.run(["git", "show", f"{rev}:{relative}"], capture_output=True, text=True)
        if shown.returncode != 0:
            why = shown.stderr.strip().splitlines()[-1]
            raise SystemExit(f"kernels_ab.py: no {relative} at revision {rev!r}: {why}")
        path.write_text(shown.stdout)
        sources.append(str(path))
    library = out / rev / "libslimlm_cpu.so"
    subprocess.run(
        [
            "gcc",
            *cpu_library.build_flags(os.environ.get("SLIMLM_CPU_MARCH", "native")),
            *sources,
            "-o",
            str(library),
            "-lm",
        ],
        check=True,
        capture_output=True,
    )
    lib = cpu_library.bind(ctypes.CDLL(str(library)))
    if hasattr(cpu_library.load(), "slimlm_decode_layers") and not hasattr(lib, "slimlm_decode_layers"):
        raise SystemExit(
            f"kernels_ab.py: {rev!r} predates the one-call decode step the working tree's Python "
            "makes; compare whole revisions with benchmarks/revisions_ab.py"
        )
    if hasattr(lib, "slimlm_amx_ready"):
        lib.slimlm_amx_ready()
    return lib


def step_ms(model: str, dtype: str, batch: int, context: int, libs: dict, seconds: float) -> dict[str, float]:
    config = BenchConfig(dtype=dtype, batch=[batch], context=context)
    runner = engine_for(model, config, context + 1).runner
    runner.kv_cache.normal_()
    ids, step = decode_inputs(batch, context, runner.block_size)
    times = {rev: [] for rev in libs}
    original = cpu_library.load
    try:
        with torch.inference_mode():
            end, warm = time.perf_counter() + seconds, 2
            while time.perf_counter() < end or min(map(len, times.values())) < 5:
                for rev, lib in libs.items():
                    cpu_library.load = lambda lib=lib: lib  # every kernel call asks cpu_library.load()
                    start = time.perf_counter()
                    runner.model.logits(runner.model(ids, step, runner.kv_cache))
                    if warm <= 0:
                        times[rev].append(time.perf_counter() - start)
                warm -= 1
    finally:
        cpu_library.load = original
    return {rev: 1e3 * statistics.median(t) for rev, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("revs", nargs="+", help="git revisions; ratios are against the first")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=20.0, help="per batch size and dtype")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_library.has_amx()  # the dispatch's one-time questions, asked of the working tree's library
    with tempfile.TemporaryDirectory() as tmp:
        libs = {rev: build(rev, Path(tmp)) for rev in args.revs}
        print(f"{args.model}, context {args.context}, {args.threads} threads; step ms (median, interleaved)")
        for dtype in args.dtypes.split(","):
            for batch in map(int, args.batch.split(",")):
                ms = step_ms(args.model, dtype, batch, args.context, libs, args.seconds)
                first = ms[args.revs[0]]
                cells = "  ".join(f"{rev} {m:7.2f} ({first / m:.2f}×)" for rev, m in ms.items())
                print(f"{dtype:9s} batch {batch:3d}  {cells}", flush=True)


if __name__ == "__main__":
    main()
