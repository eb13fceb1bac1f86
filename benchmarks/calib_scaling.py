"""Calibration time per decoder layer against its arithmetic bound, measured in one run.

Runs the real pipeline (the steps `compress gptq` / `compress awq` build, on the model's first --layers decoder
layers read from disk) and sets each layer's seconds beside the matrix products the method cannot avoid, at the
matmul rate this machine shows in the same run:

    passes     every pass of the calibration tokens through the layer: GPTQ 2 (observe, then the quantized layer's
               outputs for the next layer), AWQ 2 plus its scale search ((grid + 1) block forwards over the
               search batches per mapping) and its clipping (per clipped linear, 11 shrinks × out·in·gs products
               through each group's input covariance)
    hessians   GPTQ: 2·tokens·d² per distinct linear input (q/k/v and gate/up share theirs)
    solve      GPTQ: the inverse Hessian factor (n³/3 factorization + n³/3 triangular inverse) and the lazy
               block updates (out·in² per stacked linear)

`bound` = (passes + hessians) / rate, the issue's definition; `all` adds the solve. The rate is the best of a few
fp32 (or bf16, where that is the compute dtype) products of the layer's own shapes.

    .venv/bin/python benchmarks/calib_scaling.py --model qwen2.5-coder-1.5b --method gptq --num-samples 16 --layers 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from slimlm import arch, data, devices, models
from slimlm.compress import pipeline
from slimlm.compress.awq import AWQ, CLIP_GRID, CLIP_MAX_SHRINK, GRID
from slimlm.compress.gptq import GPTQ
from slimlm.compress.offload import LazyWeights
from slimlm.compress.rtn import RTN
from slimlm.formats.quantized import QuantArgs
from slimlm.kernels import cpu_gram, cpu_library
from slimlm.kernels.cpu_library import cpu_flags


def matmul_rate(tokens: int, hidden: int, ffn: int, dtype: torch.dtype) -> float:
    """FLOP/s of the layer's own largest products (x·W_upᵀ, x·W_downᵀ, XᵀX), best of 3."""
    x, w = torch.randn(tokens, hidden, dtype=dtype), torch.randn(ffn, hidden, dtype=dtype)
    h, wd = torch.randn(tokens, ffn, dtype=dtype), torch.randn(hidden, ffn, dtype=dtype)
    flops = 2 * tokens * hidden * ffn * 2 + 2 * tokens * hidden * hidden
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        x @ w.T, h @ wd.T, x.T @ x  # noqa: B018 (timed for their cost)
        best = min(best, time.perf_counter() - start)
    return flops / best


def layer_flops(
    cfg: dict, method: str, tokens: int, seq_len: int, search_tokens: int, group_size: int
) -> dict[str, float]:
    hidden, ffn, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    hd = arch.head_dim(cfg)
    kv = cfg.get("num_key_value_heads") or heads
    q, kvw, o = heads * hd * hidden, 2 * kv * hd * hidden, hidden * heads * hd
    mlp_gu, mlp_d = 2 * hidden * ffn, ffn * hidden
    attn_per_token = 2 * seq_len * heads * hd  # q·kᵀ and p·v over a causal half: 2·2·(seq/2)·heads·hd
    per_token = 2 * (q + kvw + o + mlp_gu + mlp_d) + attn_per_token
    out = {"passes": 2 * per_token * tokens, "hessians": 0.0, "solve": 0.0}
    if method == "gptq":
        widths = [hidden, heads * hd, hidden, ffn]  # the inputs of q/k/v, o, gate/up, down: one Hessian each
        rows = [(heads + 2 * kv) * hd, hidden, 2 * ffn, hidden]  # the output rows quantized against each
        out["hessians"] = sum(2 * tokens * n * n for n in widths)
        out["solve"] = sum(2 * n**3 / 3 + r * n * n for r, n in zip(rows, widths, strict=True))
    else:  # AWQ's scale search (block forwards over the search batches), then its clipping; RTN is free
        blocks = [2 * (q + kvw + o) + attn_per_token, 2 * (mlp_gu + mlp_d), 2 * mlp_d]  # self_attn, mlp, down_proj
        blocks += [2 * o] if kv == heads else []  # v -> o only without GQA
        out["passes"] += (GRID + 1) * search_tokens * sum(blocks)
        shrinks = int(CLIP_MAX_SHRINK * CLIP_GRID) + 1
        clipped = kvw // 2 + o + mlp_gu + mlp_d  # v, o, gate, up, down weights (q and k are not clipped)
        out["passes"] += shrinks * 2 * clipped * group_size  # d·C·dᵀ per group (the covariances are negligible)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--method", choices=["gptq", "awq"], default="gptq")
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--compute-dtype", default="auto", choices=list(devices.COMPUTE_DTYPES))
    p.add_argument(
        "--hessian-unit",
        choices=["auto", "vector"],
        default="auto",
        help="vector: GPTQ's Hessians on the bf16 dot-product unit even where the CPU has AMX tiles (the earlier loop)",
    )
    p.add_argument("--json")
    a = p.parse_args()
    if a.hessian_unit == "vector":
        cpu_gram.uses_amx = lambda width: False

    model_dir = models.resolve(a.model)
    cfg = models.check(model_dir)
    model, tokenizer = models.empty_model(model_dir), models.load_tokenizer(model_dir)
    layers = pipeline.decoder_layers(model)
    del layers[a.layers :]
    model.config.num_hidden_layers = a.layers
    weights = LazyWeights(model_dir)
    weights.materialize(model.get_submodule(arch.EMBED), arch.EMBED, torch.float32, "cpu")
    passes = devices.compute_dtype(a.compute_dtype, torch.float32, torch.device("cpu"))
    args = QuantArgs(4, a.group_size, True)
    steps = [GPTQ(args)] if a.method == "gptq" else [AWQ(args), RTN(args)]
    calib = data.calibration_windows("owt", tokenizer, a.num_samples, a.seq_len)
    tokens = a.num_samples * a.seq_len
    search_tokens = min(tokens, steps[0].search_batches * a.batch_size * a.seq_len) if a.method == "awq" else 0

    rate_before = matmul_rate(a.batch_size * a.seq_len, cfg["hidden_size"], cfg["intermediate_size"], passes)
    run = pipeline.Passes(a.batch_size, compute_dtype=passes, report_error=False)
    result = pipeline.run(model, steps, calib, run, weights=weights, on_layer=lambda *_: None)
    rate_after = matmul_rate(a.batch_size * a.seq_len, cfg["hidden_size"], cfg["intermediate_size"], passes)
    rate = max(rate_before, rate_after)
    flops = layer_flops(cfg, a.method, tokens, a.seq_len, search_tokens, a.group_size)
    bound = (flops["passes"] + flops["hessians"]) / rate
    every = bound + flops["solve"] / rate
    seconds = [e["seconds"] for e in result.report]
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, " + (
        "AVX-512" if "avx512f" in cpu_flags() else "AVX2"
    )
    if cpu_library.available() and cpu_library.has_amx():
        machine += f" + AMX (Hessians on the {'tile unit' if cpu_gram.uses_amx(cfg['hidden_size']) else 'vector unit'})"
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):  # how an AVX2-only machine's products are emulated on a newer one
        caps = os.environ["ONEDNN_MAX_CPU_ISA"], os.environ.get("MKL_ENABLE_INSTRUCTIONS")
        machine += f" (oneDNN capped at {caps[0]}, MKL at {caps[1]})"
    print(
        f"{a.model} {a.method} W4 g{a.group_size}, {a.num_samples}x{a.seq_len} tokens, passes in {passes}, "
        f"{machine}; matmul {rate_before / 1e9:.0f} / {rate_after / 1e9:.0f} GFLOP/s before / after"
    )
    print(
        f"per layer: passes {flops['passes'] / 1e12:.2f} TFLOP, hessians {flops['hessians'] / 1e12:.2f}, "
        f"solve {flops['solve'] / 1e12:.2f}; bound {bound:.1f} s (with the solve {every:.1f} s)"
    )
    for i, s in enumerate(seconds):
        print(f"  layer {i}: {s:6.1f} s = {s / bound:.2f}x the bound, {s / every:.2f}x all arithmetic")
    steady = seconds[1:] or seconds
    median = sorted(steady)[len(steady) // 2]
    print(
        f"median layer (after the first): {median:.1f} s = {median / bound:.2f}x the bound, "
        f"{median / every:.2f}x all arithmetic"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "model": a.model,
                    "method": a.method,
                    "group_size": a.group_size,
                    "tokens": tokens,
                    "seq_len": a.seq_len,
                    "compute_dtype": str(passes),
                    "machine": machine,
                    "matmul_flops": [rate_before, rate_after],
                    "layer_flops": flops,
                    "bound_s": bound,
                    "all_arithmetic_s": every,
                    "layer_seconds": seconds,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
