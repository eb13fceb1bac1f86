"""The decode step (or a prompt step) of two or more git revisions, whole trees (Python and C kernels), taking
turns in one run.

kernels_ab.py swaps only the C kernels under the working tree's Python, which cannot compare revisions whose
Python calls the kernels differently. Here each revision is checked out into its own worktree and times the
decode step in a subprocess of its own; the revisions take --rounds turns per batch size and dtype, and each
one's median over its turns is kept, so the ratios come from the same minutes. With --prompt N each of the
batch's sequences adds a chunk of N prompt tokens after its --context cached ones instead of one token (a
prefill step; logits for each sequence's last token only, as the engine asks).

    .venv/bin/python benchmarks/revisions_ab.py out/speed/w4h8 aa63d00 HEAD --batch 1,8,32
    .venv/bin/python benchmarks/revisions_ab.py out/speed/w4h8 HEAD~1 HEAD --batch 1,4 --context 0 --prompt 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STEP = r"""
import json, statistics, sys, time, torch
from slimlm.perf.config import BenchConfig, engine_for
from slimlm.perf.offline import decode_inputs
model, dtype, batch, context, new, seconds, threads = sys.argv[1:8]
batch, context, new, seconds = int(batch), int(context), int(new), float(seconds)
torch.set_num_threads(int(threads))
runner = engine_for(model, BenchConfig(dtype=dtype, batch=[batch], context=context + new), context + new).runner
runner.kv_cache.normal_()
(ids, step), times = decode_inputs(batch, context, runner.block_size, new), []
last = torch.arange(new - 1, batch * new, new)  # each sequence's last token
with torch.inference_mode():
    for _ in range(3):  # warm-up
        runner.model.logits(runner.model(ids, step, runner.kv_cache)[last])
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        start = time.perf_counter()
        runner.model.logits(runner.model(ids, step, runner.kv_cache)[last])
        times.append(time.perf_counter() - start)
print(json.dumps(1e3 * statistics.median(times)))
"""


def worktree(rev: str, where: Path) -> Path:
    path = where / rev.replace("/", "_")
    done = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"revisions_ab.py: cannot check out {rev!r}: {done.stderr.strip().splitlines()[-1]}")
    return path


def step_ms(tree: Path, model: str, dtype: str, batch: int, args) -> float:
    settings = (model, dtype, batch, args.context, args.prompt, args.seconds, args.threads)
    cmd = [sys.executable, "-c", STEP, *map(str, settings)]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    if done.returncode != 0:
        raise SystemExit(f"revisions_ab.py: the step failed in {tree.name}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint directory (absolute, or relative to the repository)")
    parser.add_argument("revs", nargs="+", help="git revisions; ratios are against the first")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=1, help="new tokens per sequence (1: a decode step)")
    parser.add_argument("--seconds", type=float, default=6.0, help="per turn")
    parser.add_argument("--rounds", type=int, default=2, help="turns of every revision per batch size and dtype")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = str((ROOT / args.model).resolve()) if (ROOT / args.model).exists() else args.model
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        try:
            for rev in args.revs:
                trees[rev] = worktree(rev, Path(tmp))
            what = "decode" if args.prompt == 1 else f"prompt chunks of {args.prompt} tokens,"
            print(
                f"{args.model}, {what} context {args.context}, {args.threads} threads; step ms (median of each "
                f"revision's {args.rounds} turns)"
            )
            for dtype in args.dtypes.split(","):
                for batch in map(int, args.batch.split(",")):
                    ms = {rev: [] for rev in trees}
                    for _ in range(args.rounds):
                        for rev, tree in trees.items():
                            ms[rev].append(step_ms(tree, model, dtype, batch, args))
                    med = {rev: statistics.median(v) for rev, v in ms.items()}
                    first = med[args.revs[0]]
                    cells = "  ".join(f"{rev} {m:7.2f} ({first / m:.2f}×)" for rev, m in med.items())
                    print(f"{dtype:9s} batch {batch:3d}  {cells}", flush=True)
        finally:
            for tree in trees.values():
                remove = ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)]
                subprocess.run(remove, capture_output=True)


if __name__ == "__main__":
    main()
