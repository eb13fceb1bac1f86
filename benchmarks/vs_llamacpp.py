"""slimlm's runtime against llama.cpp on a model's own GGUF at about the same bits, measured in one run.

llama.cpp (llama-cpp-python, in its own venv) runs the model's own GGUF; slimlm serves what `compress rtn`
makes of the same weights at about the same bits (MODELS):
    smollm2-135m         Q4_1 layers (4-bit, asymmetric, blocks of 32), Q8_0 tied embedding/output
                         against RTN W4 g32 asymmetric with an 8-bit lm_head
    qwen2.5-coder-1.5b   Q4_K_M (4-bit blocks of 32 in super-blocks, some layers Q6_K), Q6_K output
                         against RTN W4 g128 symmetric with the default 8-bit lm_head
Both get the same token ids and the same number of threads; the systems take turns for --rounds rounds and each one's
best is kept (llama.cpp's spinning threads are hit hardest by a busy neighbour: 80 to 153 tok/s between runs).

    prefill   one prompt of --prompt tokens in one call (llama.cpp: Llama.eval; slimlm: one engine forward)
    decode    one new token per step after a short context, batch 1 (llama.cpp: single-token Llama.eval)
    batch 32  slimlm only: llama-cpp-python evaluates one sequence at a time

    .venv/bin/python benchmarks/vs_llamacpp.py --llama-python /path/to/llama-venv/bin/python \
        [--model qwen2.5-coder-1.5b] [--dtypes float32] [--threads 2]

On an AVX-512 machine, SLIMLM_CPU_MARCH=haswell with a llama.cpp built for AVX2 only (CMAKE_ARGS="-DGGML_NATIVE=OFF
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON") compares the two as an AVX2 machine runs them (torch's own
matmuls, in prefill, keep the machine's instructions).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from slimlm import assets, models
from slimlm.eval.plan import copy_bandwidth
from slimlm.perf.config import BenchConfig
from slimlm.perf.offline import offline

LLAMA = r"""
import json, statistics, sys, time
from llama_cpp import Llama
path, threads, prompt, steps = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=len(prompt),
            verbose=False)
def timed(tokens):
    start = time.perf_counter()
    llm.eval(tokens)
    return time.perf_counter() - start
prefill = []
for _ in range(4):  # the first call pays one-time costs: the best of the rest
    llm.reset()
    prefill.append(timed(prompt))
llm.reset()
llm.eval(prompt[:16])
decode = [timed([prompt[16 + i % 64]]) for i in range(steps)]
print(json.dumps({"prefill_tok_s": len(prompt) / min(prefill[1:]),
                  "decode_tok_s": 1 / statistics.median(decode[8:])}))
"""


def llama_cpp(python: str, gguf: Path, threads: int, prompt: list[int], steps: int) -> dict:
    cmd = [python, "-c", LLAMA, str(gguf), str(threads), json.dumps(prompt), str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode != 0:
        sys.exit(f"llama.cpp run failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


MODELS = {  # model: (compress rtn flags, llama.cpp's label, slimlm's label)
    "smollm2-135m": (
        ["--bits", "4", "--group-size", "32", "--asym", "--quantize-lm-head", "8"],
        "GGUF Q4_1, Q8_0 output",
        "W4 g32 asym, 8-bit lm_head",
    ),
    "qwen2.5-coder-1.5b": (
        ["--bits", "4", "--group-size", "128"],
        "GGUF Q4_K_M, Q6_K output",
        "W4 g128, 8-bit lm_head",
    ),
}


def checkpoint(work: Path, model: str) -> Path:
    """The RTN checkpoint of `model` at about its GGUF's bits (MODELS), made once."""
    flags = MODELS[model][0]
    out = work / f"{model}-rtn{'_'.join(flags).replace('--', '-')}"
    if not (out / "config.json").exists():
        compress = shutil.which("compress") or str(Path(sys.executable).with_name("compress"))
        subprocess.run([compress, "rtn", "--model", model, *flags, "--out", str(out), "--overwrite"], check=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python installed")
    parser.add_argument("--model", default="smollm2-135m", choices=list(MODELS))
    parser.add_argument("--dtypes", default="float32,bfloat16", help="slimlm's compute dtypes, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=500, help="prefill length, tokens")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed")
    parser.add_argument("--rounds", type=int, default=3, help="turns of every system; the best of each is kept")
    parser.add_argument("--work", default="out/vs_llamacpp", help="where the slimlm checkpoint is made")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = checkpoint(Path(args.work), args.model)
    _, peer_label, label = MODELS[args.model]
    gguf = assets.original_file(args.model)
    tokenizer = models.load_tokenizer(models.resolve(args.model))
    ids = tokenizer.encode("\n\n".join(assets.text_passages("wiki")[:40]))
    prompt = ids[: args.prompt]
    march = os.environ.get("SLIMLM_CPU_MARCH", "native")
    print(
        f"{args.model}: {platform.processor() or platform.machine()}, slimlm's kernels -march={march}, torch "
        f"{torch.__version__}, {args.threads} threads; prompt {len(prompt)} tokens, {args.steps} decode steps",
        flush=True,
    )
    peer_name = f"llama.cpp ({peer_label})"
    bandwidth = copy_bandwidth("cpu")
    results: dict[str, dict] = {}
    for _ in range(args.rounds):  # in turn, each side's best kept: single runs here drift by up to 2×
        runs = {peer_name: llama_cpp(args.llama_python, gguf, args.threads, prompt, args.steps)}
        for dtype in args.dtypes.split(","):
            config = BenchConfig(batch=[1, 32], context=64, prefill_len=len(prompt), steps=args.steps // 4, dtype=dtype)
            run = offline(str(model), config, bandwidth)
            one, many = run["decode"]
            runs[f"slimlm {dtype} ({label})"] = {
                "prefill_tok_s": run["prefill_tok_s"],
                "decode_tok_s": one["tok_s"],
                "batch32_tok_s": many["tok_s"],
            }
        for name, run in runs.items():
            best = results.setdefault(name, run)
            results[name] = {key: max(value, best[key]) for key, value in run.items()}
    peer = results[peer_name]
    print(f"{'system':<48}{'prefill tok/s':>14}{'÷llama':>8}{'decode tok/s':>14}{'÷llama':>8}{'b32 tok/s':>11}")
    for name, r in results.items():
        b32 = f"{r['batch32_tok_s']:>11.0f}" if "batch32_tok_s" in r else f"{'-':>11}"
        print(
            f"{name:<48}{r['prefill_tok_s']:>14.0f}{r['prefill_tok_s'] / peer['prefill_tok_s']:>7.2f}×"
            f"{r['decode_tok_s']:>14.1f}{r['decode_tok_s'] / peer['decode_tok_s']:>7.2f}×{b32}"
        )
    if args.json:
        run = {"model": args.model, "march": march, "threads": args.threads, "prompt": len(prompt), "results": results}
        Path(args.json).write_text(json.dumps(run, indent=1))


if __name__ == "__main__":
    main()
