"""Side by side: slimlm RTN / GPTQ / AWQ / AutoRound and budgets against llm-compressor (and GPTQModel and
AutoRound when their venvs are given), with each checkpoint's bits per decoder weight.

Every method gets the same calibration token windows (owt, joined with EOS and cut, see slimlm.data) and
every result is scored by the same perplexity code on the same wiki windows, in this process. Each
quantization runs as its own subprocess so that its wall time and peak RSS are measured the same way.

    .venv/bin/python benchmarks/quant_vs_peers.py --llmcompressor-python /path/to/llmc/bin/python \
        [--gptqmodel-python /path/to/gptqmodel/bin/python] [--samples 32] [--settings w4g64-sym,...]

A larger model's per-layer cost is compared on its first layers: `--model qwen2.5-coder-1.5b --layers 4` writes
a checkpoint of the embedding, those decoder layers, the final norm and the head, and every tool quantizes that
(its perplexity is a truncated network's, so only the increases against its own float baseline compare).

Peers run in their own venvs (they pin other transformers versions); see benchmarks/peers/*.py for the
exact calls. Prints a table and writes JSON + Markdown under benchmarks/results/.

Bits per weight count what a checkpoint stores for the decoder layers' linears (packed codes, scales in their
stored dtype, zero points) over their weight count. A method name ending in `-budget=B` runs that slimlm method
with `--budget B` (mixed precision), e.g. `gptq-budget=3.5`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from slimlm import arch, data, models
from slimlm.eval.perplexity import engine_for, perplexity
from slimlm.eval.plan import stored_linear_bytes

HERE = Path(__file__).parent
SETTINGS = {  # name: (bits, group size, symmetric)
    "w4g64-sym": (4, 64, True),
    "w4g64-asym": (4, 64, False),
    "w4g128-sym": (4, 128, True),
    "w4g128-asym": (4, 128, False),
    "w4-channel-sym": (4, -1, True),
    "w3g64-asym": (3, 64, False),
    "w3g128-asym": (3, 128, False),
    "w2g64-asym": (2, 64, False),
    "w8-channel-sym": (8, -1, True),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--llmcompressor-python", help="python of a venv with llmcompressor==0.14.0.1")
    p.add_argument("--gptqmodel-python", help="python of a venv with gptqmodel==7.6.0")
    p.add_argument("--autoround-python", help="python of a venv with auto-round==0.16.1")
    p.add_argument("--model", default="smollm2-135m", help="asset name or local directory")
    p.add_argument("--layers", type=int, help="quantize a checkpoint of the model's first LAYERS decoder layers")
    p.add_argument("--samples", type=int, default=32, help="calibration windows of --seq-len tokens")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0, help="which calibration windows (results get a -seedN suffix)")
    p.add_argument("--ppl-tokens", type=int, default=16384)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--methods", default="rtn,gptq,gptq-act,awq,llmc-gptq,llmc-awq,gptqmodel")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "slimlm-quant-vs-peers")
    p.add_argument(
        "--report-only",
        nargs="+",
        type=Path,
        metavar="LOG",
        help="merge the JSON rows printed by earlier runs into one table; runs nothing",
    )
    p.add_argument("--note", default="", help="a line printed under the table's header")
    a = p.parse_args()
    if a.report_only:
        rows = [
            json.loads(line)
            for log in a.report_only
            for line in log.read_text().splitlines()
            if line.startswith('{"setting"')
        ]
        base = [r for r in rows if r["method"] == "baseline"]
        report(
            rows
            if base
            else [
                {
                    "setting": "float",
                    "method": "baseline",
                    "ppl": _base_ppl(a.report_only),
                    "seconds": None,
                    "peak_gb": None,
                }
            ]
            + rows,
            _base_ppl(a.report_only),
            a,
        )
        return

    model_dir = models.resolve(a.model)
    if a.layers is not None:
        total = models.check(model_dir)["num_hidden_layers"]
        if not 0 < a.layers <= total:
            p.error(f"--layers {a.layers}: {a.model} has {total} decoder layers; give 1 to {total}")
        model_dir = first_layers(model_dir, a.layers, a.work / f"first-{a.layers}-layers")
    calib_file = write_calibration(model_dir, a.work, a.samples, a.seq_len, a.seed)
    base = perplexity(engine_for(str(model_dir), a.seq_len), "wiki", a.seq_len, a.ppl_tokens, progress=False)
    print(f"float baseline: wiki ppl {base['perplexity']:.3f} ({base['tokens_scored']} tokens)", flush=True)

    rows = [{"setting": "float", "method": "baseline", "ppl": base["perplexity"], "seconds": None, "peak_gb": None}]
    methods = a.methods.split(",")
    for setting in a.settings.split(","):
        jobs = quantize_jobs(setting, a, calib_file, model_dir)
        for method in methods:
            for suffix, flag in (("-float-target=", "--float-target"), ("-budget=", "--budget")):
                plain, _, value = method.partition(suffix)  # e.g. gptq-float-target=0.5, gptq-budget=3.5
                if value and plain in jobs:
                    jobs[method] = jobs[plain] + [flag, value]
            if method not in jobs:
                continue
            out = a.work / f"{setting}-{method}"
            seconds, peak, log = run_one(jobs[method] + ["--out", str(out)])
            row = {"setting": setting, "method": method, "seconds": round(seconds, 1), "peak_gb": peak}
            if (out / "config.json").exists():
                engine = engine_for(str(out), a.seq_len)
                row["ppl"] = perplexity(engine, "wiki", a.seq_len, a.ppl_tokens, progress=False)["perplexity"]
                row["linear_bytes"] = stored_linear_bytes(out)
                row["bits_per_weight"] = round(8 * row["linear_bytes"] / linear_weights(model_dir), 3)
            else:
                row["ppl"], row["error"] = float("nan"), log.strip().splitlines()[-1] if log.strip() else "failed"
            rows.append(row)
            print(json.dumps(row), flush=True)

    report(rows, base["perplexity"], a)


def linear_weights(model_dir: Path) -> int:
    """The decoder linears' weight count, from a float checkpoint's headers."""
    count = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as shard:
            for name in shard.keys():
                if arch.decoder_linear(name) and name.endswith(".weight"):
                    rows, cols = shard.get_slice(name).get_shape()
                    count += rows * cols
    return count


def first_layers(model_dir: Path, layers: int, out: Path) -> Path:
    """A checkpoint of the model cut after its first `layers` decoder layers (embedding, final norm and head
    kept), written once to `out`."""
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    kept = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as shard:
            for name in shard.keys():
                parts = name.split(".")
                if not (name.startswith(f"{arch.LAYERS}.") and int(parts[2]) >= layers):
                    kept[name] = shard.get_tensor(name)
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    for f in model_dir.iterdir():
        # The tokenizer and generation settings; not slimlm.json, whose file hashes are the whole model's
        if f.is_file() and f.name.startswith(("tokenizer", "generation_config", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    config.pop("layer_types", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_calibration(model_dir: Path, work: Path, samples: int, seq_len: int, seed: int) -> Path:
    """The calibration windows every method gets, as token ids (what the peers read)."""
    work.mkdir(parents=True, exist_ok=True)
    calib_file = work / "calib.safetensors"
    tokenizer = models.load_tokenizer(model_dir)
    save_file({"input_ids": data.calibration_windows("owt", tokenizer, samples, seq_len, seed)}, calib_file)
    return calib_file


def quantize_jobs(setting: str, a: argparse.Namespace, calib_file: Path, model_dir: Path) -> dict[str, list[str]]:
    """Method name -> the command that quantizes the default model at `setting` (add --out DIR)."""
    bits, gs, sym = SETTINGS[setting]
    qflags = ["--bits", str(bits), "--group-size", str(gs), "--sym" if sym else "--asym"]
    ours_common = [
        "--model",
        str(model_dir),
        "--calib",
        "owt",
        "--num-samples",
        str(a.samples),
        "--seq-len",
        str(a.seq_len),
        "--seed",
        str(a.seed),
        "--overwrite",
        "--float-lm-head",  # as the peers leave it (slimlm's own default rounds it to 8 bits)
    ]
    peer_common = [
        "--model",
        str(model_dir),
        "--calib",
        str(calib_file),
        "--bits",
        str(bits),
        "--group-size",
        str(gs),
    ] + ([] if sym else ["--asym"])
    ours = [sys.executable, "-m", "slimlm.cli"]
    jobs = {
        "rtn": [*ours, "rtn", *ours_common, *qflags],
        "gptq": [*ours, "gptq", *ours_common, *qflags],  # act-order by default
        "gptq-fp32": [*ours, "gptq", *ours_common, *qflags, "--compute-dtype", "float32"],
        "gptq-noact": [*ours, "gptq", *ours_common, *qflags, "--no-act-order"],
        "gptq-act": [*ours, "gptq", *ours_common, *qflags, "--act-order"],
        "gptq-minmax": [*ours, "gptq", *ours_common, *qflags, "--observer", "minmax"],
        "gptq-mse": [*ours, "gptq", *ours_common, *qflags, "--observer", "mse"],
        "gptq-plain": [*ours, "gptq", *ours_common, *qflags, "--no-float-target"],  # -float-target=α: that α
        "awq": [*ours, "awq", *ours_common, *qflags],
        "awq-fp32": [*ours, "awq", *ours_common, *qflags, "--compute-dtype", "float32"],
        "awq-gptq": [*ours, "awq", *ours_common, *qflags, "--then", "gptq"],
        "awq-noclip-gptq": [*ours, "awq", *ours_common, *qflags, "--then", "gptq", "--no-clip"],
        "awq-gptq-mse": [*ours, "awq", *ours_common, *qflags, "--then", "gptq", "--observer", "mse"],
        "awq-gptq-plain": [*ours, "awq", *ours_common, *qflags, "--then", "gptq", "--no-float-target"],
        "autoround": [*ours, "autoround", *ours_common, *qflags],
        "awq-autoround": [*ours, "awq", *ours_common, *qflags, "--then", "autoround"],
    }
    if getattr(a, "llmcompressor_python", None):
        runner = str(HERE / "peers" / "llmcompressor_run.py")
        jobs["llmc-gptq"] = [a.llmcompressor_python, runner, "--method", "gptq", *peer_common]
        jobs["llmc-awq"] = [a.llmcompressor_python, runner, "--method", "awq", *peer_common]
    if getattr(a, "autoround_python", None):
        runner = str(HERE / "peers" / "autoround_run.py")
        jobs["ar-peer"] = [a.autoround_python, runner, *peer_common]  # AutoRound's default: 200 steps
        jobs["ar-peer-100"] = [a.autoround_python, runner, *peer_common, "--iters", "100"]  # slimlm's steps
        jobs["ar-peer-light"] = [a.autoround_python, runner, *peer_common, "--iters", "50", "--lr", "5e-3"]
    if getattr(a, "gptqmodel_python", None):
        jobs["gptqmodel"] = [a.gptqmodel_python, str(HERE / "peers" / "gptqmodel_run.py"), *peer_common]
    return jobs


# A child forked from this (large) process would report this process's RSS as its own peak, since Linux
# keeps the high-water mark across exec; a small wrapper process runs the job and reports the job's peak.
WRAPPER = (
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
    "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"
)


def run_one(cmd: list[str]) -> tuple[float, float, str]:
    """Run a job in a child process: wall seconds, the job's own peak RSS in GB, and its output tail."""
    env = dict(os.environ, TQDM_DISABLE="1", GPTQMODEL_CPU_WORKERS="2")
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], capture_output=True, text=True, env=env)
    seconds = time.time() - start
    out = proc.stdout + proc.stderr
    peaks = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("MAXRSS_KB")]
    peak = peaks[-1] / 1e6 if proc.returncode == 0 and peaks else float("nan")
    return seconds, peak, out[-4000:]


def _base_ppl(logs: list[Path]) -> float:
    for log in logs:
        for line in log.read_text().splitlines():
            if line.startswith("float baseline: wiki ppl"):
                return float(line.split()[4])
    raise SystemExit("no 'float baseline' line in the logs")


def report(rows: list[dict], base_ppl: float, a: argparse.Namespace) -> None:
    peers = {
        "gptq": "llmc-gptq",
        "gptq-fp32": "llmc-gptq",
        "gptq-noact": "llmc-gptq",
        "gptq-act": "llmc-gptq",
        "awq": "llmc-awq",
        "awq-fp32": "llmc-awq",
        "awq-gptq": "llmc-gptq",
        "awq-noclip-gptq": "llmc-gptq",
        "gptq-plain": "llmc-gptq",
        "awq-gptq-plain": "llmc-gptq",
        "autoround": "ar-peer-100",
        "awq-autoround": "ar-peer-100",
    }
    by_key = {(r["setting"], r["method"]): r for r in rows}
    lines = [
        f"{a.model}{f' (first {a.layers} layers)' if a.layers else ''}, "
        f"calibration {a.samples}×{a.seq_len} owt tokens (seed {a.seed}, same windows for all), "
        f"wiki perplexity over {a.ppl_tokens} tokens (same windows for all), 2 CPU cores.",
        *([a.note] if a.note else []),
        "",
        "| setting | method | bits/weight | wiki ppl | increase | time s | peak RSS GB | ppl increase ratio vs peer "
        "| time ratio vs peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        inc = r["ppl"] / base_ppl - 1
        plain = r["method"].partition("-float-target")[0].partition("-budget")[0]
        peer = by_key.get((r["setting"], peers.get(plain, "")))
        ratio_q = ratio_t = ""
        if peer and peer["ppl"] == peer["ppl"]:
            ratio_q = f"{inc / (peer['ppl'] / base_ppl - 1):.2f}"
            if r["seconds"] and peer["seconds"]:  # None: a peer row merged from a run on another machine
                ratio_t = f"{r['seconds'] / peer['seconds']:.2f}"
        secs = "" if r["seconds"] is None else f"{r['seconds']:.0f}"
        peak = "" if r["peak_gb"] is None else f"{r['peak_gb']:.2f}"
        err = f" ({r['error'][:60]})" if r.get("error") else ""
        bits = f"{r['bits_per_weight']:.3f}" if r.get("bits_per_weight") else ""
        lines.append(
            f"| {r['setting']} | {r['method']}{err} | {bits} | {r['ppl']:.3f} | {inc:+.1%} | {secs} | {peak} | "
            f"{ratio_q} | {ratio_t} |"
        )
    name = "quant_vs_peers" + f"-{a.model}-{a.layers}layers" * bool(a.layers) + f"-seed{a.seed}" * bool(a.seed)
    save_results(name, "\n".join(lines), {"base_ppl": base_ppl, "rows": rows})


def save_results(name: str, table: str, data: dict) -> None:
    """Print the table; write it and the data as benchmarks/results/NAME-DATE.{md,json}."""
    print("\n" + table, flush=True)
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    stamp = time.strftime("%Y-%m-%d")
    (results / f"{name}-{stamp}.md").write_text(table + "\n")
    (results / f"{name}-{stamp}.json").write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    torch.set_num_threads(os.cpu_count() or 1)
    main()
