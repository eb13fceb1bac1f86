"""Structured pruning with distillation on the default model, every baseline measured in the same run.

  search   importance once; at each --targets fraction of the parameters, every candidate shape (depth,
           width-mlp, width-heads, width+depth): perplexity right after pruning, and after the same short
           distillation (--search-tokens) for all: width against depth at the same size
  distill  `compress prune --target-params T --candidate C --distill-tokens N` (the library call the command
           makes) with the candidate that was best after the short distillation: the curve on the first
           8192 wiki tokens (training reads owt), the share of the lost perplexity recovered, the minutes
  speed    through the runtime, the unpruned model against each distilled one, interleaved, best of
           --repeats: decode tok/s at batch 1 and 32 (64 new tokens after a short prompt) and prefill tok/s
           (one 512-token prompt); wiki perplexity through the runtime (--ppl-tokens)
  tasks    the task pack (--tasks-limit documents per task) on the unpruned model and each pruned one,
           before and after distillation

The pruned model as a speculative-decoding draft: benchmarks/speculative.py --parts speed --drafts NAME=DIR.

    .venv/bin/python benchmarks/prune.py [--parts search,distill,speed,tasks] [--json out/prune.json]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kv_cache import run_parts  # noqa: E402

MODEL = "smollm2-135m"
MEMO: dict = {}  # what one part hands the next within a run (the JSON holds it across runs)


def _setup(args):
    """The teacher, its tokenizer, the importance scores, the evaluation windows and the teacher's score."""
    from slimlm import data, models
    from slimlm.train import prune
    from slimlm.train.distill import mean_nll
    from slimlm.train.job import EVAL_TOKENS, SCORE_SAMPLES, text_windows

    if "setup" not in MEMO:
        teacher, tokenizer, _ = models.load(MODEL)
        samples = data.calibration_windows("owt", tokenizer, 32 + SCORE_SAMPLES, 512)
        start = time.perf_counter()
        scores = prune.importance(teacher, samples[:32], progress=False)
        print(f"importance on 32 windows: {time.perf_counter() - start:.0f} s", flush=True)
        evaluation = text_windows("wiki", tokenizer, 512, EVAL_TOKENS)
        MEMO["setup"] = (teacher, tokenizer, scores, evaluation, math.exp(mean_nll(teacher, evaluation)))
    return MEMO["setup"]


def _earlier(args) -> dict:
    """Results of an earlier run's parts (--previous), for a run of the later parts alone."""
    return json.loads(args.previous.read_text())


def search(args) -> list[dict]:
    from slimlm.train import prune
    from slimlm.train.distill import TrainConfig, mean_nll, train
    from slimlm.train.job import text_windows

    teacher, tokenizer, scores, evaluation, base = _setup(args)
    windows = text_windows("owt", tokenizer, 512)
    total = prune.count_parameters(teacher, prune.Shape.of(teacher.config))
    print(f"unpruned: {total:,} parameters, eval perplexity {base:.2f}", flush=True)
    rows = []
    for target in args.targets:
        for name, shape in prune.candidates(teacher, target).items():
            student = prune.prune(teacher, prune.select(scores, teacher.config, shape))
            before = math.exp(mean_nll(student, evaluation))
            run_dir = args.cache / f"search-{target}-{name}"
            shutil.rmtree(run_dir, ignore_errors=True)
            config = TrainConfig(train_tokens=args.search_tokens, checkpoint_every=10**9, eval_every=10**9)
            start = time.perf_counter()
            log = train(student, teacher, windows, config, run_dir, progress=False)
            seconds = time.perf_counter() - start
            after = math.exp(mean_nll(student, evaluation))
            shutil.rmtree(run_dir, ignore_errors=True)
            params = prune.count_parameters(teacher, shape)
            rows.append(
                {
                    "target": target,
                    "candidate": name,
                    **asdict(shape),
                    "parameters": params,
                    "fraction": params / total,
                    "eval_ppl_pruned": before,
                    "eval_ppl_distilled": after,
                    "distill_tokens": args.search_tokens,
                    "distill_seconds": seconds,
                    "final_loss": log[-1]["loss"],
                }
            )
            print(
                f"{target:.0%} {name:12} {params / total:6.1%} params  ppl pruned {before:9.1f}  after "
                f"{args.search_tokens} tokens {after:8.1f}  ({seconds:.0f} s)  {shape}",
                flush=True,
            )
    MEMO["search"] = rows
    return rows


def distill(args) -> list[dict]:
    from slimlm.train.distill import TrainConfig
    from slimlm.train.job import Run, prune_model

    *_, base = _setup(args)
    found = MEMO.get("search") or _earlier(args)["search"]
    rows = []
    for target, tokens in zip(args.targets, args.distill_tokens, strict=True):
        here = [r for r in found if r["target"] == target]
        best = min(here, key=lambda r: r["eval_ppl_distilled"])
        out = args.cache / f"pruned-{round(target * 100)}"
        config = TrainConfig(train_tokens=tokens, eval_every=4, checkpoint_every=8)
        start = time.perf_counter()
        prune_model(Run(MODEL, out, train_config=config, overwrite=True), target, candidate=best["candidate"])
        minutes = (time.perf_counter() - start) / 60
        meta = json.loads((out / "slimlm.json").read_text())
        curve = [e for e in meta["training"]["log"] if "eval_ppl" in e]
        start_ppl, end_ppl = curve[0]["eval_ppl"], curve[-1]["eval_ppl"]
        recovered = (start_ppl - end_ppl) / (start_ppl - base)
        rows.append(
            {
                "target": target,
                "candidate": best["candidate"],
                "dir": str(out),
                "minutes": minutes,
                "tokens": tokens,
                "parameters": meta["parameters"],
                "eval_ppl_unpruned": base,
                "curve": [(e["tokens"], e["eval_ppl"]) for e in curve],
                "recovered": recovered,
            }
        )
        print(
            f"{target:.0%} {best['candidate']}: eval ppl {base:.2f} unpruned, {start_ppl:.1f} pruned, "
            f"{end_ppl:.1f} after {tokens} tokens in {minutes:.1f} min: recovered {recovered:.1%} of the loss",
            flush=True,
        )
        shutil.copy(out / "curve.png", args.cache / f"curve-{round(target * 100)}.png")
    MEMO["distill"] = rows
    return rows


def _measure(llm, prompts: list[list[int]], long_prompt: list[int]) -> dict:
    from slimlm.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    one = llm.generate(prompts[:1], params)[0].outputs[0]
    batch1 = (len(one.token_times) - 1) / (one.token_times[-1] - one.token_times[0])
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    batch32 = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    out = llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    prefill = len(long_prompt) / (out.outputs[0].first_token_time - out.arrival)
    return {"decode_b1_tok_s": batch1, "decode_b32_tok_s": batch32, "prefill_tok_s": prefill}


def speed(args) -> list[dict]:
    from slimlm.data import passages
    from slimlm.eval.perplexity import engine_for, perplexity
    from slimlm.runtime.llm import LLM

    found = MEMO.get("distill") or _earlier(args)["distill"]
    systems = {"unpruned": MODEL} | {f"pruned {r['target']:.0%} ({r['candidate']})": r["dir"] for r in found}
    # no prefix caching: the same prompts run again in every repeat, and a cached prompt is not a prefill
    llms = {name: LLM(path, max_num_batched_tokens=2048, prefix_caching=False) for name, path in systems.items()}
    tokenizer = next(iter(llms.values())).tokenizer
    texts = [p for p in passages("owt") if len(p) > 200]
    prompts = [tokenizer.encode(t)[:32] for t in texts[:32]]
    long_prompt = [t for text in texts[32:] for t in tokenizer.encode(text)][:512]
    for llm in llms.values():  # warm-up: the first forward at each shape pays one-time costs
        _measure(llm, prompts[:2], long_prompt[:64])
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            for key, value in _measure(llm, prompts, long_prompt).items():
                best.setdefault(name, {})[key] = max(best.get(name, {}).get(key, 0.0), value)
    rows = []
    for name, path in systems.items():
        ppl = perplexity(engine_for(path, 512), "wiki", 512, args.ppl_tokens, progress=False)["perplexity"]
        row = {"system": name, "dir": path, "wiki_ppl": ppl, **best[name]}
        row.update({f"{k}_ratio": v / best["unpruned"][k] for k, v in best[name].items()})
        rows.append(row)
        print(
            f"{name:28} wiki ppl {ppl:8.2f}  decode b1 {row['decode_b1_tok_s']:6.1f} tok/s "
            f"({row['decode_b1_tok_s_ratio']:.2f}x)  b32 {row['decode_b32_tok_s']:6.1f} "
            f"({row['decode_b32_tok_s_ratio']:.2f}x)  prefill {row['prefill_tok_s']:6.0f} "
            f"({row['prefill_tok_s_ratio']:.2f}x)",
            flush=True,
        )
    return rows


def tasks(args) -> list[dict]:
    """The task pack (acc_norm where a task has it, else acc; --tasks-limit documents each) on the unpruned
    model, each pruned one before distillation and after it."""
    from slimlm.eval.harness import evaluate
    from slimlm.train.job import Run, prune_model

    found = MEMO.get("distill") or _earlier(args)["distill"]
    systems = {"unpruned": MODEL}
    for r in found:
        raw = args.cache / f"pruned-{round(r['target'] * 100)}-undistilled"
        if not (raw / "slimlm.json").exists():
            prune_model(Run(MODEL, raw, overwrite=True, progress=False), r["target"], candidate=r["candidate"])
        systems[f"{r['target']:.0%} pruned"] = str(raw)
        systems[f"{r['target']:.0%} distilled"] = r["dir"]
    rows = []
    for name, path in systems.items():
        results = evaluate(path, ["slimlm_tasks"], limit=args.tasks_limit)["results"]
        scores = {}
        for task, metrics in results.items():
            key = "acc_norm,none" if "acc_norm,none" in metrics else "acc,none"
            if key in metrics and task != "slimlm_tasks":
                scores[task.removeprefix("slimlm_")] = metrics[key]
        average = sum(scores.values()) / len(scores)
        rows.append({"system": name, "dir": path, "average": average, **scores})
        print(f"{name:18} average {average:.3f}  " + "  ".join(f"{t} {v:.2f}" for t, v in scores.items()), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="search,distill,speed,tasks")
    parser.add_argument("--targets", type=lambda s: [float(t) for t in s.split(",")], default=[0.6, 0.4])
    parser.add_argument("--search-tokens", type=int, default=16384, help="short distillation of every candidate")
    parser.add_argument(
        "--distill-tokens",
        type=lambda s: [int(t) for t in s.split(",")],
        default=[131072, 65536],
        help="distillation budget per target",
    )
    parser.add_argument("--ppl-tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks-limit", type=int, default=40, help="documents per task-pack task")
    parser.add_argument("--cache", type=Path, default=Path("out/prune"), help="pruned checkpoints and curves")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--previous", type=Path, help="JSON of an earlier run whose search/distill to use")
    args = parser.parse_args()
    print(f"{MODEL}, fp32 weights, {torch.get_num_threads()} threads", flush=True)
    run_parts(args, {"search": search, "distill": distill, "speed": speed, "tasks": tasks})


if __name__ == "__main__":
    main()
