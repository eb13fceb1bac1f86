"""The KV-budget curve: long-context retrieval accuracy against the KV bytes a request keeps, for the full
cache, a window and SnapKV at several budgets, for each KV dtype, with NVIDIA kvpress beside them on the same
prompts (its own venv: benchmarks/peers/kvpress_run.py).

    .venv/bin/python benchmarks/long_context.py --model smollm2-135m --lengths 1024,2048,4096,8192 \\
        --budgets 256,1024 --kv-dtypes auto,int8,int4 --kvpress-python /path/to/kvpress-venv/bin/python \\
        --out benchmarks/results/long_context-smollm2-DATE

Writes one run directory per system under --out (long_context.json, run.json), the report (report.html) with
the curve, the curve alone (kv_budget.png) and a text table (curve.txt): accuracy over every task, length and
depth, and the mean KV MiB a request held while it decoded. The report and curve cover every system in --out,
so a second run with another --kv-dtypes (and no kvpress) adds its line to the first's.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from slimlm import models
from slimlm.eval import long_context, records, report
from slimlm.jobs import LongContext
from slimlm.jobs.measure import policy_list


def slimlm_runs(args, policies: str) -> list[Path]:
    dirs = []
    for dtype in args.kv_dtypes.split(","):
        run = args.out / f"slimlm-{dtype}"
        run.mkdir(parents=True, exist_ok=True)
        print(f"slimlm, KV cache {dtype}:", flush=True)
        LongContext(
            model=args.model,
            tasks=args.tasks.split(","),
            lengths=args.lengths,
            samples=args.samples,
            policies=policy_list(policies),
            kv_cache_dtype=dtype,
            kv_cache_memory=args.kv_cache_memory,
            dtype=args.dtype,
            output=run / "long_context.json",
            overwrite=True,
        ).run()
        (run / "run.json").write_text(json.dumps({"name": f"slimlm {dtype}", "model": args.model}))
        dirs.append(run)
    return dirs


def kvpress_run(args, per_token: int) -> Path:
    """The same cases through kvpress (prompt ids and answers handed over as JSON); --kvpress-lengths and
    --kvpress-budgets may take a subset (transformers' prefill on a CPU is the slow part)."""
    model_dir = models.resolve(args.model)
    tokenizer = models.load_tokenizer(model_dir)
    lengths = args.kvpress_lengths or args.lengths
    cases = long_context.make_cases(tokenizer, args.tasks.split(","), args.lengths, args.samples)
    cases = [c for c in cases if c.length in lengths]
    spec = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "budgets": args.kvpress_budgets or args.budgets,
        "kv_bytes_per_token": per_token,
        "cases": [
            {
                "task": c.task,
                "length": c.length,
                "depth": c.depth,
                "prompt": c.prompt,
                "answer": c.answer,
                "max_tokens": len(tokenizer.encode(c.answer, add_special_tokens=False)) + 2,
            }
            for c in cases
        ],
    }
    run = args.out / "kvpress"
    run.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, out_path = Path(tmp) / "cases.json", Path(tmp) / "out.json"
        cases_path.write_text(json.dumps(spec))
        script = Path(__file__).parent / "peers" / "kvpress_run.py"
        print("kvpress (its own venv):", flush=True)
        quiet = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        subprocess.run([args.kvpress_python, str(script), str(cases_path), str(out_path)], check=True, env=quiet)
        result = json.loads(out_path.read_text())
    record = records.LongContext(
        model=str(model_dir),
        kv_cache_dtype=args.dtype,
        kv_bytes_per_token=per_token,
        tasks=args.tasks.split(","),
        lengths=lengths,
        samples=args.samples,
        seconds=result["seconds"],
        rows=result["rows"],
        summary=long_context.summarize(result["rows"]),
    )
    (run / "long_context.json").write_text(json.dumps(record.model_dump(), indent=1))
    (run / "run.json").write_text(json.dumps({"name": "kvpress", "model": args.model}))
    return run


def curve_table(runs: list[Path]) -> str:
    loaded = [report.load_run(r) for r in runs]
    lines = [f"{'system: policy':34} {'budget':>7} {'KV MiB/request':>15} {'accuracy':>9}"]
    for name, points in report.kv_budget_curve(loaded).items():
        for mib, accuracy, budget in points:
            lines.append(f"{name:34} {budget or '-':>7} {mib:>15.2f} {accuracy:>9.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default="passkey,multikey,copy")
    parser.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")], default=[1024, 2048, 4096])
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--budgets", type=lambda t: [int(x) for x in t.split(",")], default=[256, 1024])
    parser.add_argument("--kv-dtypes", default="auto,int8,int4")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", type=lambda t: int(float(t) * 2**20), default=2048 << 20, help="MiB")
    parser.add_argument("--kvpress-python", help="python of a venv with kvpress (skipped without)")
    parser.add_argument("--kvpress-lengths", type=lambda t: [int(x) for x in t.split(",")], help="default: --lengths")
    parser.add_argument("--kvpress-budgets", type=lambda t: [int(x) for x in t.split(",")], help="default: --budgets")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    policies = ",".join(["full"] + [f"{kind}:{b}" for kind in ("window", "snapkv") for b in args.budgets])
    runs = slimlm_runs(args, policies)
    if args.kvpress_python:
        float_record = json.loads((runs[0] / "long_context.json").read_text())
        runs.append(kvpress_run(args, float_record["kv_bytes_per_token"]))
    # every system measured into --out so far, this run's and earlier ones' (a KV dtype added later joins them)
    measured = [p for p in args.out.iterdir() if (p / "long_context.json").exists()]
    runs = sorted(measured, key=lambda p: (p.name == "kvpress", p.name))
    result = report.render(runs, args.out / "report.html", title=f"KV budget: {args.model}", overwrite=True)
    curve = report._kv_budget_plot([report.load_run(r) for r in runs])
    (args.out / "kv_budget.png").write_bytes(base64.b64decode(curve.split(",", 1)[1]))
    table = curve_table(runs)
    (args.out / "curve.txt").write_text(table + "\n")
    print(table)
    print(f"{len(result['runs'])} systems, {time.perf_counter() - start:.0f} s; report: {args.out / 'report.html'}")


if __name__ == "__main__":
    main()
