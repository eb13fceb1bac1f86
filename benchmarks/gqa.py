"""GQA conversion and uptraining on the default model, every baseline measured in the same run.

  mha       expand SmolLM2's 3 KV heads to 9 (a true multi-head model: logits checked identical), also with
            the heads shuffled (same function); convert 9 -> 3 by mean pooling of contiguous heads and by
            similarity grouping: wiki perplexity right after conversion, and after a short uptraining
            (--mha-uptrain-tokens) where a grouping lost quality
  mqa       3 -> 1 KV head (similarity grouping), uptrained with --uptrain-tokens (default sized for 20
            minutes on 2 cores here): perplexity before, right after, along the curve and after; the
            share of the lost perplexity that uptraining recovered; the curve as PNG
  capacity  one KV budget at context 2048: sequences held and Poisson throughput, 3 vs 1 KV heads
  precision the mqa uptraining (--precision-tokens) with its passes in fp32 and under bf16 autocast
            (--compute-dtype): wall time and perplexity of each, the ratios (what `auto` picks on a CPU)

Perplexity is `wiki` through the runtime (--ppl-tokens); the curve's points are the first 8192 wiki
tokens scored during training. Training reads `owt`, never the wiki text.

    .venv/bin/python benchmarks/gqa.py [--parts mha,mqa,capacity] [--json out/gqa.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kv_cache import run_parts, serve_under_budget  # noqa: E402

MODEL = "smollm2-135m"


def ppl(model: str, tokens: int) -> float:
    from slimlm.eval.perplexity import engine_for, perplexity

    return perplexity(engine_for(model, 512), "wiki", 512, tokens, progress=False)["perplexity"]


def sizes(model: str) -> dict:
    from slimlm import models

    config = models.read_config(models.resolve(model))
    hd = config["hidden_size"] // config["num_attention_heads"]
    kv_per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * hd * 4  # fp32 cache
    m, _, _ = models.load(model)
    return {
        "kv_heads": config["num_key_value_heads"],
        "parameters": sum(p.numel() for p in m.parameters()),
        "kv_bytes_per_token_fp32": kv_per_token,
    }


def convert(
    out: Path, source: str, kv_heads: int, tokens: int = 0, compute_dtype: str = "auto", **kwargs
) -> tuple[str, float]:
    """`compress gqa` (made once per cache directory); its wall time."""
    from slimlm.train.distill import TrainConfig
    from slimlm.train.job import Run, convert_gqa

    if not (out / "slimlm.json").exists():
        start = time.perf_counter()
        config = None
        if tokens:
            config = TrainConfig(train_tokens=tokens, checkpoint_every=10**9, eval_every=8, compute_dtype=compute_dtype)
        convert_gqa(Run(source, out, train_config=config, overwrite=True), kv_heads, **kwargs)
        (out / "wall.txt").write_text(f"{time.perf_counter() - start:.1f}")
    return str(out), float((out / "wall.txt").read_text())


def mha(args) -> list[dict]:
    """SmolLM2's expansion puts each head's copies side by side, where contiguous mean pooling is exact too;
    shuffling the heads (with their queries: the same function) is the case that tells groupings apart."""
    from slimlm import models
    from slimlm.train import gqa

    mha_dir, _ = convert(args.cache / "mha9", MODEL, 9, expand=True)
    shuffled = args.cache / "mha9-shuffled"
    a, b = models.load(MODEL)[0], models.load(mha_dir)[0]
    if not (shuffled / "config.json").exists():
        rng = torch.Generator().manual_seed(0)
        gqa.permute_kv_heads(b, [torch.randperm(9, generator=rng).tolist() for _ in b.model.layers])
        b.save_pretrained(shuffled)
        models.load_tokenizer(models.resolve(MODEL)).save_pretrained(shuffled)
    c = models.load(str(shuffled))[0]
    x = torch.randint(0, a.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diffs = [(a(x).logits - m(x).logits).abs().max().item() for m in (models.load(mha_dir)[0], c)]
    print(f"3 -> 9 KV heads: max |logit difference| {diffs[0]:.2e} (copies adjacent), {diffs[1]:.2e} (shuffled)")
    base = ppl(mha_dir, args.ppl_tokens)
    rows = [{"model": "MHA (9 KV, expanded)", "wiki_ppl": base, "logit_max_diff": diffs, **sizes(mha_dir)}]
    print(f"{rows[0]['model']:40} wiki ppl {base:.4f}", flush=True)
    cases = [
        ("adjacent", mha_dir, "mean", 0),
        ("adjacent", mha_dir, "similarity", 0),
        ("shuffled", str(shuffled), "mean", 0),
        ("shuffled", str(shuffled), "similarity", 0),
        ("shuffled", str(shuffled), "mean", args.mha_uptrain_tokens),
    ]
    for heads, source, grouping, tokens in cases:
        label = f"9 -> 3 {grouping}, {heads}" + (f", uptrained {tokens // 1024}K" if tokens else "")
        out, wall = convert(args.cache / f"gqa3-{heads}-{grouping}-{tokens}", source, 3, tokens, grouping=grouping)
        value = ppl(out, args.ppl_tokens)
        rows.append(
            {
                "model": label,
                "heads": heads,
                "grouping": grouping,
                "uptrain_tokens": tokens,
                "wiki_ppl": value,
                "seconds": wall,
                **sizes(out),
            }
        )
        print(f"{label:40} wiki ppl {value:.4f} ({value / base - 1:+.2%}) [{wall:.0f} s]", flush=True)
    by = {(r.get("heads"), r.get("grouping"), r.get("uptrain_tokens")): r["wiki_ppl"] for r in rows}
    met = all(by[(h, "similarity", 0)] <= by[(h, "mean", 0)] * 1.0001 for h in ("adjacent", "shuffled"))
    print(
        f"target: similarity grouping loses no more than mean pooling right after conversion -> "
        f"{'met' if met else 'missed'}",
        flush=True,
    )
    return rows


def mqa(args) -> list[dict]:
    base = ppl(MODEL, args.ppl_tokens)
    converted, _ = convert(args.cache / "mqa-0", MODEL, 1)
    lost = ppl(converted, args.ppl_tokens)
    trained, wall = convert(args.cache / f"mqa-{args.uptrain_tokens}", MODEL, 1, args.uptrain_tokens)
    after = ppl(trained, args.ppl_tokens)
    recovered = (lost - after) / (lost - base) if lost > base else float("nan")
    curve = [json.loads(line) for line in (Path(trained) / "log.jsonl").read_text().splitlines()]
    rows = [
        {"model": "SmolLM2 (3 KV)", "wiki_ppl": base, **sizes(MODEL)},
        {"model": "MQA (1 KV), converted", "wiki_ppl": lost, **sizes(converted)},
        {
            "model": f"MQA, uptrained {args.uptrain_tokens} tokens",
            "wiki_ppl": after,
            "train_seconds": wall,
            "recovered": recovered,
            "curve": [{k: e[k] for k in ("tokens", "eval_ppl") if k in e} for e in curve if "eval_ppl" in e],
            **sizes(trained),
        },
    ]
    for r in rows:
        print(
            f"{r['model']:34} wiki ppl {r['wiki_ppl']:.4f} ({r['wiki_ppl'] / base - 1:+.2%}), "
            f"{r['kv_bytes_per_token_fp32'] / 1e3:.1f} kB KV/token",
            flush=True,
        )
    points = ", ".join(f"{c['tokens']}: {c['eval_ppl']:.2f}" for c in rows[-1]["curve"])
    print(f"curve (training tokens -> eval ppl): {points}", flush=True)
    verdict = "met" if recovered >= 0.5 and wall <= 20 * 60 else "missed"
    print(
        f"target: uptraining recovers >= 50% of the lost perplexity within 20 minutes: {recovered:.0%} in "
        f"{wall / 60:.1f} min -> {verdict}",
        flush=True,
    )
    if args.curve_png:
        shutil.copy(Path(trained) / "curve.png", args.curve_png)
    return rows


def precision(args) -> list[dict]:
    tokens, rows = args.precision_tokens, []
    for dtype in ("float32", "bfloat16"):
        out, wall = convert(args.cache / f"mqa-{tokens}-{dtype}", MODEL, 1, tokens, compute_dtype=dtype)
        rows.append({"model": f"MQA, uptrained {tokens} tokens, {dtype} passes", "wiki_ppl": ppl(out, args.ppl_tokens)})
        rows[-1]["train_seconds"] = wall
        print(f"{rows[-1]['model']:48} wiki ppl {rows[-1]['wiki_ppl']:.2f} [{wall:.0f} s]", flush=True)
    fp32, bf16 = rows
    print(
        f"bf16 autocast against fp32 passes: {fp32['train_seconds'] / bf16['train_seconds']:.2f}x the speed, "
        f"{bf16['wiki_ppl'] / fp32['wiki_ppl']:.2f}x the perplexity",
        flush=True,
    )
    return rows


def capacity(args) -> list[dict]:
    mqa_dir, _ = convert(args.cache / "mqa-0", MODEL, 1)
    rows = [
        serve_under_budget(label, model, "float32", args)
        for label, model in (("3 KV heads", MODEL), ("1 KV head (MQA)", mqa_dir))
    ]
    ratio = rows[1]["sequences_fit"] / rows[0]["sequences_fit"]
    speed = rows[1]["output_tok_s"] / rows[0]["output_tok_s"]
    print(
        f"target: 3x the sequences at one budget: {ratio:.2f}x -> {'met' if ratio >= 3 else 'missed'}; "
        f"Poisson throughput {speed:.2f}x",
        flush=True,
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="mha,mqa,capacity,precision")
    parser.add_argument("--cache", type=Path, default=Path("out/gqa-checkpoints"))
    parser.add_argument("--ppl-tokens", type=int, default=16384)
    parser.add_argument("--uptrain-tokens", type=int, default=65536)
    parser.add_argument("--mha-uptrain-tokens", type=int, default=16384)
    parser.add_argument("--precision-tokens", type=int, default=32768)
    parser.add_argument("--curve-png", type=Path, help="copy the MQA uptraining curve here")
    parser.add_argument("--budget", type=int, default=192, help="KV memory budget for capacity, MiB")
    parser.add_argument("--prompt-len", type=int, default=1984)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"{MODEL}, fp32, {torch.get_num_threads()} threads", flush=True)
    run_parts(args, {"mha": mha, "mqa": mqa, "capacity": capacity, "precision": precision})


if __name__ == "__main__":
    main()
