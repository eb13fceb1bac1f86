"""`compress plan`: the capacity and bandwidth model. What a model's weights and KV cache weigh, what fits
in a memory budget, and how fast a decode step can be when moving those bytes is all it does.

Symbols: V vocabulary, D hidden size, N query heads and K KV heads of dimension H, F MLP width, L layers,
b bytes per KV element, S a sequence's context, B sequences per step, β memory bandwidth.
- parameters: the exact count (embeddings, q/k/v/o with their biases, the gated MLP, the norms, an untied
  head), next to the simplified P = 2VD + 3DFL + (2DNH + 2DKH)L;
- weight bytes W_b: the decoder's linears at the weight format (bits/8 per weight, a 16-bit scale per
  group of each output row, and a zero point of `bits` bits when asymmetric), everything else in the float
  dtype;
- KV bytes M = 2·b·(ΣS)·L·K·H; per sequence C_b = 2·b·S·L·K·H, where S is the tokens a sequence keeps: its
  context, or at most a KV policy's budget (window, snapkv: runtime.kv_policy);
- a decode step that only moves bytes: τ = (W_b + B·C_b)/β, throughput B/τ (W_b here: what a step reads,
  all weights but an untied embedding table, of which it reads B rows);
- arithmetic intensity (FLOPs per byte moved): the linear layers do 2 FLOPs per weight per token, so B·T
  tokens over weights of w bytes give 2·B·T/w (≈ B·T at 16 bits); decode attention reads each KV element
  once per query head of its group: 2·(N/K)/b per byte, the S/(S+1) ≈ 1 of multi-head attention at b = 2;
- the roofline crossover peak/β: below it a step is bound by bandwidth, above it by arithmetic (the
  linears' 2·B·(weights) FLOPs at the device's peak; attention's arithmetic is left out).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

from slimlm import arch
from slimlm.errors import SlimlmError
from slimlm.formats import kv_int4, shards

FLOAT_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
KV_BYTES = {**FLOAT_BYTES, "fp8": 1, "int8": 1, "int4": 0.5}  # per element (int4: and its row's scales)


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16 FLOP/s (on a CPU: measured fp32 matmul)
    bandwidth: float  # bytes/s
    memory: float  # bytes


PRESETS = {  # vendors' dense (no sparsity) bf16 peaks and HBM bandwidths
    "h100": Device("H100 SXM", 989e12, 3.35e12, 80e9),
    "h200": Device("H200", 989e12, 4.8e12, 141e9),
    "a100": Device("A100 SXM 80GB", 312e12, 2.039e12, 80e9),
}


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    tied: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: a head_dim-wide RMSNorm weight for q and one for k, per layer

    @classmethod
    def from_config(cls, config: dict) -> Dims:
        heads = config["num_attention_heads"]
        qwen2 = config.get("model_type") == "qwen2"  # q/k/v carry biases, o does not
        return cls(
            vocab=config["vocab_size"],
            hidden=config["hidden_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            ffn=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or bool(config.get("attention_bias")),
            o_bias=not qwen2 and bool(config.get("attention_bias")),
            qk_norm=config.get("model_type") == "qwen3",
        )


MODEL_PRESETS = {  # public configs, for planning models that are not on this machine
    "llama-3.1-8b": Dims(128256, 4096, 32, 8, 128, 14336, 32),
    "llama-3.1-70b": Dims(128256, 8192, 64, 8, 128, 28672, 80),
    "mistral-7b": Dims(32768, 4096, 32, 8, 128, 14336, 32),
    "qwen2.5-7b": Dims(152064, 3584, 28, 4, 128, 18944, 28, qkv_bias=True),
}


def linear_shapes(d: Dims) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linears: q, k, v, o, gate, up, down."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    return [
        (d.hidden, q),
        (d.hidden, kv),
        (d.hidden, kv),
        (q, d.hidden),
        (d.hidden, d.ffn),
        (d.hidden, d.ffn),
        (d.ffn, d.hidden),
    ]


def parameters(d: Dims) -> dict[str, int]:
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    attention = d.layers * (2 * d.hidden * q + 2 * d.hidden * kv + d.qkv_bias * (q + 2 * kv) + d.o_bias * d.hidden)
    v, dh, hd, n, k, f, L = d.vocab, d.hidden, d.head_dim, d.heads, d.kv_heads, d.ffn, d.layers  # noqa: N806
    out = {
        "embeddings": v * dh,
        "lm_head": 0 if d.tied else v * dh,
        "attention": attention,
        "mlp": L * 3 * dh * f,
        "norms": (2 * L + 1) * dh + d.qk_norm * 2 * L * hd,
    }
    out["total"] = sum(out.values())
    out["simplified"] = 2 * v * dh + 3 * dh * f * L + (2 * dh * n * hd + 2 * dh * k * hd) * L
    return out


@dataclass(frozen=True)
class WeightFormat:
    """Float (bits None) at `dtype`, or the linears quantized to `bits` in groups (-1: one per row)."""

    dtype: str = "bfloat16"
    bits: int | None = None
    group_size: int = 128
    sym: bool = True
    # A mixed-precision layout (`--budget`, or a checkpoint of several schemes): the decoder linears' bytes as
    # counted or stored, and what it mixes (e.g. "52 w4g64"); bits etc. then describe its most common scheme.
    linear_bytes: int | None = None
    mix: tuple[str, ...] = ()
    head_bytes: int | None = None  # an untied lm_head a checkpoint stores quantized, as stored

    @classmethod
    def parse(cls, text: str) -> WeightFormat:
        """'bf16', 'fp32', 'w4', 'w4g64', 'w8g-1', 'w4g128-asym' (quantized linears; the rest bf16)."""
        if text in FLOAT_BYTES:
            return cls(dtype=text)
        match = re.fullmatch(r"w(\d+)(?:g(-1|\d+))?(-asym)?", text)
        if not match or int(match[1]) not in (2, 3, 4, 8) or match[2] == "0":
            raise SlimlmError(
                f"use a float dtype ({', '.join(FLOAT_BYTES)}) or wBITS[gGROUP][-asym] with bits "
                f"2/3/4/8 and a group >= 1 (-1: per channel), e.g. w4g128, w8g-1; got "
                f"{text!r}"
            )
        return cls(bits=int(match[1]), group_size=int(match[2] or 128), sym=not match[3])


def _linear_bytes(d: Dims, w: WeightFormat) -> float:
    """The decoder's linears at the weight format, scales and zero points included."""
    if w.linear_bytes is not None:
        return w.linear_bytes
    total = 0.0
    for n_in, n_out in linear_shapes(d):
        if w.bits is None:
            total += n_in * n_out * FLOAT_BYTES[w.dtype]
        else:
            groups = 1 if w.group_size == -1 else -(-n_in // w.group_size)
            total += n_in * n_out * w.bits / 8 + n_out * groups * (2 + (0 if w.sym else w.bits / 8))
    return d.layers * total


def linear_params(d: Dims) -> int:
    """Weights of the decoder layers' linears (2 FLOPs each per token)."""
    return d.layers * sum(i * o for i, o in linear_shapes(d))


def weight_bytes(d: Dims, w: WeightFormat) -> int:
    """What the weights take in memory: the linears at the format, the rest (embeddings, head, norms,
    biases) in the float dtype."""
    p = parameters(d)
    floats = p["total"] - linear_params(d) - (0 if w.head_bytes is None else p["lm_head"])
    return round(_linear_bytes(d, w) + floats * FLOAT_BYTES[w.dtype] + (w.head_bytes or 0))


def read_bytes(d: Dims, w: WeightFormat) -> int:
    """What one decode step reads: all weights but an untied embedding table (only B of its rows)."""
    return weight_bytes(d, w) - (0 if d.tied else d.vocab * d.hidden * FLOAT_BYTES[w.dtype])


def kv_bytes_per_token(d: Dims, kv_dtype: str) -> int:
    return 2 * d.layers * d.kv_heads * _head_bytes(d, kv_dtype)


def _head_bytes(d: Dims, kv_dtype: str) -> int:
    """One token's K (or V) of one KV head: a 4-bit row is D/2 bytes of codes and its scales (formats.kv_int4)."""
    return kv_int4.row_bytes(d.head_dim) if kv_dtype == "int4" else int(KV_BYTES[kv_dtype] * d.head_dim)


def decode_step(d: Dims, w: WeightFormat, kv_dtype: str, batch: int, context: int, device: Device) -> dict:
    """The bandwidth-only decode step at `batch` sequences of `context` tokens each."""
    kv = batch * kv_bytes_per_token(d, kv_dtype) * context
    moved = read_bytes(d, w) + kv
    tau = moved / device.bandwidth
    matmul = linear_params(d) + d.vocab * d.hidden  # 2 FLOPs per weight per token, the head included
    compute = 2 * batch * matmul / device.peak_flops  # the linears' arithmetic at the device's peak
    return {
        "batch": batch,
        "context": context,
        "kv_bytes": kv,
        "bytes_moved": moved,
        "step_ms": 1e3 * tau,
        "tokens_per_s": batch / tau,
        "linear_intensity": 2 * batch * linear_params(d) / _linear_bytes(d, w),
        "attention_intensity": 2 * (d.heads / d.kv_heads) * d.head_dim / _head_bytes(d, kv_dtype),
        "compute_ms": 1e3 * compute,
        "bound": "compute" if compute > tau else "bandwidth",
        "roofline_tokens_per_s": batch / max(tau, compute),
    }


def max_batch(d: Dims, w_bytes: int, kv_dtype: str, context: int, memory: float) -> int:
    """Sequences of `context` tokens whose KV fits in `memory` beside the weights (0 if the weights don't)."""
    return max(0, int((memory - w_bytes) // (kv_bytes_per_token(d, kv_dtype) * context)))


def _best_seconds(fn, seconds: float) -> float:
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def copy_bandwidth(device: str = "cpu", seconds: float = 0.5) -> float:
    """Bytes/s of a 256 MiB tensor copy (bytes read + written), the best over `seconds`."""
    import torch

    src = torch.ones(64 << 20, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    def copy():
        dst.copy_(src)
        sync()

    return 2 * src.nbytes / _best_seconds(copy, seconds)


def matmul_rate(dtype: str = "float32", device: str = "cpu", n: int = 1024, seconds: float = 1.5) -> float:
    """FLOP/s that n×n by n×n products in `dtype` sustain: the rate over `seconds` after as many seconds of
    the same products. Not the best single product: an AMX CPU here multiplied bf16 at ~1.1 TFLOP/s for about
    a second, then at ~0.35 for as long as the products went on."""
    import torch

    a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    def products(until: float) -> int:
        count = 0
        while time.perf_counter() < until:
            a @ a
            sync()
            count += 1
        return count

    products(time.perf_counter() + seconds)
    start = time.perf_counter()
    count = products(start + seconds)
    return 2 * n**3 * count / (time.perf_counter() - start)


def serving_roofline(
    d: Dims,
    requests: list[tuple[float, int, int]],
    max_seqs: int,
    read_bytes: float,
    kv_bytes_per_token: float,
    peak_flops: float,
    bandwidth: float,
) -> dict:
    """A lower bound on the wall time of a workload whose requests are (arrival s, prompt tokens p, output
    tokens o), and the output throughput it allows:
      arithmetic F = 2·P·(Σp + Σo) + 2·V·D·Σo + 4·L·N·H·C: the linears' P weights for every token, the head
                 for every output token, attention's QKᵀ and PV over C, the sum of every token's context;
      bytes      M = S·W_b + K·Σ_i Σ_{t=1..o_i-1} (p_i + t): the weights read once per step, with at least
                 S = max(max_i o_i, ⌈Σo / max_seqs⌉) steps (a request's tokens come one step after another,
                 and a step holds at most max_seqs sequences), and each decode token's KV history at K bytes
                 per token (prefill's KV reads left out);
      time       T = max(F / peak, M / β, last arrival); throughput Σo / T.
    Each term is a lower bound, so the throughput bound is optimistic."""
    prompts, outputs = sum(p for _, p, _ in requests), sum(o for _, _, o in requests)
    decode_context = sum((o - 1) * p + (o - 1) * o // 2 for _, p, o in requests)
    context = sum(p * (p + 1) // 2 for _, p, _ in requests) + decode_context
    flops = (
        2 * linear_params(d) * (prompts + outputs)
        + 2 * d.vocab * d.hidden * outputs
        + 4 * d.layers * d.heads * d.head_dim * context
    )
    steps = max(max(o for _, _, o in requests), -(-outputs // max_seqs))
    moved = steps * read_bytes + kv_bytes_per_token * decode_context
    compute_s, memory_s = flops / peak_flops, moved / bandwidth
    arrivals_s = max(a for a, _, _ in requests)
    time_s = max(compute_s, memory_s, arrivals_s)
    bound = max(("compute", compute_s), ("bandwidth", memory_s), ("arrivals", arrivals_s), key=lambda kv: kv[1])[0]
    return {
        "flops": flops,
        "bytes": moved,
        "steps": steps,
        "compute_s": compute_s,
        "memory_s": memory_s,
        "arrivals_s": arrivals_s,
        "time_s": time_s,
        "bound": bound,
        "output_tok_s": outputs / time_s,
    }


def probe_cpu(seconds: float = 0.5) -> Device:
    """This machine, measured now: copy bandwidth and fp32 matmul FLOP/s (1024³), physical memory."""
    import os

    import torch

    flops = matmul_rate("float32", "cpu", 1024, seconds)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device(f"this machine ({torch.get_num_threads()} threads)", flops, copy_bandwidth("cpu", seconds), memory)


def plan(
    d: Dims,
    weights: WeightFormat,
    kv_dtype: str,
    context: int,
    batches: list[int],
    kv_heads: list[int],
    device: Device,
    kv_budget: int | None = None,
) -> dict:
    """Everything `compress plan` prints, as data: the counts, then one row per (KV heads, batch), what fits in
    the device's memory. With a `kv_budget` (a window or snapkv policy), a sequence keeps at most that many of
    its `context` tokens."""
    memory = device.memory
    resident = context if kv_budget is None else min(context, kv_budget)
    rows = []
    for k in kv_heads:
        variant = Dims(**{**d.__dict__, "kv_heads": k})
        fits = max_batch(variant, weight_bytes(variant, weights), kv_dtype, resident, memory)
        for batch in batches:
            rows.append(
                {
                    "kv_heads": k,
                    **decode_step(variant, weights, kv_dtype, batch, resident, device),
                    "context": context,
                    "resident": resident,
                    "fits": batch <= fits,
                    "max_batch": fits,
                }
            )
    return {
        "dims": d.__dict__,
        "parameters": parameters(d),
        "weights": weights.__dict__,
        "weight_bytes": weight_bytes(d, weights),
        "kv_dtype": kv_dtype,
        "kv_bytes_per_token": kv_bytes_per_token(d, kv_dtype),
        "kv_budget": kv_budget,
        "kv_bytes_per_request": kv_bytes_per_token(d, kv_dtype) * resident,
        "device": device.__dict__,
        "memory": memory,
        "crossover": device.peak_flops / device.bandwidth,
        "rows": rows,
    }


def weight_format_of(config: dict, dtype: str, model_dir: Path | None = None) -> WeightFormat:
    """The weight format a checkpoint's config.json describes (compressed-tensors or GPTQ), else float. With
    `model_dir`, a quantized checkpoint's decoder linears count the bytes its files store (a mix of schemes,
    fp32 or fp16 scales, whatever the config says)."""
    q = config.get("quantization_config")
    if not q:
        return WeightFormat(dtype=dtype)
    if q.get("quant_method") == "compressed-tensors":
        groups = [g["weights"] for g in q["config_groups"].values()]
        schemes = [
            f"w{w['num_bits']}" + (f"g{w['group_size']}" if w.get("strategy") == "group" else "-channel")
            for w in groups
        ]
        w = groups[0]
        group = w["group_size"] if w.get("strategy") == "group" else -1
        fmt = WeightFormat(dtype, w["num_bits"], group, w["symmetric"], mix=tuple(schemes) if len(groups) > 1 else ())
    else:
        fmt = WeightFormat(dtype, q.get("bits", 4), q.get("group_size", 128), q.get("sym", True))
    if model_dir is None:
        return fmt
    stored = shards.tensor_bytes(model_dir)
    head = None if "lm_head.weight" in stored else sum(v for k, v in stored.items() if k.startswith("lm_head."))
    return replace(fmt, linear_bytes=stored_linear_bytes(model_dir, stored), head_bytes=head or None)


def stored_linear_bytes(model_dir: Path, stored: dict[str, int] | None = None) -> int:
    """The bytes a checkpoint's files hold for its decoder layers' linears (codes, scales, zero points,
    shapes, g_idx), from `stored` (shards.tensor_bytes of model_dir) when already read."""
    stored = shards.tensor_bytes(model_dir) if stored is None else stored
    return sum(size for tensor, size in stored.items() if arch.decoder_linear(tensor))


def against_bench(bench: dict, config: dict, model_dir: Path) -> list[dict]:
    """The bandwidth model's step for each decode step a `compress bench` run measured (its own bandwidth,
    its checkpoint's bytes), side by side with the measured time."""
    system = bench["systems"]["model"]
    dtype = bench.get("activation_dtype") or bench["config"]["dtype"]  # results before auto lack the former
    dims, weights = Dims.from_config(config), weight_format_of(config, dtype, model_dir)
    measured = system["offline"]["kv_bytes_per_token"]
    kv = next((k for k in ("int4", "int8", "bf16", "fp32") if kv_bytes_per_token(dims, k) == measured), None)
    if kv is None:
        raise SlimlmError(
            f"the bench's {measured} KV bytes per token fit no KV dtype of this model's shape; "
            "was it run on another model?"
        )
    device = Device("measured", float("inf"), bench["bandwidth_bytes_s"], float("inf"))
    rows = []
    for d in system["offline"]["decode"]:
        predicted = decode_step(dims, weights, kv, d["batch"], bench["config"]["context"], device)["step_ms"]
        rows.append(
            {
                "batch": d["batch"],
                "context": bench["config"]["context"],
                "predicted_ms": predicted,
                "measured_ms": d["step_ms"],
                "ratio": d["step_ms"] / predicted,
            }
        )
    return rows


def format_plan(result: dict) -> str:
    p, dev = result["parameters"], result["device"]
    gb = 1e9
    lines = [
        f"parameters: {p['total']:,} exact (embeddings {p['embeddings']:,}, lm_head {p['lm_head']:,}, attention "
        f"{p['attention']:,}, MLP {p['mlp']:,}, norms {p['norms']:,}); 2VD + 3DFL + (2DNH + 2DKH)L = "
        f"{p['simplified']:,}",
        f"weights: {result['weight_bytes'] / gb:.3f} GB ({_describe(result['weights'])}); KV: "
        f"{result['kv_bytes_per_token']:,} bytes per token ({result['kv_dtype']}), "
        f"{result['kv_bytes_per_request'] / 2**20:,.1f} MiB per request"
        + ("" if result["kv_budget"] is None else f" (a KV policy keeps at most {result['kv_budget']:,} tokens)"),
        f"device: {dev['name']}: {dev['peak_flops'] / 1e12:.1f} TFLOP/s, {dev['bandwidth'] / gb:.1f} GB/s; "
        f"roofline crossover {result['crossover']:.0f} FLOP/byte; memory budget {result['memory'] / gb:.1f} GB",
        "",
        f"{'KV heads':>8} {'batch':>6} {'context':>8} {'kept':>8} {'KV GB':>8} {'moved GB':>9} {'step ms':>9} "
        f"{'tok/s':>10} "
        f"{'linear FLOP/B':>13} {'attn FLOP/B':>11} {'compute ms':>10} {'bound':>9} {'roofline tok/s':>14} "
        f"{'fits':>5}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['kv_heads']:>8} {r['batch']:>6} {r['context']:>8} {r['resident']:>8} {r['kv_bytes'] / gb:>8.3f} "
            f"{r['bytes_moved'] / gb:>9.3f} {r['step_ms']:>9.2f} {r['tokens_per_s']:>10.1f} "
            f"{r['linear_intensity']:>13.1f} {r['attention_intensity']:>11.1f} {r['compute_ms']:>10.2f} "
            f"{r['bound']:>9} {r['roofline_tokens_per_s']:>14.1f} {'yes' if r['fits'] else 'no':>5}"
        )
    lines.append(
        "(a step is bandwidth-bound while its intensity is under the crossover; 'fits': the batch's KV "
        "fits beside the weights, at most "
        + ", ".join(f"{k}: {m}" for k, m in dict((r["kv_heads"], r["max_batch"]) for r in result["rows"]).items())
        + " sequences by KV heads)"
    )
    return "\n".join(lines)


def _describe(w: dict) -> str:
    if w["bits"] is None:
        return w["dtype"]
    if w["mix"]:
        return f"mixed: {', '.join(w['mix'])}, {'sym' if w['sym'] else 'asym'}; the rest {w['dtype']}"
    group = "per channel" if w["group_size"] == -1 else f"groups of {w['group_size']}"
    return f"W{w['bits']} {group} {'sym' if w['sym'] else 'asym'}, the rest {w['dtype']}"
