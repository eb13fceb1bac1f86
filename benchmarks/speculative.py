"""Speculative decoding on the default model: speed and acceptance against plain decoding in the same run,
and the exactness of sampled tokens on the real model.

speed      greedy, input-grounded prompts (repeat / fix / rewrite a given text or code: the chat template of
           SmolLM2-Instruct), at batch 1 (one prompt at a time) and batch 8, for: no speculation; prompt
           lookup with k = 2, 4, 8; a draft model: the cheapest this toolkit makes today, an RTN W4 g64 copy of
           the target (made in the run); with --drafts, other draft models (a pruned and distilled copy from
           benchmarks/prune.py). --systems picks the baselines' proposers. Reports output tok/s and the
           speedup, acceptance (accepted / drafted), mean tokens per target pass, target passes saved, and that
           the tokens are identical. --model picks the target (e.g. a W4 Qwen2.5-1.5B with --drafts
           0.5b=DIR of its W4 0.5B); --code asks for code written from a short description instead
           (nothing to look up: what a draft model alone can predict).
exactness  20,000 draws (batched) of a fixed prompt at temperature 1 and with top-p 0.9, for prompt lookup
           and the draft: the first token against the target's softmax, and the second token (which went
           through verification) against the target's softmax after the most frequent first token, each by
           a chi-square test (p > 0.001).

    .venv/bin/python benchmarks/speculative.py [--parts speed,exactness] [--drafts NAME=DIR] [--json out/spec.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from kv_cache import run_parts  # noqa: E402

from tests.runtime.test_speculative import chi_square_p  # noqa: E402  the same test the CI runs

MODEL = "smollm2-135m"  # the default target; --model replaces it
TASKS = (
    "Repeat the following text exactly, word for word.",
    "Fix the spelling mistakes in this text and return the whole corrected text.",
    "Rewrite this Python code exactly, keeping every line.",
    "Add a docstring to this Python function and return the whole function.",
)
CODE = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts the words in a text file and returns the ten most common.",
    "Write a Python function that performs binary search on a sorted list.",
    "Write a Python function that flattens a nested list of any depth.",
    "Write a Python function that parses a CSV line with quoted fields.",
)


def prompts(tokenizer, n: int, code: bool = False) -> list[list[int]]:
    from slimlm.data import passages

    if code:
        chats = [[{"role": "user", "content": task}] for task in CODE[:n]]
        return [
            tokenizer.encode(
                tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False), add_special_tokens=False
            )
            for c in chats
        ]

    texts = [p for p in passages("owt") if 400 < len(p) < 900][: n // 2]
    code = []
    for path in sorted(Path(__file__).resolve().parents[1].joinpath("slimlm", "runtime").glob("*.py")):
        source = path.read_text()
        start = source.find("\ndef ")
        if start > 0:
            code.append(source[start + 1 : start + 700].rsplit("\n", 1)[0])
    items = [(TASKS[i % 2], t) for i, t in enumerate(texts)] + [(TASKS[2 + i % 2], c) for i, c in enumerate(code)]
    out = []
    for task, body in items[:n]:
        messages = [{"role": "user", "content": f"{task}\n\n{body}"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def draft_model(cache: Path, model: str) -> str:
    from slimlm.compress.job import Quantization, quantize_weights
    from slimlm.compress.rtn import RTN
    from slimlm.formats.quantized import QuantArgs

    out = cache / f"draft-rtn-w4g64-{Path(model).name}"
    if not (out / "slimlm.json").exists():
        args = QuantArgs(4, 64, True)
        quantize_weights(Quantization("rtn", [RTN(args)], args, model, out, report_error=False, overwrite=True))
    return str(out)


def _run(llm, batch: list[list[int]], params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    return time.perf_counter() - start, [o.outputs[0] for o in outs]


def speed(args) -> list[dict]:
    from slimlm.runtime.llm import LLM
    from slimlm.runtime.sampling import SamplingParams

    systems = [("none", None, 4)]  # the baseline, always
    if "ngram" in args.systems:
        systems += [(f"prompt lookup k={k}", "ngram", k) for k in (2, 4, 8)]
    if "rtn" in args.systems:
        systems.append(("draft RTN W4 k=4", draft_model(args.cache, args.model), 4))
    for entry in filter(None, args.drafts.split(",")):
        name, path = entry.split("=", 1)
        systems += [(f"draft {name} k={k}", path, k) for k in map(int, args.draft_ks.split(","))]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    rows, reference = [], {}
    for name, spec, k in systems:
        llm = LLM(args.model, speculative=spec, num_speculative_tokens=k, max_num_batched_tokens=2048, dtype=args.dtype)
        if not rows:
            print(f"activations: {str(llm.engine.dtype).removeprefix('torch.')} (--dtype {args.dtype})", flush=True)
        batch = prompts(llm.tokenizer, args.prompts, args.code)
        _run(llm, batch[:1], SamplingParams(max_tokens=8, temperature=0))  # warm-up
        for size in (1, 8):
            wall, outs = 0.0, []
            groups = [batch[i : i + size] for i in range(0, len(batch), size)]
            for group in groups:
                seconds, got = _run(llm, group, params)
                wall += seconds
                outs += got
            tokens = sum(len(o.token_ids) for o in outs)
            drafted, accepted = sum(o.num_drafted for o in outs), sum(o.num_accepted for o in outs)
            passes = sum(len(o.token_ids) - 1 for o in outs) - accepted  # decode passes of the target
            ids = [o.token_ids for o in outs]
            reference.setdefault(size, ids)
            base = next((r for r in rows if r["system"] == "none" and r["batch"] == size), None)
            row = {
                "system": name,
                "batch": size,
                "output_tokens": tokens,
                "seconds": wall,
                "tok_s": tokens / wall,
                "speedup": (tokens / wall) / base["tok_s"] if base else 1.0,
                "drafted": drafted,
                "accepted": accepted,
                "acceptance": accepted / drafted if drafted else None,
                "tokens_per_target_pass": (passes + accepted) / passes if passes else None,
                "target_passes_saved": accepted / (passes + accepted) if passes + accepted else 0.0,
                "identical_to_plain": ids == reference[size],
            }
            rows.append(row)
            acc = f"{row['acceptance']:.1%}" if drafted else "-"
            tpp = f"{row['tokens_per_target_pass']:.2f}" if row["tokens_per_target_pass"] else "-"
            print(
                f"{name:20} batch {size}: {row['tok_s']:6.1f} tok/s  {row['speedup']:.2f}x  acceptance {acc:>6}  "
                f"tokens/pass {tpp:>5}  passes saved {row['target_passes_saved']:.1%}  identical "
                f"{row['identical_to_plain']}",
                flush=True,
            )
        del llm
    return rows


def exactness(args) -> list[dict]:
    from slimlm.runtime.llm import LLM
    from slimlm.runtime.sampling import SamplingParams
    from slimlm.runtime.speculative import distributions

    rows = []
    proposers = {"ngram": "prompt lookup", "draft": "draft RTN W4"}
    for key in args.proposers.split(","):
        name, spec = proposers[key], "ngram" if key == "ngram" else draft_model(args.cache, args.model)
        llm = LLM(args.model, speculative=spec, num_speculative_tokens=2, max_num_seqs=256, max_num_batched_tokens=4096)
        prompt = prompts(llm.tokenizer, 1)[0]
        for top_p in (float(t) for t in args.top_ps.split(",")):
            params = [
                SamplingParams(max_tokens=3, temperature=1.0, top_p=top_p, seed=i, ignore_eos=True)
                for i in range(args.draws)
            ]
            start = time.perf_counter()
            outs = [o.outputs[0] for o in llm.generate([prompt] * args.draws, params)]
            seconds = time.perf_counter() - start
            first = torch.tensor([o.token_ids[0] for o in outs])
            top1 = int(first.bincount().argmax())
            second = torch.tensor([o.token_ids[1] for o in outs if o.token_ids[0] == top1])
            q = _target_distributions(args.model, [prompt, prompt + [top1]], params[0], distributions)
            vocab = q.shape[-1]
            p1 = chi_square_p(first.bincount(minlength=vocab).float(), q[0])
            p2 = chi_square_p(second.bincount(minlength=vocab).float(), q[1])
            verified = sum(o.num_drafted > 0 for o in outs)
            row = {
                "proposer": name,
                "top_p": top_p,
                "draws": args.draws,
                "first_token_p": p1,
                "second_token_draws": len(second),
                "second_token_p": p2,
                "verified_second_tokens": verified,
                "seconds": seconds,
                "passed": p1 > 0.001 and p2 > 0.001,
            }
            rows.append(row)
            print(
                f"{name:14} top_p {top_p}: first token p = {p1:.3f}; second token after {top1} "
                f"({len(second)} draws) p = {p2:.3f}; {verified} second tokens verified; {seconds:.0f} s -> "
                f"{'pass' if row['passed'] else 'FAIL'}",
                flush=True,
            )
        del llm
    return rows


def _target_distributions(model_spec: str, contexts: list[list[int]], params, distributions) -> torch.Tensor:
    """The target's next-token distribution after each context, from transformers (an independent forward)."""
    from slimlm import models

    model = models.load(model_spec)[0]
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([c])).logits[:, -1] for c in contexts])
    return distributions(logits, [params] * len(contexts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="speed,exactness")
    parser.add_argument("--model", default=MODEL, help="the target: asset, directory or hub id")
    parser.add_argument("--draft-ks", default="4", help="speed: tokens each --drafts model proposes, e.g. 2,3,4")
    parser.add_argument("--code", action="store_true", help="speed: code-writing prompts, not input-grounded ones")
    parser.add_argument("--cache", type=Path, default=Path("out/spec-checkpoints"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draws", type=int, default=20_000)
    parser.add_argument("--proposers", default="ngram,draft", help="exactness: ngram and/or draft")
    parser.add_argument("--top-ps", default="1.0,0.9", help="exactness: the top-p settings to test")
    parser.add_argument("--systems", default="ngram,rtn", help="speed: proposers besides plain decoding")
    parser.add_argument("--drafts", default="", help="speed: more draft models, NAME=DIR,... (e.g. a pruned one)")
    parser.add_argument("--dtype", default="auto", help="the runtime's activations (auto: bf16 where fast, else fp32)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"{args.model}, {torch.get_num_threads()} threads", flush=True)
    run_parts(args, {"speed": speed, "exactness": exactness})


if __name__ == "__main__":
    main()
