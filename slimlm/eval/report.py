"""`compress report`: one self-contained HTML page from run directories: what each compression cost in
quality and bought in speed and memory, and whether the measured speed matches the bandwidth model.

A run directory holds `eval.json` (`compress eval --output`), `bench.json` (`compress bench --json`),
`long_context.json` (`compress long-context --output`: the KV-budget curve) and `run.json` (its name and
model, as `compress recipe` writes it; without one the directory's name and the directory itself). Quality is
compared with the baseline run (the first one, or --baseline NAME); speed and memory ratios come from each
bench.json, where the baseline was measured in the same run. Plots are PNGs inlined as data URIs, so the page
is one file.
"""

from __future__ import annotations

import base64
import io
import json
import math
import platform
import subprocess
import time
from pathlib import Path

from slimlm.errors import FieldError, SlimlmError
from slimlm.eval import records
from slimlm.formats import atomic

TEMPLATE = Path(__file__).with_name("report.html.j2")


def _read(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SlimlmError(
            f"{path} is not valid JSON ({e.msg}, line {e.lineno}); rerun the stage that wrote it"
        ) from None


def load_run(run_dir: Path) -> dict:
    """The figures the report shows for one run, flat (None where the run did not measure it)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SlimlmError(f"{run_dir} is not a run directory")
    meta = _read(run_dir / "run.json") or {}
    evaluation, bench = _read(run_dir / "eval.json"), _read(run_dir / "bench.json")
    long_context = _read(run_dir / "long_context.json")
    if evaluation is None and bench is None and long_context is None:
        raise SlimlmError(
            f"{run_dir} has none of eval.json, bench.json, long_context.json; run compress eval/bench/long-context "
            "into it"
        )
    model = Path(meta.get("model", run_dir))
    manifest = _read(model / "slimlm.json") if model.is_dir() else None
    run = {
        "name": meta.get("name", run_dir.name),
        "dir": str(run_dir),
        "model": str(model),
        "method": _method(manifest),
        "tasks": {},
    }
    if evaluation is not None:
        ppl = evaluation.get("slimlm", {}).get("perplexity") if "results" in evaluation else evaluation
        ppl = records.read(records.Perplexity, ppl, str(run_dir / "eval.json")) if ppl else None
        run["wiki_ppl"] = ppl.perplexity if ppl else None
        run["ppl_source"] = Path(ppl.source).name if ppl else None
        run["size_mb"] = ppl.size_bytes / 1e6 if ppl and ppl.size_bytes else None
        for task, metrics in evaluation.get("results", {}).items():
            key = "acc_norm,none" if "acc_norm,none" in metrics else "acc,none"
            if key in metrics and metrics.get(key.replace(",", "_stderr,")) not in (None, "N/A"):
                run["tasks"][task.removeprefix("slimlm_")] = (metrics[key], metrics[key.replace(",", "_stderr,")])
    if run["tasks"]:
        values = list(run["tasks"].values())
        run["task_average"] = sum(v for v, _ in values) / len(values)
        run["task_stderr"] = math.sqrt(sum(s * s for _, s in values)) / len(values)
    if bench is not None:
        run.update(_bench_figures(records.read(records.Bench, bench, str(run_dir / "bench.json"))))
    if long_context is not None:
        run["long_context"] = records.read(records.LongContext, long_context, str(run_dir / "long_context.json"))
    return run


def _method(manifest: dict | None) -> str:
    if not manifest:
        return "float"
    args = manifest.get("arguments", {})
    keys = ("bits", "group_size", "sym", "kv_dtype", "kv_heads", "target_params", "candidate", "to")
    shown = ", ".join(f"{k}={args[k]}" for k in keys if args.get(k) is not None)
    return f"{manifest.get('method', '?')} ({shown})" if shown else manifest.get("method", "?")


def _bench_figures(bench: records.Bench) -> dict:
    mine, base = bench.systems["model"], bench.systems.get("baseline")
    off, on = mine.offline, mine.online
    decode = {d.batch: d for d in off.decode}
    b1 = decode.get(1) or next(iter(decode.values()))
    out = {
        "weight_bytes": off.weight_bytes,
        "kv_bytes_per_token": off.kv_bytes_per_token,
        "decode_b1_tok_s": b1.tok_s,
        "output_tok_s": on.output_tok_s,
        "ttft_p50_s": on.ttft_s.p50,
        "itl_p50_s": on.itl_s.p50,
        "goodput_req_s": on.goodput_req_s,
        "mb_per_token": (off.weight_bytes + bench.config["context"] * off.kv_bytes_per_token) / 1e6,
        "floors": [
            {"batch": d.batch, "predicted_ms": d.floor_ms, "measured_ms": d.step_ms, "ratio": d.floor_ratio}
            for d in off.decode
        ],
        "bandwidth_gb_s": bench.bandwidth_bytes_s / 1e9,
        "threads": bench.threads,
        "bench_warnings": bench.warnings,
    }
    if base is not None:
        base_b1 = {d.batch: d for d in base.offline.decode}.get(b1.batch)
        out["speedup_b1"] = b1.tok_s / base_b1.tok_s if base_b1 else None
        out["speedup_online"] = on.output_tok_s / base.online.output_tok_s
        out["memory_ratio"] = off.weight_bytes / base.offline.weight_bytes
    return out


def pareto(points: list[tuple[float, float]], x_higher: bool) -> list[int]:
    """Indices of the points no other point beats on both axes (y: lower is better; x as told)."""

    def beats(a, b) -> bool:
        ax, bx = (a[0], b[0]) if x_higher else (-a[0], -b[0])
        return ax >= bx and a[1] <= b[1] and (ax > bx or a[1] < b[1])

    return [i for i, p in enumerate(points) if not any(beats(q, p) for j, q in enumerate(points) if j != i)]


def _plot(runs: list[dict], x_key: str, x_label: str, x_higher: bool, y_key: str, y_label: str) -> str | None:
    """A scatter of the runs with their Pareto frontier, as a PNG data URI (None if no run has both)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    have = [r for r in runs if r.get(x_key) is not None and r.get(y_key) is not None]
    if not have:
        return None
    points = [(r[x_key], r[y_key]) for r in have]
    front = sorted((points[i] for i in pareto(points, x_higher)), key=lambda p: p[0])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(*zip(*points, strict=True), color="C0", zorder=3)
    for r, (x, y) in zip(have, points, strict=True):
        ax.annotate(r["name"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.plot(*zip(*front, strict=True), "--", color="C1", label="Pareto frontier")
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def kv_budget_curve(runs: list[dict]) -> dict[str, list[tuple[float, float, str]]]:
    """Per run and policy: (KV MiB a request held, accuracy over every task and length, label) for each budget,
    in budget order: the points of the KV-budget plot."""
    curves = {}
    for r in runs:
        if r.get("long_context") is None:
            continue
        groups: dict[tuple, list[dict]] = {}
        for s in r["long_context"].summary:
            groups.setdefault((s["policy"], s["budget"]), []).append(s)
        for (policy, budget), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            cases = sum(s["cases"] for s in group)
            accuracy = sum(s["accuracy"] * s["cases"] for s in group) / cases
            mib = sum(s["kv_bytes"] * s["cases"] for s in group) / cases / 2**20
            label = "" if budget is None else str(budget)
            curves.setdefault(f"{r['name']}: {policy}", []).append((mib, accuracy, label))
    return curves


def _kv_budget_plot(runs: list[dict]) -> str | None:
    """Accuracy on the long-context tasks against the KV bytes a request keeps, a line per run and policy."""
    curves = kv_budget_curve(runs)
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        xs, ys, labels = zip(*points, strict=True)
        ax.plot(xs, ys, "o-", label=name)
        for x, y, label in points:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("KV MiB a request keeps while decoding (log)")
    ax.set_ylabel("long-context retrieval accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="best", fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def environment() -> dict:
    import torch
    import transformers

    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor())
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return {
        "cpu": cpu,
        "gpu": gpu,
        "torch threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit or "unknown",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def render(
    run_dirs: list[Path],
    out: Path,
    baseline: str | None = None,
    title: str = "slimlm tradeoff report",
    notes: str = "",
    overwrite: bool = False,
) -> dict:
    """Write the report to `out`; returns the runs it shows (with their ratios against the baseline)."""
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    runs = [load_run(d) for d in run_dirs]
    names = [r["name"] for r in runs]
    if len(set(names)) != len(names):
        raise SlimlmError(f"two runs share a name ({', '.join(names)}); give each run directory its own name")
    if baseline is not None and baseline not in names:
        raise FieldError("baseline", f"{baseline} is not one of the runs: {', '.join(names)}")
    base = runs[names.index(baseline)] if baseline else runs[0]
    for r in runs:
        if r.get("wiki_ppl") and base.get("wiki_ppl"):
            r["ppl_change"] = r["wiki_ppl"] / base["wiki_ppl"] - 1
        if r.get("task_average") and base.get("task_average"):
            r["recovery"] = r["task_average"] / base["task_average"]
    source = base.get("ppl_source") or "wiki"
    quality_key, quality_label = ("wiki_ppl", f"{source} perplexity (lower is better)")
    plots = [
        p
        for p in (
            _plot(runs, "output_tok_s", "output tokens/s under the Poisson load", True, quality_key, quality_label),
            _plot(
                runs,
                "mb_per_token",
                "MB moved per decoded token (batch 1: weights + KV)",
                False,
                quality_key,
                quality_label,
            ),
            _plot(runs, "size_mb", "checkpoint size (MB)", False, quality_key, quality_label),
            _kv_budget_plot(runs),
        )
        if p
    ]
    tasks = sorted({t for r in runs for t in r["tasks"]})
    env = Environment(loader=FileSystemLoader(TEMPLATE.parent), autoescape=select_autoescape(["html", "j2"]))
    html = env.get_template(TEMPLATE.name).render(
        title=title, runs=runs, base=base, tasks=tasks, plots=plots, environment=environment(), notes=notes
    )
    atomic.write_file(Path(out), html, overwrite, "out")
    return {"runs": runs, "baseline": base["name"], "plots": len(plots)}


def main_table(runs: list[dict]) -> str:
    """The report's main table as text, for the terminal."""
    header = (
        f"{'run':14} {'wiki ppl':>9} {'Δ ppl':>7} {'tasks':>6} {'recov.':>7} {'weight MB':>10} "
        f"{'b1 tok/s':>9} {'speedup':>8} {'load tok/s':>10} {'TTFT p50':>9}"
    )
    lines = [header]

    def cell(value, spec: str) -> str:  # spec: sign, width and type, e.g. "+7.1%"
        width = int("".join(c for c in spec.split(".")[0] if c.isdigit()))
        return f"{value:{spec}}" if value is not None else f"{'-':>{width}}"

    for r in runs:
        weight = r.get("weight_bytes") and r["weight_bytes"] / 1e6
        lines.append(
            f"{r['name'][:14]:14} {cell(r.get('wiki_ppl'), '9.2f')} {cell(r.get('ppl_change'), '+7.1%')} "
            f"{cell(r.get('task_average'), '6.3f')} {cell(r.get('recovery'), '7.1%')} "
            f"{cell(weight, '10.1f')} {cell(r.get('decode_b1_tok_s'), '9.1f')} "
            f"{cell(r.get('speedup_b1'), '8.2f')} {cell(r.get('output_tok_s'), '10.1f')} "
            f"{cell(r.get('ttft_p50_s'), '9.3f')}"
        )
    lines += [f"{r['name']}: {w}" for r in runs for w in r.get("bench_warnings", [])]
    return "\n".join(lines)
