"""KV-cache quantization on the default model, through the runtime, every baseline measured in the same run.

quality   wiki perplexity (and optionally the task pack) for KV float32 / bfloat16, fp8 with scale 1
          (uncalibrated, what vLLM does without scales), and checkpoints from `compress kv` (defaults:
          128 owt windows of 512): fp8 and int8, per layer ("tensor") and per KV head ("attn_head"); int4
          with the key offsets measured at load, and with the fp8 checkpoint's calibrated ones
capacity  one KV memory budget: how many sequences of a fixed context it holds, and the output
          throughput of a Poisson workload of long prompts under it (preemptions counted)
int4      the 4-bit variants the int4 cache was chosen from, simulated: K and V rounded as each variant
          would (rotation or not, symmetric or not, per-channel key smoothing, groups along the head dimension)
          and written back into a float32 cache, so attention reads exactly what that cache would hold; wiki
          perplexity against float32 KV, and the bytes per element (capacity against 8-bit KV), on
          --int4-models
decode    one decode step at context 4096, batch 1 and 8, with the cache filled (every KV dtype, int4
          included), the model in --dtype (float32; bfloat16 runs the bf16 paths: tile-unit scores, the bf16
          dot product over 8-bit values), against the floor: (weight bytes + KV bytes read) / the bandwidth
          of a large copy measured in the same run

  .venv/bin/python benchmarks/kv_cache.py [--parts quality,capacity,decode] [--json out/kv.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from serve_vs_hf import copy_bandwidth  # noqa: E402

MODEL = "smollm2-135m"
CHECKPOINTS = {
    "fp8 tensor": ("fp8", "tensor"),
    "fp8 attn_head": ("fp8", "attn_head"),
    "int8 tensor": ("int8", "tensor"),
    "int8 attn_head": ("int8", "attn_head"),
}


def checkpoint(label: str, cache: Path) -> str:
    """`compress kv` with its defaults, made once per cache directory."""
    from slimlm.compress.job import Quantization, quantize_weights
    from slimlm.compress.kv import KVCache

    kv_dtype, strategy = CHECKPOINTS[label]
    out = cache / f"kv-{kv_dtype}-{strategy}"
    if not (out / "slimlm.json").exists():
        quantize_weights(
            Quantization("kv", [KVCache(kv_dtype, strategy)], None, MODEL, out, report_error=False, overwrite=True)
        )
    return str(out)


def quality(args) -> list[dict]:
    from slimlm.eval import harness
    from slimlm.eval.perplexity import engine_for, perplexity

    spec = args.quality_model  # the 8-bit checkpoints are the default model's
    wanted = args.quality_kv.split(",") if args.quality_kv else None
    configs = [("float32 KV", spec, "float32"), ("bfloat16 KV", spec, "bfloat16"), ("fp8 scale 1", spec, "fp8")]
    configs += [(label, "", "auto") for label in CHECKPOINTS] + [("int4", spec, "int4")]
    configs += [("int4 calibrated offsets", "", "int4")]  # compress kv's mean keys, not the load-time text's
    configs = [
        (label, model or checkpoint(label if label in CHECKPOINTS else "fp8 tensor", args.cache), kv)
        for label, model, kv in configs
        if wanted is None or label in wanted
    ]
    rows = []
    for label, model, kv_dtype in configs:
        engine = engine_for(model, 512, kv_cache_dtype=kv_dtype, dtype=args.quality_dtype)
        ppl = perplexity(engine, "wiki", 512, args.ppl_tokens, progress=False)["perplexity"]
        del engine
        row = {"kv": label, "kv_cache_dtype": kv_dtype, "model": model, "wiki_ppl": ppl}
        if args.tasks_limit and label in args.tasks_kv.split(","):
            results = harness.evaluate(model, ["slimlm_tasks"], limit=args.tasks_limit, kv_cache_dtype=kv_dtype)
            accs = [
                r.get("acc_norm,none", r.get("acc,none")) for t, r in results["results"].items() if t != "slimlm_tasks"
            ]
            row["task_avg"] = 100 * sum(accs) / len(accs)
        rows.append(row)
        base = rows[0]
        extra = (
            f", tasks {row['task_avg']:.2f} ({row['task_avg'] / base['task_avg']:.1%} of float)"
            if "task_avg" in row
            else ""
        )
        print(f"{label:16} wiki ppl {ppl:8.4f} ({ppl / base['wiki_ppl'] - 1:+.2%}){extra}", flush=True)
    return rows


def fake_int4(x: torch.Tensor, symmetric: bool, int_zero: bool = False) -> torch.Tensor:
    """x [..., D] rounded to 4 bits per row: one fp16 scale per row, and when asymmetric an fp16 minimum or
    (int_zero) a 4-bit integer zero point."""
    if symmetric:
        step = (x.abs().amax(-1, keepdim=True) / 7).half().float().clamp_min(1e-8)
        return (x / step).round_().clamp_(-7, 7).mul_(step)
    lo, hi = x.amin(-1, keepdim=True).half().float(), x.amax(-1, keepdim=True).half().float()
    step = ((hi - lo) / 15).half().float().clamp_min(1e-8)
    if int_zero:
        zero = (-lo / step).round_().clamp_(0, 15)
        return ((x / step).round_() + zero).clamp_(0, 15).sub_(zero).mul_(step)
    return ((x - lo) / step).round_().clamp_(0, 15).mul_(step).add_(lo)


@dataclass(frozen=True)
class Int4:
    """One way to round K and V to 4 bits (see int4())."""

    rotate: bool = False  # a randomized Hadamard rotation of each head's vector first
    symmetric: bool = False
    smooth: float | None = None  # divide key channels by amax_c ** smooth first (the query takes the factor)
    center: bool = False  # subtract each key channel's calibrated mean first (softmax is blind to it)
    center_v: bool = False  # values too: rounded less their channels' mean, which the output gets back
    group: int | None = None  # values per scale along the head dimension (None: the whole head)
    int_zero: bool = False  # asymmetric with a 4-bit integer zero point instead of an fp16 minimum
    which: str = "kv"  # round keys, values or both

    def bytes_per_element(self, head_dim: int) -> float:
        meta = 2 if self.symmetric else 3 if self.int_zero else 4
        return 0.5 + meta / (self.group or head_dim)


INT4_VARIANTS = {
    "asym": Int4(),
    "asym g32": Int4(group=32),
    "sym": Int4(symmetric=True),
    "sym + H": Int4(rotate=True, symmetric=True),
    "asym + H": Int4(rotate=True),
    "asym-intzero + H": Int4(rotate=True, int_zero=True),
    "sym + K chan^0.5": Int4(symmetric=True, smooth=0.5),
    "sym + K chan^1": Int4(symmetric=True, smooth=1.0),
    "sym + H + K chan^0.5": Int4(rotate=True, symmetric=True, smooth=0.5),
    "asym + H + K chan^0.5": Int4(rotate=True, smooth=0.5),
    "asym + H + K centered": Int4(rotate=True, center=True),
    "sym + H + K centered": Int4(rotate=True, symmetric=True, center=True),
    "asym + K centered": Int4(center=True),
    "asym + H + K+V centered": Int4(rotate=True, center=True, center_v=True),
    "sym + H + K+V centered": Int4(rotate=True, symmetric=True, center=True, center_v=True),
    "asym + H on K only": Int4(rotate=True, which="k"),
    "asym + H on V only": Int4(rotate=True, which="v"),
}


def int4(args) -> list[dict]:
    """Each 4-bit variant, simulated: what an int4 cache would return (codes times scales, rotated back) is
    written into a float32 cache at the write, so the runtime's attention reads exactly those values. The
    rotation H is orthonormal: storing H·k and rotating the query by H leaves q·k unchanged, so rotating back at
    the write is the same attention. Per-channel key smoothing divides each key channel by amax_c^alpha (amax
    observed on --calib after RoPE; the query would take the factor) before the per-token rounding; centering
    subtracts each key channel's mean on --calib (after RoPE), which no softmax can see."""
    from slimlm.eval.perplexity import engine_for, perplexity
    from slimlm.formats import kv_int4
    from slimlm.kernels import reference

    def write(layer: int, variant: Int4 | None, amax: dict, observe: bool = False):
        """Attention layer `layer`'s K/V write: as it is (variant None), observing key amax, or rounded."""

        def rounded(x: torch.Tensor, rotation, factor=None) -> torch.Tensor:
            x = x if factor is None else x / factor
            x = x if rotation is None else x @ rotation
            rows = x.unflatten(-1, (-1, variant.group)) if variant.group else x
            x = fake_int4(rows, variant.symmetric, variant.int_zero).reshape(x.shape)
            x = x if rotation is None else x @ rotation.T
            return x if factor is None else x * factor

        def rotary_kv_write(qkv, cos, signed_sin, slots, k_cache, v_cache, k_scale=None, v_scale=None, k_offset=None):
            kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
            q, k, v = (
                qkv.float()
                .reshape(qkv.shape[0], -1, dim)
                .split([qkv.shape[1] // dim - 2 * kv_heads, kv_heads, kv_heads], 1)
            )
            cos, signed_sin = cos.float()[:, None], signed_sin.float()[:, None]
            k = reference.rotate(k, cos, signed_sin)
            if observe:  # per key channel: the largest |k|, and the sum and count for the mean
                amax[layer] = torch.maximum(amax.get(layer, torch.zeros(kv_heads, dim)), k.abs().amax(0))
                amax[("sum", layer)] = amax.get(("sum", layer), 0) + k.double().sum(0)
                amax[("count", layer)] = amax.get(("count", layer), 0) + k.shape[0]
                amax[("vsum", layer)] = amax.get(("vsum", layer), 0) + v.double().sum(0)
            if variant is not None:
                rotation = kv_int4.rotation(dim) if variant.rotate else None  # the cache's own H
                factor = None if variant.smooth is None else amax[layer].clamp_min(1e-6) ** variant.smooth
                if variant.center:  # q·(k − μ) = q·k − q·μ: the same shift for every key of a query
                    k = k - (amax[("sum", layer)] / amax[("count", layer)]).float()
                k = rounded(k, rotation, factor) if "k" in variant.which else k
                mean_v = (amax[("vsum", layer)] / amax[("count", layer)]).float() if variant.center_v else 0
                v = rounded(v - mean_v, rotation) + mean_v if "v" in variant.which else v
            k_cache.view(-1, kv_heads, dim)[slots] = k.to(k_cache.dtype)
            v_cache.view(-1, kv_heads, dim)[slots] = v.to(v_cache.dtype)
            return reference.rotate(q, cos, signed_sin).to(qkv.dtype)

        return rotary_kv_write

    def perplexity_with(
        model: str, variant: Int4 | None, amax: dict, source="wiki", tokens=None, observe=False
    ) -> float:
        engine = engine_for(model, 512, kv_cache_dtype="float32", dtype=args.int4_dtype)
        for i, layer in enumerate(engine.runner.model.model.layers):
            layer.self_attn.rotary_kv_write = write(i, variant, amax, observe)
        return perplexity(engine, source, 512, tokens or args.ppl_tokens, progress=False)["perplexity"]

    rows = []
    for model in args.int4_models.split(","):
        amax: dict = {}
        perplexity_with(model, None, amax, args.calib, args.calib_tokens, observe=True)  # key amax per channel
        head_dim = amax[0].shape[-1]
        base = perplexity_with(model, None, amax)
        rows.append({"model": model, "kv": "float32", "wiki_ppl": base, "bytes_per_element": 4.0})
        print(f"{model}: float32 KV wiki ppl {base:.4f}", flush=True)
        for name in args.int4_variants.split(","):
            variant = INT4_VARIANTS[name]
            if variant.group is not None and variant.group >= head_dim:
                continue
            ppl = perplexity_with(model, variant, amax)
            per_element = variant.bytes_per_element(head_dim)
            rows.append(
                {
                    "model": model,
                    "kv": f"int4 {name}",
                    "wiki_ppl": ppl,
                    "bytes_per_element": per_element,
                    "capacity_vs_8bit": 1 / per_element,
                }
            )
            print(
                f"  int4 {name:22} wiki ppl {ppl:8.4f} ({ppl / base - 1:+.2%}), {per_element:.3f} bytes/element, "
                f"capacity {1 / per_element:.2f}x of 8-bit KV",
                flush=True,
            )
    return rows


def _workload(args, tokenizer) -> list[dict]:
    from slimlm.data import passages, token_stream

    rng = random.Random(0)
    stream = token_stream(passages("owt"), tokenizer, max_tokens=40_000)
    t, out = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        start = rng.randrange(0, len(stream) - args.prompt_len)
        out.append({"id": f"r{i}", "arrival": t, "prompt": stream[start : start + args.prompt_len]})
    return out


def capacity(args) -> list[dict]:
    configs = [
        ("float32 KV", MODEL, "float32"),
        ("bfloat16 KV", MODEL, "bfloat16"),
        ("int8 attn_head", checkpoint("int8 attn_head", args.cache), "auto"),
        ("int4", MODEL, "int4"),
    ]
    return [serve_under_budget(label, model, kv_dtype, args) for label, model, kv_dtype in configs]


def serve_under_budget(label: str, model: str, kv_dtype: str, args) -> dict:
    """How many sequences of prompt_len + output_len one KV budget holds, and the output throughput of the
    Poisson workload under it (peak running sequences and preemptions counted)."""
    from slimlm.runtime.engine import Engine, EngineConfig
    from slimlm.runtime.sampling import SamplingParams

    context = args.prompt_len + args.output_len
    engine = Engine(
        model,
        EngineConfig(
            kv_cache_memory=args.budget << 20,
            kv_cache_dtype=kv_dtype,
            max_model_len=context,
            max_num_batched_tokens=512,
        ),
    )
    fits = engine.capacity // (-(-context // engine.config.block_size) * engine.config.block_size)
    pending = _workload(args, engine.tokenizer)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    start, peak, tokens, seqs = time.perf_counter(), 0, 0, []
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0]["arrival"] <= now:
            r = pending.pop(0)
            engine.add_request(r["prompt"], params, r["id"])
            seqs += engine.requests[r["id"]].seqs
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0]["arrival"] - now))
            continue
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        peak = max(peak, engine.stats().running)
    wall = time.perf_counter() - start
    preempted = sum(s.num_preemptions for s in seqs)
    row = {
        "kv": label,
        "budget_mib": args.budget,
        "kv_bytes_per_token": engine.runner.kv_bytes_per_token,
        "tokens_held": engine.capacity,
        "sequences_fit": fits,
        "peak_running": peak,
        "preemptions": preempted,
        "output_tok_s": tokens / wall,
        "wall_s": wall,
    }
    print(
        f"{label:16} {engine.capacity:6} tokens in {args.budget} MiB -> {fits:2} sequences of {context}; "
        f"Poisson: peak {peak} running, {preempted} preemptions, {tokens / wall:6.1f} output tok/s "
        f"({wall:.0f} s)",
        flush=True,
    )
    return row


def decode(args) -> list[dict]:
    from slimlm.runtime.engine import Engine, EngineConfig
    from slimlm.runtime.model import StepInputs

    bandwidth = copy_bandwidth()
    rows = []

    def made(label: str) -> str:  # a compress kv checkpoint, made only when its row is asked for
        return checkpoint(label, args.cache) if not args.decode_kv or label in args.decode_kv.split(",") else ""

    configs = [
        ("bfloat16 KV", MODEL, "bfloat16"),
        ("fp8 tensor", made("fp8 tensor"), "auto"),
        ("int8 attn_head", made("int8 attn_head"), "auto"),
        ("int4", MODEL, "int4"),
    ]
    if args.dtype == "float32":  # a bf16 model's cache is never wider than its activations
        configs.insert(0, ("float32 KV", MODEL, "float32"))
    for label, model, kv_dtype in configs:
        if args.decode_kv and label not in args.decode_kv.split(","):
            continue
        for batch in (1, 8):
            ctx = args.context
            probe = Engine(
                model,
                EngineConfig(dtype=args.dtype, kv_cache_dtype=kv_dtype, kv_cache_memory=1 << 20, max_model_len=16),
            )
            per_token = probe.runner.kv_bytes_per_token
            del probe
            engine = Engine(
                model,
                EngineConfig(
                    dtype=args.dtype,
                    kv_cache_dtype=kv_dtype,
                    kv_cache_memory=batch * ctx * per_token + (16 << 20),
                    max_model_len=ctx + 16,
                ),
            )
            runner, bs = engine.runner, engine.config.block_size
            cache = runner.kv_cache
            if cache.dtype == torch.uint8:  # 4-bit rows: any codes, fp16 steps and minima below 1 (bytes < 60)
                cache.random_(0, 60)
            elif cache.dtype.itemsize == 1:  # random finite bytes: fp8 codes below its NaN pattern, int8 anything
                cache.view(torch.uint8).random_(0, 120)
            else:
                cache.normal_()
            blocks = torch.arange(batch * (ctx // bs), dtype=torch.int32).view(batch, -1)
            step = StepInputs(
                positions=torch.full((batch,), ctx - 1),
                slots=blocks[:, -1].long() * bs + bs - 1,
                block_tables=blocks,
                seq_lens=torch.full((batch,), ctx, dtype=torch.int32),
                query_start=torch.arange(batch + 1, dtype=torch.int32),
                query_lens=[1] * batch,
            )
            ids = torch.randint(0, 1000, (batch,))
            times = []
            with torch.inference_mode():
                for _ in range(args.reps + 1):
                    t = time.perf_counter()
                    runner.model.logits(runner.model(ids, step, cache))
                    times.append(time.perf_counter() - t)
            step_s = statistics.median(times[1:])
            moved = runner.weight_bytes() + batch * ctx * per_token
            floor = moved / (bandwidth * 1e9)
            rows.append(
                {
                    "kv": label,
                    "batch": batch,
                    "context": ctx,
                    "step_ms": 1e3 * step_s,
                    "floor_ms": 1e3 * floor,
                    "ratio": step_s / floor,
                    "bytes": moved,
                    "bandwidth_gb_s": bandwidth,
                }
            )
            print(
                f"{label:16} batch {batch}: step {1e3 * step_s:7.1f} ms, floor {1e3 * floor:6.1f} ms "
                f"({step_s / floor:.2f}x), {moved / 1e6:.0f} MB moved",
                flush=True,
            )
            del engine
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="quality,capacity,decode")
    parser.add_argument("--cache", type=Path, default=Path("out/kv-checkpoints"), help="compress kv outputs")
    parser.add_argument("--ppl-tokens", type=int, default=32768)
    parser.add_argument("--tasks-limit", type=int, default=0, help="documents per task-pack task (0: no tasks)")
    parser.add_argument("--tasks-kv", default="float32 KV,fp8 tensor,int8 attn_head", help="configs run on the tasks")
    parser.add_argument("--budget", type=int, default=64, help="KV memory budget for capacity, MiB")
    parser.add_argument("--prompt-len", type=int, default=768)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quality-kv", default="", help="quality rows to run, comma-separated labels (default: all)")
    parser.add_argument("--quality-model", default=MODEL, help="the model of the quality part's float and int4 rows")
    parser.add_argument("--quality-dtype", default="float32", help="the model's dtype in the quality part")
    parser.add_argument("--decode-kv", default="", help="decode rows to run, comma-separated labels (default: all)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's, for decode")
    parser.add_argument("--int4-models", default=MODEL, help="models the int4 variants run on, comma-separated")
    parser.add_argument("--int4-dtype", default="float32", help="the model's dtype in the int4 part")
    parser.add_argument("--int4-variants", default=",".join(INT4_VARIANTS), help="names from INT4_VARIANTS")
    parser.add_argument("--calib", default="owt", help="text the per-channel key amax is observed on (int4)")
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(
        f"{MODEL}, {args.dtype} weights (decode; quality and capacity: float32), {torch.get_num_threads()} threads",
        flush=True,
    )
    run_parts(args, {"quality": quality, "int4": int4, "capacity": capacity, "decode": decode})


def run_parts(args, parts: dict) -> None:
    """Run the parts named in --parts in order; after each, write everything so far to --json (a run
    stopped midway keeps what it measured)."""
    results = {"args": {k: str(v) for k, v in vars(args).items()}}
    for part in args.parts.split(","):
        print(f"\n== {part}", flush=True)
        results[part] = parts[part](args)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
