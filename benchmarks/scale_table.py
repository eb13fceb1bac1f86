"""Every command on a real model, one row each: the command line, its wall time and peak memory, what it wrote,
and the quality of what it made, measured the same way for every row (wiki perplexity over the same tokens,
through the runtime, against the float model's in the same table).

    .venv/bin/python benchmarks/scale_table.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --out benchmarks/results/scale-qwen1.5b-2026-12-05 [--rows float,rtn-w4,...] [--samples 128]

A row is done when its JSON is in --out without an error: a rerun skips it, so the table can be filled over
several sittings (`--rows` picks which; the table is rewritten from every row present). Checkpoints go to
--work. Each command runs in its own process; its peak resident memory is that process tree's (getrusage).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from quant_vs_peers import run_one

from slimlm import models
from slimlm.eval.report import environment
from slimlm.kernels.cpu_library import cpu_flags

COMPRESS = [sys.executable, "-m", "slimlm.cli"]
PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."
CODE = 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number, computed iteratively."""\n'
BENCH_LINES = ("prefill tok/s", "decode b1 tok/s", "decode b8 tok/s", "decode b1 / floor", "decode b8 / floor")


def shown(cmd: list[str]) -> str:
    """A command as a shell would take it, on one line (`python -m` dropped)."""
    return shlex.join(cmd[2:]).replace("\n", "\\n")


def rows(a: argparse.Namespace) -> dict[str, list[list[str]]]:
    """Row name -> the commands it runs (a checkpoint row's first command writes work/NAME)."""
    w = a.work
    calib = ["--calib", "owt", "--num-samples", str(a.samples), "--seq-len", "512", "--overwrite"]
    w4 = ["--bits", "4", "--group-size", str(a.group_size)]

    def make(name: str, *args: str) -> list[str]:
        return [*COMPRESS, *args, "--out", str(w / name)]

    kv_only = ["--train", "k_proj,v_proj"]
    gen = ["--prompt", CODE, "--max-tokens", "128", "--kv-cache-memory", "512M"]
    return {
        "float": [],
        "rtn-w4": [make("rtn-w4", "rtn", "--model", a.model, *calib, *w4)],
        "rtn-w8": [make("rtn-w8", "rtn", "--model", a.model, *calib, "--bits", "8", "--group-size", str(a.group_size))],
        "gptq-w4": [make("gptq-w4", "gptq", "--model", a.model, *calib, *w4)],
        "awq-w4": [make("awq-w4", "awq", "--model", a.model, *calib, *w4)],
        "awq-gptq-w4": [make("awq-gptq-w4", "awq", "--model", a.model, *calib, *w4, "--then", "gptq")],
        "kv-fp8": [make("kv-fp8", "kv", a.model, *calib, "--kv-dtype", "fp8")],
        "kv-int8": [make("kv-int8", "kv", a.model, *calib, "--kv-dtype", "int8")],
        # trained in part: the whole 1.5B's gradients and AdamW moments alone are 20 GiB (distill.check_memory)
        "gqa-1kv": [
            make("gqa-1kv", "gqa", "--model", a.model, "--kv-heads", "1", "--uptrain-tokens", a.train_tokens, *kv_only)
        ],
        "prune-60": [
            make(
                "prune-60",
                "prune",
                "--model",
                a.model,
                "--target-params",
                "0.6",
                "--search-tokens",
                "0",
                "--distill-tokens",
                a.train_tokens,
                "--train",
                "mlp",
            )
        ],  # fmt: skip
        "bench-w4": [
            [
                *COMPRESS,
                "bench",
                str(w / "rtn-w4"),
                "--batch",
                "1,8",
                "--rounds",
                "2",
                "--requests",  # the float baseline's default workload ran past 9 minutes on 2 cores
                "8",
                "--json",
                str(a.out / "bench-w4.bench.json"),
                "--overwrite",
            ]
        ],  # fmt: skip
        "generate-w4": [[*COMPRESS, "generate", str(w / "rtn-w4"), *gen]],
        "speculative-w4": [
            [*COMPRESS, "generate", str(w / "rtn-w4"), *gen, "--speculative", str(w / "draft-w4")],
            [*COMPRESS, "generate", str(w / "rtn-w4"), *gen],
        ],
        "serve-w4": [],  # served and asked through the openai client (serve_row)
    }


def evaluate(a: argparse.Namespace, checkpoint: str, name: str) -> dict:
    """Wiki perplexity of a checkpoint over --ppl-tokens, with the eval's own wall time and peak memory."""
    out = a.out / f"{name}.eval.json"
    cmd = [*COMPRESS, "eval", checkpoint, "--ppl", "wiki", "--seq-len", "512", "--max-tokens", str(a.ppl_tokens)]
    cmd += ["--dtype", a.eval_dtype]
    seconds, peak, log = run_one([*cmd, "--output", str(out), "--overwrite"])
    if not out.exists():
        return {"eval_error": log.strip().splitlines()[-1] if log.strip() else "failed"}
    result = json.loads(out.read_text())
    ppl = result.get("perplexity") or result["results"]["perplexity"]
    return {"ppl": ppl, "eval_seconds": round(seconds, 1), "eval_peak_gb": peak, "eval_command": shown(cmd)}


def serve_row(a: argparse.Namespace) -> dict:
    """compress serve on the W4 checkpoint, asked one chat completion through the openai client."""
    import openai

    port = "18431"
    cmd = [*COMPRESS, "serve", str(a.work / "rtn-w4"), "--port", port, "--kv-cache-memory", "512M"]
    start = time.time()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if server.poll() is not None:
                return {"error": server.stderr.read().strip().splitlines()[-1]}
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        ready = time.time() - start
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        asked = time.time()
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=128,
            temperature=0,
        )
        return {
            "command": shown(cmd),
            "ready_seconds": round(ready, 1),
            "reply_seconds": round(time.time() - asked, 1),
            "completion_tokens": reply.usage.completion_tokens,
            "text": reply.choices[0].message.content[:200],
        }
    finally:
        server.terminate()
        server.wait(timeout=60)


def run_row(a: argparse.Namespace, name: str, commands: list[list[str]]) -> dict:
    if name == "serve-w4":
        return serve_row(a)
    row: dict = {"commands": []}
    for cmd in commands:
        seconds, peak, log = run_one(cmd)
        row["commands"].append(
            {"command": shown(cmd), "seconds": round(seconds, 1), "peak_gb": peak, "tail": log[-1500:]}
        )
        lines = [line.strip() for line in log.splitlines()]
        stats = [line for line in lines if line.startswith("[") and "tokens/s" in line]  # generate's last line
        row["commands"][-1]["result"] = "; ".join(
            stats[-1:] + [" ".join(line.split()) for line in lines if line.startswith(BENCH_LINES)]
        )
        if peak != peak:  # nan: the command failed
            row["error"] = log.strip().splitlines()[-1] if log.strip() else "failed"
            return row
    if name == "speculative-w4":  # the same text as plain decoding (greedy)
        texts = [c["tail"].split("MAXRSS_KB")[0].strip() for c in row["commands"]]
        row["same_text"] = texts[0] == texts[1]
    checkpoint = a.model if name == "float" else a.work / name
    if name == "float" or (commands and commands[0][-1] == str(checkpoint)):
        path = models.resolve(a.model) if name == "float" else checkpoint
        row["size_gb"] = round(sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 1e9, 3)
        row.update(evaluate(a, str(checkpoint), name))
    return row


def machine() -> str:
    """This CPU as a row records it: its name, cores and the instructions the kernels choose between."""
    flags = cpu_flags()
    isa = "AVX2"
    if "avx512f" in flags:
        isa = "AVX-512" + (" BF16" if "avx512_bf16" in flags else "") + (" + AMX" if "amx_bf16" in flags else "")
    march = os.environ.get("SLIMLM_CPU_MARCH")
    return f"{environment()['cpu']}, {os.cpu_count()} cores, {isa}" + (f", SLIMLM_CPU_MARCH={march}" if march else "")


def table(a: argparse.Namespace) -> str:
    found = {p.name.removesuffix(".json"): json.loads(p.read_text()) for p in sorted(a.out.glob("*.row.json"))}
    done = {k.removesuffix(".row"): v for k, v in found.items()}
    base = done.get("float", {}).get("ppl")
    machines = list(dict.fromkeys(r.get("machine", "not recorded") for r in done.values()))
    lines = [
        f"{a.model}: every command; W4/W8 g{a.group_size}, calibration {a.samples}×512 owt tokens; "
        f"wiki perplexity over {a.ppl_tokens} tokens (512-token windows) through the runtime in {a.eval_dtype} "
        "activations, the same tokens for every row; bench, generate, speculative and serve rows run the runtime's "
        "default dtype (auto: bf16 on AVX-512 BF16, fp32 on AVX2) unless their command says otherwise.",
        "",
        "Machines (only ratios within one row, or between rows on one machine, carry over): "
        + "; ".join(f"M{i + 1}: {m}" for i, m in enumerate(machines)),
        "",
        "| row | machine | command | wall s | peak RSS GB | checkpoint GB | wiki ppl | vs float | eval s | result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    # rows of the table, then any earlier runs kept beside them under another name (e.g. before a fix)
    for name in [*rows(a), *sorted(set(done) - set(rows(a)))]:
        r = done.get(name)
        if r is None:
            lines.append(f"| {name} | | not run | | | | | | | |")
            continue
        where = f"M{machines.index(r.get('machine', 'not recorded')) + 1}"
        if name.startswith("serve-w4"):  # also the runs kept under other names (serve-w4-fp32)
            info = r.get("error") or (
                f"ready in {r['ready_seconds']} s; {r['completion_tokens']} tokens in {r['reply_seconds']} s"
            )
            lines.append(f"| {name} | {where} | `{r.get('command', '')}` + openai client | | | | | | | {info} |")
            continue
        cmds = r.get("commands", [])
        command = " ; ".join(f"`{c['command']}`" for c in cmds) or f"`{r.get('eval_command', '')}`"
        secs = " / ".join(f"{c['seconds']:.0f}" for c in cmds)
        peak = " / ".join(f"{c['peak_gb']:.2f}" for c in cmds)
        ppl = r.get("ppl")
        vs = f"{ppl / base - 1:+.2%}" if ppl and base else ""
        err = f" **failed**: {r['error'][:100]}" if r.get("error") else ""
        result = " / ".join(c.get("result", "") for c in cmds if c.get("result"))
        if "same_text" in r:
            result += f"; same text as plain decoding: {r['same_text']}"
        lines.append(
            f"| {name} | {where} | {command}{err} | {secs} | {peak} | {r.get('size_gb', '')} | "
            f"{'' if ppl is None else f'{ppl:.3f}'} | {vs} | {r.get('eval_seconds', '')} | {result} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model (quantized RTN W4 first)")
    p.add_argument("--out", type=Path, required=True, help="results folder: one JSON per row, table.md")
    p.add_argument("--work", type=Path, default=Path("/tmp/slimlm-scale"), help="checkpoints")
    p.add_argument("--rows", help="comma-separated rows to run (default: every row not yet done)")
    p.add_argument("--samples", type=int, default=128, help="calibration windows of 512 tokens")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--ppl-tokens", type=int, default=16384)
    p.add_argument("--train-tokens", default="8192", help="gqa uptraining / prune distillation tokens")
    p.add_argument(
        "--eval-dtype",
        default="float32",
        help="activations the perplexity column is scored in (every row so far: float32; the float model scored "
        "19.5135 in fp32 and 19.5141 in bf16, 5.7x faster); the speed rows run the runtime's default, auto",
    )
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    commands = rows(a)
    wanted = a.rows.split(",") if a.rows else list(commands)
    unknown = set(wanted) - set(commands)
    if unknown:
        p.error(f"unknown rows {', '.join(sorted(unknown))}; choose from {', '.join(commands)}")
    if any(r.startswith("speculative") for r in wanted) and not (a.work / "draft-w4" / "config.json").exists():
        draft = [*COMPRESS, "rtn", "--model", a.draft, "--bits", "4", "--group-size", str(a.group_size)]
        run_one([*draft, "--out", str(a.work / "draft-w4"), "--overwrite"])
    for name in wanted:
        path = a.out / f"{name}.row.json"
        if path.exists() and "error" not in json.loads(path.read_text()):
            continue
        print(f"{time.strftime('%H:%M:%S')} {name} ...", flush=True)
        row = {"machine": machine(), **run_row(a, name, commands[name])}
        path.write_text(json.dumps(row, indent=2))
        print(json.dumps({k: v for k, v in row.items() if k != "commands"}), flush=True)
    text = table(a)
    (a.out / "table.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
