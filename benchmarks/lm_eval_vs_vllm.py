"""lm-eval's scores through slimlm's backend (`--model slimlm`) and through vLLM's own (`--model vllm`), on the
same checkpoints, tasks and documents: a checkpoint vLLM reads as slimlm does scores within noise of it.

Both in fp32 (slimlm with --activations exact: the checkpoint's arithmetic); vLLM in its own venv with lm_eval
installed (benchmarks/peers/vllm_lm_eval.py), the stand-in multiply only where its CPU build has no kernel.

    .venv/bin/python benchmarks/lm_eval_vs_vllm.py --vllm-python $(bash benchmarks/peers/vllm_venv.sh) \
        [--tasks slimlm_arc_easy,slimlm_piqa] [--limit 200] [--json out.json]

The vLLM venv needs lm_eval once: `$(dirname VLLM_PY)/pip install lm_eval==0.4.13 torch==2.13.0`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from slimlm import models
from slimlm.eval import harness

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = {  # label: compress rtn flags (None: the float model itself)
    "float": None,
    "RTN W4 g64 asym (8-bit head)": ["--bits", "4", "--group-size", "64", "--asym"],
}
METRICS = ("acc,none", "acc_norm,none")


def checkpoint(work: Path, model: str, flags: list[str] | None) -> Path:
    if flags is None:
        return models.resolve(model)
    out = work / f"{model}-rtn{'_'.join(flags).replace('--', '-')}"
    if not (out / "config.json").exists():
        compress = str(Path(sys.executable).with_name("compress"))
        subprocess.run([compress, "rtn", "--model", model, *flags, "--out", str(out), "--overwrite"], check=True)
    return out


def vllm_scores(python: str, model: Path, tasks: list[str], limit: int) -> dict:
    script = ROOT / "benchmarks" / "peers" / "vllm_lm_eval.py"
    cmd = [python, str(script), "--model", str(model), "--tasks", ",".join(tasks), "--limit", str(limit)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    answer = [line for line in proc.stdout.splitlines() if line.startswith("@")]
    if proc.returncode != 0 or not answer:
        sys.exit(f"vLLM's lm-eval failed: {proc.stderr.strip().splitlines()[-3:]}")
    return json.loads(answer[-1][1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default="slimlm_arc_easy,slimlm_piqa,slimlm_hellaswag,slimlm_winogrande")
    parser.add_argument("--limit", type=int, default=200, help="documents per task, the same for both")
    parser.add_argument("--work", default="out/lm_eval_vs_vllm")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    tasks = args.tasks.split(",")
    rows, runs = [], {}
    for label, flags in CHECKPOINTS.items():
        path = checkpoint(Path(args.work), args.model, flags)
        ours = harness.evaluate(str(path), tasks, limit=args.limit, dtype="float32", activations="exact")["results"]
        theirs = vllm_scores(args.vllm_python, path, tasks, args.limit)
        runs[label] = {"slimlm": ours, "vllm": theirs["results"], "vllm_stand_in": theirs["stand_in"]}
        for task in tasks:
            for metric in (m for m in METRICS if m in ours[task]):
                s, v = ours[task][metric], theirs["results"][task][metric]
                rows.append((label, task, metric.split(",")[0], s, v))
        print(f"{label}: vLLM's stand-in multiplied {theirs['stand_in'] or 'nothing'}", flush=True)
    print(f"{args.model}, {args.limit} documents per task, fp32 on both")
    print(f"{'checkpoint':<30}{'task':<22}{'metric':<10}{'slimlm':>8}{'vLLM':>8}{'diff (pt)':>11}")
    for label, task, metric, s, v in rows:
        print(f"{label:<30}{task:<22}{metric:<10}{100 * s:>8.1f}{100 * v:>8.1f}{100 * (s - v):>+11.2f}")
    worst = max(abs(s - v) for *_, s, v in rows)
    print(f"largest difference: {100 * worst:.2f} points")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "limit": args.limit, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
