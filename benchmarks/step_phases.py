"""Where the one-call decode step's time goes, call by call, for two checkpoints side by side, in one run.

decode_overhead.py splits the step only where its calls go through Python; the one-call step (every layer in
one C call, as the runtime runs decode) hides them. Here the working tree's kernels are built once more with
-DSLIMLM_PHASE_TIMES, which makes cpu_layer.c add up the seconds of each call of a layer (norms, the four
linears, rotary + KV write, attention, SiLU·up), and the step (batch B, context C, random KV) runs with that
library for each checkpoint in turn, round after round. The rest of a step is the lm_head and what runs
outside the C call (embedding, final norm, Python). The clock reads cost ~20 ns each, 9 a layer.

    PYTHONPATH=. .venv/bin/python benchmarks/step_phases.py out/speed/w4h8 smollm2-135m --batch 1,32 --context 512
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from slimlm.kernels import cpu_library
from slimlm.perf.config import BenchConfig, engine_for
from slimlm.perf.offline import decode_inputs

PHASES = ["add + norm", "q/k/v", "rotary + KV write", "attention", "o", "add + norm 2", "gate/up", "SiLU·up", "down"]
ROUNDS, STEPS = 10, 10


def build(out: Path) -> ctypes.CDLL:
    library = out / "libslimlm_cpu.so"
    command = [
        "gcc",
        *cpu_library.build_flags("native"),
        "-DSLIMLM_PHASE_TIMES",
        *map(str, cpu_library.SOURCES),
        "-o",
        str(library),
        "-lm",
    ]
    subprocess.run(command, check=True, capture_output=True)
    return cpu_library.bind(ctypes.CDLL(str(library)))


def measure(models: list[str], dtype: str, batch: int, context: int, lib: ctypes.CDLL) -> dict[str, dict]:
    seconds = (ctypes.c_double * len(PHASES)).in_dll(lib, "slimlm_phase_seconds")
    runs = {}
    for model in models:
        runner = engine_for(model, BenchConfig(dtype=dtype, batch=[batch], context=context), context + 1).runner
        runner.kv_cache.normal_()
        if runner.model.decode_stack is None:
            raise SystemExit(f"step_phases.py: {model} does not decode in one call here")
        ids, step = decode_inputs(batch, context, runner.block_size)
        runs[model] = (runner, step, ids)
    totals = {m: {"step": 0.0, "lm_head": 0.0, **dict.fromkeys(PHASES, 0.0)} for m in models}
    for r in range(ROUNDS + 1):  # round 0 warms up
        for model, (runner, step, ids) in runs.items():
            for i in range(len(PHASES)):
                seconds[i] = 0.0
            start = time.perf_counter()
            head = 0.0
            for _ in range(STEPS):
                hidden = runner.model(ids, step, runner.kv_cache)
                at = time.perf_counter()
                runner.model.logits(hidden)
                head += time.perf_counter() - at
            if r:
                totals[model]["step"] += time.perf_counter() - start
                totals[model]["lm_head"] += head
                for i, name in enumerate(PHASES):
                    totals[model][name] += seconds[i]
    n = ROUNDS * STEPS
    return {m: {k: 1e3 * v / n for k, v in t.items()} for m, t in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs=2, help="two checkpoints; the ratios are the second's time ÷ the first's")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        original = cpu_library.load
        cpu_library.load = lambda march="native": lib  # every kernel call asks cpu_library.load()
        try:
            with torch.inference_mode():
                for batch in map(int, args.batch.split(",")):
                    results.append({"batch": batch, "ms": measure(args.models, args.dtype, batch, args.context, lib)})
        finally:
            cpu_library.load = original
    first, second = args.models
    for r in results:
        ms = r["ms"]
        print(f"\n{args.dtype}, batch {r['batch']}, context {args.context}, {args.threads} threads: ms per step")
        print(f"{'':20s} {first[-20:]:>20s} {'share':>6s} {second[-20:]:>20s} {'share':>6s} {'ratio':>6s}")
        rest = {m: ms[m]["step"] - ms[m]["lm_head"] - sum(ms[m][p] for p in PHASES) for m in args.models}
        for name in [*PHASES, "lm_head", "rest", "step"]:
            a, b = ((rest[m] if name == "rest" else ms[m][name]) for m in args.models)
            print(
                f"{name:20s} {a:20.3f} {a / ms[first]['step']:6.1%} {b:20.3f} {b / ms[second]['step']:6.1%} "
                f"{b / a if a else float('nan'):5.2f}×"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
