"""The quality table: every checkpoint scored by the same backend (lm-eval over the slimlm runtime) on the
same documents of the task pack, plus wiki perplexity through the runtime, side by side with the float model.

    .venv/bin/python benchmarks/quality.py --llmcompressor-python /path/to/llmc/bin/python \
        [--limit 100] [--settings w4g64-sym,w4g64-asym,w8-channel-sym] [--work DIR]

Checkpoints are made as benchmarks/quant_vs_peers.py makes them (same calibration windows for every method,
llm-compressor in its own venv); one already in --work is reused. Each eval runs `compress eval` in its own
process. With --hf-compare, lm-eval's own `hf` backend scores the float model on the same tasks and
documents in this run: its accuracies next to ours, per-document agreement, and both wall times.
Writes benchmarks/results/quality-DATE.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quant_vs_peers import quantize_jobs, run_one, save_results, write_calibration

from slimlm import models
from slimlm.eval import taskpack

HERE = Path(__file__).parent
METHODS = {  # per setting: ours and llm-compressor's
    "w4g64-sym": ["rtn", "gptq", "awq", "awq-gptq", "llmc-gptq", "llmc-awq"],
    "w8-channel-sym": ["rtn", "gptq"],
    "w4g64-asym": ["rtn", "gptq", "awq", "awq-gptq", "llmc-gptq", "llmc-awq"],
}
SHORT = {name: name.removeprefix("slimlm_") for name in taskpack.STANDARD}


def score(metrics: dict) -> tuple[str, float, float]:
    """The column a task reports: acc_norm where the task has it (lm-eval's usual headline), else acc."""
    key = "acc_norm,none" if "acc_norm,none" in metrics else "acc,none"
    return key.split(",")[0], metrics[key], metrics[key.replace(",", "_stderr,")]


def evaluate(checkpoint: str, out: Path, a: argparse.Namespace) -> dict | None:
    cmd = [
        sys.executable,
        "-m",
        "slimlm.cli",
        "eval",
        checkpoint,
        "--tasks",
        a.tasks,
        "--ppl",
        "wiki",
        "--output",
        str(out),
    ] + (["--limit", str(a.limit)] if a.limit else [])
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"eval of {checkpoint} failed, left out of the table:\n{proc.stderr[-2000:]}", flush=True)
        return None
    result = json.loads(out.read_text())
    result["wall_seconds"] = round(time.time() - start, 1)
    return result


def hf_compare(model_dir: str, a: argparse.Namespace, dtype: str = "float32") -> dict:
    """lm-eval's hf backend on the float model, same tasks and documents, both in `dtype`: accuracy,
    agreement, wall time."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from slimlm.eval import harness
    from slimlm.eval.lm_eval_model import SlimlmLM

    tasks = a.tasks.split(",")
    manager = harness.task_manager(tasks)
    runs = {}
    for name, make in [
        ("slimlm", lambda: SlimlmLM(pretrained=model_dir, progress=False, dtype=dtype)),
        ("hf", lambda: HFLM(pretrained=model_dir, batch_size=a.hf_batch_size, device="cpu", dtype=dtype)),
    ]:
        lm = make()
        start = time.time()
        runs[name] = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, limit=a.limit, task_manager=manager, log_samples=True, verbosity="ERROR"
        )
        runs[name]["seconds"] = time.time() - start
        del lm
    agree, total, worst = 0, 0, 0.0
    for task, samples in runs["slimlm"]["samples"].items():
        for mine, theirs in zip(samples, runs["hf"]["samples"][task], strict=True):
            agree += mine["acc"] == theirs["acc"]  # every task in the pack has acc
            total += 1
            for x, y in zip(mine["resps"], theirs["resps"], strict=True):
                worst = max(worst, abs(x[0][0] - y[0][0]))
    return {
        "slimlm_seconds": round(runs["slimlm"]["seconds"], 1),
        "hf_seconds": round(runs["hf"]["seconds"], 1),
        "speedup": round(runs["hf"]["seconds"] / runs["slimlm"]["seconds"], 2),
        "per_document_agreement": f"{agree}/{total}",
        "max_abs_loglikelihood_difference": worst,
        **{
            f"{name}_results": {
                t: {k: v for k, v in m.items() if isinstance(v, float)} for t, m in runs[name]["results"].items()
            }
            for name in runs
        },
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--llmcompressor-python", help="python of a venv with llmcompressor==0.14.0.1")
    p.add_argument("--settings", default=",".join(METHODS))
    p.add_argument("--tasks", default=taskpack.GROUP)
    p.add_argument("--limit", type=int, help="documents per task (default: all of them)")
    p.add_argument("--samples", type=int, default=32, help="calibration windows of --seq-len tokens")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "slimlm-quant-vs-peers")
    p.add_argument("--hf-compare", action="store_true", help="also score the float model with lm-eval's hf backend")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--skip", nargs="*", default=[], metavar="SETTING:METHOD", help="e.g. w4g64-asym:llmc-awq")
    p.add_argument(
        "--resume",
        type=Path,
        metavar="JSON",
        help="keep the rows of an earlier run's results JSON and measure only the checkpoints it lacks",
    )
    p.add_argument("--note", default="")
    a = p.parse_args()
    a.gptqmodel_python = None

    model_dir = models.resolve("smollm2-135m")
    calib_file = write_calibration(a.work, a.samples, a.seq_len)
    rows, compare = [], None
    if a.resume:
        earlier = json.loads(a.resume.read_text())
        rows, compare = earlier["rows"], earlier["hf_compare"]
    done = {(r["setting"], r["method"]) for r in rows}
    todo = [("float", "baseline")] + [
        (s, m) for s in a.settings.split(",") for m in METHODS[s] if f"{s}:{m}" not in a.skip
    ]
    # the table is rewritten after every row: a long run is never all-or-nothing, and --resume continues it
    for setting, method in [t for t in todo if t not in done]:
        made, path = None, str(model_dir)
        if method != "baseline":
            jobs = quantize_jobs(setting, a, calib_file, model_dir)
            if method not in jobs:
                print(f"skipping {setting} {method} (no --llmcompressor-python)", flush=True)
                continue
            out = a.work / f"{setting}-{method}"
            path = str(out)
            if not (out / "config.json").exists():
                seconds, peak, log = run_one(jobs[method] + ["--out", str(out)])
                if not (out / "config.json").exists():
                    print(f"{setting} {method} failed: {log.strip().splitlines()[-1:]}", flush=True)
                    continue
                made = {"seconds": round(seconds, 1), "peak_gb": peak}
        result = evaluate(path, a.work / f"eval-{setting}-{method}.json", a)
        if result is None:
            continue
        tasks = {t: score(m) for t, m in result["results"].items() if t in taskpack.STANDARD}
        row = {
            "setting": setting,
            "method": method,
            "checkpoint": path,
            "made": made,
            "tasks": {t: {"metric": k, "value": v, "stderr": e} for t, (k, v, e) in tasks.items()},
            "average": sum(v for _, v, _ in tasks.values()) / len(tasks),
            "wiki_ppl": result["slimlm"]["perplexity"]["perplexity"],
            "eval_seconds": result["slimlm"]["seconds"],
            "eval_tokens_per_second": result["slimlm"]["tokens_per_second"],
            "n_samples": result["n-samples"],
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tasks"}), flush=True)
        if method == "baseline" and a.hf_compare:
            compare = hf_compare(str(model_dir), a)
            print(json.dumps(compare), flush=True)
        report(rows, compare, a)


def report(rows: list[dict], compare: dict | None, a: argparse.Namespace) -> None:
    base = rows[0]
    tasks = list(base["tasks"])
    n = {t: base["n_samples"][t]["effective"] for t in tasks}
    lines = [
        f"SmolLM2-135M; every checkpoint scored by lm-eval over the slimlm runtime (fp32, CPU) on the same "
        f"documents: the first {a.limit or 'all'} of each task's bundled split (validation; LAMBADA: test); "
        f"calibration {a.samples}×{a.seq_len} owt tokens, the same windows for every method; wiki perplexity "
        "through the runtime over 16,352 tokens. Metric per task: acc_norm where the task has it, else acc "
        "(± is lm-eval's stderr). Recovery = average ÷ the float model's average.",
        *([a.note] if a.note else []),
        "",
        "| setting | method | "
        + " | ".join(f"{SHORT[t]} ({n[t]})" for t in tasks)
        + " | average | recovery | wiki ppl |",
        "|---|---|" + "---|" * len(tasks) + "---|---|---|",
    ]
    for r in rows:
        cells = [f"{r['tasks'][t]['value'] * 100:.1f} ± {r['tasks'][t]['stderr'] * 100:.1f}" for t in tasks]
        tail = f" | {r['average'] * 100:.2f} | {r['average'] / base['average']:.2%} | {r['wiki_ppl']:.3f} |"
        lines.append(f"| {r['setting']} | {r['method']} | " + " | ".join(cells) + tail)
    if compare:
        lines += [
            "",
            f"lm-eval's hf backend vs slimlm on the float model, same tasks and documents: "
            f"{compare['hf_seconds']:.0f} s vs {compare['slimlm_seconds']:.0f} s ({compare['speedup']:.2f}× "
            f"faster through the runtime), per-document agreement {compare['per_document_agreement']}, "
            f"largest log-likelihood difference {compare['max_abs_loglikelihood_difference']:.2e}.",
        ]
    save_results("quality", "\n".join(lines), {"rows": rows, "hf_compare": compare})


if __name__ == "__main__":
    main()
