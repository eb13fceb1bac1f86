"""slimlm's runtime against vLLM's CPU build on the same checkpoint, decode tok/s at batch 1 and 32, one run.

Both load the same directory with their public offline API (`LLM(model=DIR, dtype=...)`), get the same token ids
(--prompt random tokens per sequence), greedy, ignore EOS, prefix caching off. Decode speed is measured the same way
on both: the time of a generate() of 1 + --steps tokens minus that of a 1-token one (the prompt's prefill), so
scheduling, sampling and detokenisation-free output are in both numbers. The systems take turns for --rounds rounds
and each one's best is kept (a busy neighbour moves single runs by up to 2x). vLLM runs in its own venv
(benchmarks/peers/vllm_venv.sh) as a worker process that stays loaded between turns.

    .venv/bin/python benchmarks/vs_vllm.py --vllm-python $(bash benchmarks/peers/vllm_venv.sh) \
        [--model smollm2-135m] [--dtypes float32,bfloat16] [--w4] [--threads 2]

--w4 adds RTN W4 (group 64, symmetric, float lm_head: the kind vLLM's CPU kernel runs) at bfloat16, the only
activation dtype that kernel multiplies; vLLM's AVX2 build has no W4 kernel at all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from slimlm import models
from slimlm.runtime.llm import LLM
from slimlm.runtime.sampling import SamplingParams

VLLM = r"""
import json, os, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], max_model_len=int(sys.argv[3]), enable_prefix_caching=False, seed=0)
print("@ready", flush=True)  # vLLM logs to stdout too: answers start with @
for line in sys.stdin:  # one JSON list of prompts (token ids) and a token count per turn
    prompts, tokens = json.loads(line)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    print(f"@{time.perf_counter() - start}", flush=True)
"""


class VllmWorker:
    """vLLM's LLM in its own venv, loaded once; generate() answers the seconds one call took."""

    def __init__(self, python: str, model: Path, dtype: str, max_len: int, threads: int) -> None:
        cores = sorted(os.sched_getaffinity(0))[:threads]
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default takes a share of the machine's memory
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        }
        cmd = [python, "-c", VLLM, str(model), dtype, str(max_len)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._answer()  # "ready"

    def _answer(self) -> str:
        for line in self.proc.stdout:
            if line.startswith("@"):
                return line[1:].strip()
            print(line, end="", file=sys.stderr)  # vLLM's log lines
        sys.exit(f"vLLM's worker stopped (exit {self.proc.wait()}); its stderr is above")

    def generate(self, prompts: list[list[int]], tokens: int) -> float:
        self.proc.stdin.write(json.dumps([prompts, tokens]) + "\n")
        self.proc.stdin.flush()
        return float(self._answer())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def slimlm_generate(llm: LLM):
    def generate(prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    return generate


def decode_tok_s(generate, prompts: list[list[int]], steps: int) -> float:
    """New tokens per second past the prompt: (t(1 + steps) - t(1)) spread over batch × steps tokens."""
    prefill = generate(prompts, 1)
    return len(prompts) * steps / (generate(prompts, 1 + steps) - prefill)


def w4_checkpoint(work: Path, model: str) -> Path:
    out = work / f"{model}-rtn-w4g64-floathead"
    if not (out / "config.json").exists():
        compress = shutil.which("compress") or str(Path(sys.executable).with_name("compress"))
        flags = ["--bits", "4", "--group-size", "64", "--float-lm-head"]
        subprocess.run([compress, "rtn", "--model", model, *flags, "--out", str(out), "--overwrite"], check=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="python of the venv vLLM's CPU build is installed in")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="activation dtypes of the float model")
    parser.add_argument("--w4", action="store_true", help="also RTN W4 g64 (float head) at bfloat16")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each system; the best of each is kept")
    parser.add_argument("--work", default="out/vs_vllm", help="where the W4 checkpoint is made")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    prompts = {b: [[rng.randrange(100, 20000) for _ in range(args.prompt)] for _ in range(b)] for b in batches}
    float_dir = models.resolve(args.model)
    cases = [(f"float {d}", float_dir, d) for d in args.dtypes.split(",")]
    if args.w4:
        cases.append(("W4 g64 bfloat16", w4_checkpoint(Path(args.work), args.model), "bfloat16"))
    march = os.environ.get("SLIMLM_CPU_MARCH", "native")
    print(
        f"{args.model}: {platform.processor() or platform.machine()}, slimlm's kernels -march={march}, torch "
        f"{torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads; "
        f"{args.prompt}-token prompts, {args.steps} decode steps, best of {args.rounds} alternating rounds",
        flush=True,
    )
    max_len = args.prompt + args.steps + 8
    results = []
    for label, path, dtype in cases:
        vllm = VllmWorker(args.vllm_python, path, dtype, max_len, args.threads)
        ours = LLM(str(path), dtype=dtype, prefix_caching=False, max_model_len=max_len)
        print(f"{label}: slimlm runs {ours.engine.arithmetic()}", flush=True)
        best = {"vllm": dict.fromkeys(batches, 0.0), "slimlm": dict.fromkeys(batches, 0.0)}
        for gen in (vllm.generate, slimlm_generate(ours)):
            gen(prompts[batches[0]], 2)  # warm-up: first-call costs
        for _ in range(args.rounds):
            for side, gen in (("vllm", vllm.generate), ("slimlm", slimlm_generate(ours))):
                for b in batches:
                    best[side][b] = max(best[side][b], decode_tok_s(gen, prompts[b], args.steps))
        vllm.close()
        del ours
        results.append({"case": label, "dtype": dtype, **best})
    print(f"{'checkpoint':<20}{'batch':>6}{'vLLM tok/s':>12}{'slimlm tok/s':>14}{'slimlm÷vLLM':>13}")
    for r in results:
        for b in batches:
            v, s = r["vllm"][b], r["slimlm"][b]
            print(f"{r['case']:<20}{b:>6}{v:>12.1f}{s:>14.1f}{s / v:>12.2f}×")
    if args.json:
        meta = {"model": args.model, "march": march, "capability": torch.backends.cpu.get_cpu_capability()}
        run = {**meta, "threads": args.threads, "prompt": args.prompt, "steps": args.steps, "results": results}
        Path(args.json).write_text(json.dumps(run, indent=1))


if __name__ == "__main__":
    main()
