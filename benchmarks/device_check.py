"""Everything the GPU must tell us, in one run (called by benchmarks/device_check.sh; see ../shared/device/README.md).

1. ceilings: device-to-device copy bandwidth and dense bf16 matmul rate;
2. correctness of every Triton kernel against its float64 reference on the GPU (fresh random inputs,
   outputs poisoned with NaN);
3. W4A16 GEMM vs torch bf16 matmul (cuBLAS) for M = 1..256 at Llama-8B/70B shapes;
4. paged decode attention: achieved KV bandwidth vs the copy bandwidth, batch 1..64, context 512..8192;
5. end-to-end decode of the runtime (bf16 and W4 g128) on a random-weight model with Llama-3-8B's layer
   shapes (8 of its 32 layers, to keep the load short) against the roofline: bytes per step ÷ copy bandwidth;
6. calibration on the GPU: GPTQ and AWQ+RTN over 2 Llama-3-8B-shaped layers, timed, and the same jobs on a
   tiny model on both GPU and CPU, whose codes must agree (up to rounding ties).
Results go to $OUT/device_check.json; a short ratio table is printed last.

--dry-run runs the same code on CPU through the Triton interpreter, with tiny shapes and every timing
replaced by one untimed call, so the script can be checked end to end without a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from slimlm.kernels import reference, triton_attention, triton_gemm  # noqa: E402
from slimlm.kernels.packed import BLOCK_N, PackedWeight  # noqa: E402
from tests.kernels.problems import paged_problem, poisoned_allocations, quantized_weight, relative_error  # noqa: E402

GEMM_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # (K, N)
GEMM_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
ATTN_BATCH = [1, 4, 16, 64]
ATTN_CONTEXT = [512, 2048, 8192]
LLAMA8B_ATTN = dict(heads=32, kv_heads=8, head_dim=128)
LLAMA8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=2048,
)
E2E_BATCH = [1, 8, 32, 64]
E2E_CONTEXT = 512


def bench_ms(fn) -> float:
    """Median milliseconds over CUDA-event-timed repeats (L2 flushed before each); NaN in a dry run."""
    if DRY:
        fn()
        return math.nan
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def ceilings(device: str) -> dict:
    n = (1 << 28) if not DRY else (1 << 12)  # 1 GiB of fp32
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    size = 8192 if not DRY else 64
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    mm_ms = bench_ms(lambda: a @ b)
    return {"copy_GBps": 2 * src.nbytes / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * size**3 / mm_ms / 1e9}


def correctness(device: str) -> list[dict]:
    """The kernel tests' cases, on the GPU: worst relative error per kernel and dtype vs float64."""
    results = []
    dtypes = [torch.float16, torch.bfloat16, torch.float32] if not DRY else [torch.float16, torch.float32]
    for bits, group, sym, act_order in [(4, 128, True, False), (4, 64, False, True), (8, -1, True, False)]:
        _, w = quantized_weight(300, 512, bits, group, sym, act_order, seed=bits)
        w = w.to(device)
        for dtype in dtypes:
            worst = 0.0
            for m in (1, 7, 33, 130):
                x = torch.randn(m, 512, device=device).to(dtype)
                with poisoned_allocations():
                    out = triton_gemm.quant_matmul(x, w)
                worst = max(worst, relative_error(out, reference.quant_matmul(x.double(), w)))
            name = f"w{bits}a16 g{group} {'sym' if sym else 'asym'}{' act-order' if act_order else ''}"
            results.append({"kernel": name, "dtype": str(dtype), "rel_err": worst})
    for kv_dtype in [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8]:
        for q_dtype in dtypes:
            for name, q_lens in (("decode", [1] * 5), ("prefill", [30, 17, 1, 64, 5])):
                problem = paged_problem([30, 90, 16, 200, 9], q_lens, 8, 2, 128, 16, kv_dtype, q_dtype, device, 1)
                with poisoned_allocations():
                    out = triton_attention.paged_attention(*problem.args())
                ref = reference.paged_attention(*problem.args(), dtype=torch.float64)
                results.append(
                    {
                        "kernel": f"paged {name} kv={kv_dtype}".replace("torch.", ""),
                        "dtype": str(q_dtype),
                        "rel_err": relative_error(out, ref),
                    }
                )
    return results


def random_w4(k: int, n: int, device: str, group: int = 128) -> PackedWeight:
    """A W4 g128 weight of real shape with random codes and scales: quantizing 235M floats on the host
    would eat the time budget, and the kernel's speed does not depend on where the codes came from."""
    blocks = n // BLOCK_N
    return PackedWeight(
        codes=torch.randint(0, 256, (blocks, k, BLOCK_N // 2), dtype=torch.uint8, device=device),
        scales=(torch.rand(blocks, k // group, BLOCK_N, device=device) * 0.01 + 0.001).half(),
        zeros=torch.randint(0, 16, (blocks, k // group, BLOCK_N), dtype=torch.uint8, device=device),
        bits=4,
        group_size=group,
        out_features=n,
    )


def gemm(device: str) -> list[dict]:
    shapes = GEMM_SHAPES if not DRY else [(256, 128)]
    rows = GEMM_ROWS if not DRY else [1, 16, 130]
    results = []
    for k, n in shapes:
        w = random_w4(k, n, device)
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            t_q = bench_ms(functools.partial(triton_gemm.quant_matmul, x, w))
            t_bf16 = bench_ms(functools.partial(torch.matmul, x, dense.T))
            launch = triton_gemm.config(m, k, n // BLOCK_N)
            results.append(
                {
                    "K": k,
                    "N": n,
                    "M": m,
                    "w4a16_ms": t_q,
                    "bf16_ms": t_bf16,
                    "speedup": t_bf16 / t_q,
                    "w4a16_GBps": w.nbytes() / t_q / 1e6,
                    "launch": launch,
                }
            )
            print(f"gemm K={k} N={n} M={m}: w4a16 {t_q:.4f} ms  bf16 {t_bf16:.4f} ms  {t_bf16 / t_q:.2f}×", flush=True)
    return results


def decode_attention(device: str, copy_gbps: float) -> list[dict]:
    batches = ATTN_BATCH if not DRY else [1, 3]
    contexts = ATTN_CONTEXT if not DRY else [40]
    shape = LLAMA8B_ATTN if not DRY else dict(heads=4, kv_heads=2, head_dim=64)
    results = []
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for batch in batches:
            for context in contexts:
                p = paged_problem(
                    [context] * batch,
                    [1] * batch,
                    **shape,
                    block_size=16,
                    kv_dtype=kv_dtype,
                    q_dtype=torch.bfloat16 if not DRY else torch.float32,
                    device=device,
                )
                t = bench_ms(functools.partial(triton_attention.paged_attention, *p.args()))
                gbps = p.kv_bytes() / t / 1e6
                results.append(
                    {
                        "kv_dtype": str(kv_dtype),
                        "batch": batch,
                        "context": context,
                        "ms": t,
                        "GBps": gbps,
                        "of_copy_bw": gbps / copy_gbps,
                    }
                )
                print(f"decode attn {kv_dtype} batch={batch} ctx={context}: {t:.4f} ms {gbps:.0f} GB/s", flush=True)
    return results


def random_llama(path: Path, shape: dict) -> Path:
    """A Llama checkpoint with random bf16 weights (std 0.02, norms 1) and a word-level tokenizer that
    covers its vocabulary, so the runtime loads it like any other model."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**shape, tie_word_embeddings=False, torch_dtype="bfloat16")
    config.save_pretrained(path)
    h, i, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "lm_head.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    tensors = {
        name: torch.ones(s, dtype=torch.bfloat16) if len(s) == 1 else torch.randn(s, dtype=torch.bfloat16) * 0.02
        for name, s in shapes.items()
    }
    save_file(tensors, path / "model.safetensors")
    vocab = {f"t{n}": n for n in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1").save_pretrained(path)
    return path


def to_w4(engine) -> None:
    """Every decoder-layer linear quantized RTN W4 g128 symmetric and swapped for the packed kernel path."""
    from slimlm.compress.quantize import quantize_rtn
    from slimlm.formats.quantized import QuantArgs
    from slimlm.kernels import pack
    from slimlm.kernels.packed import dequantize
    from slimlm.runtime.model import Linear

    args = QuantArgs(4, 128 if not DRY else 32, True)
    for name, module in engine.model.named_modules():
        if isinstance(module, Linear) and name.startswith("model.layers."):
            dense = module.packed  # on a CPU (the dry run) the float weights are packed already (pack_dense)
            weight = module.weight if dense is None else dequantize(dense)[: dense.out_features]
            module.set_packed(pack(quantize_rtn(weight.float(), args)))


def end_to_end(device: str, copy_gbps: float) -> list[dict]:
    from slimlm.runtime.engine import Engine, EngineConfig
    from slimlm.runtime.sampling import SamplingParams

    model_dir = random_llama(Path("out/device_check_model"), LLAMA8B if not DRY else TINY)
    batches, context = (E2E_BATCH, E2E_CONTEXT) if not DRY else ([1, 3], 40)
    results = []
    for variant in ("bf16", "w4a16"):
        config = EngineConfig(
            dtype="bfloat16" if not DRY else "float32",
            device=device,
            max_num_batched_tokens=8192,
            kv_cache_memory=(16 << 30) if not DRY else (64 << 20),
        )
        engine = Engine(str(model_dir), config)
        if variant == "w4a16":
            to_w4(engine)
        model = engine.model
        stats = engine.stats()
        weights, kv_per_token = stats.weight_bytes, stats.kv_bytes_per_token
        gen = torch.Generator().manual_seed(0)
        for batch in batches:
            ids = [torch.randint(2, model.config.vocab_size, (context,), generator=gen).tolist() for _ in range(batch)]
            params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
            names = [engine.add_request(p, params) for p in ids]
            while engine.stats().prefilling:
                engine.step()  # prefill first: only pure decode steps are timed
            engine.step()
            ms = bench_ms(engine.step) if DRY else _median_step_ms(engine)
            for name in names:
                engine.abort(name)
            moved = weights + batch * (context + 1) * kv_per_token
            floor_ms = moved / copy_gbps / 1e6
            results.append(
                {
                    "variant": variant,
                    "batch": batch,
                    "context": context,
                    "step_ms": ms,
                    "bytes_per_step": moved,
                    "floor_ms": floor_ms,
                    "of_roofline": floor_ms / ms,
                }
            )
            print(f"e2e {variant} batch={batch}: step {ms:.3f} ms, floor {floor_ms:.3f} ms", flush=True)
        del engine
    return results


def calibration(device: str) -> dict:
    """GPTQ and AWQ through the CLI's own job on `device`: timed on Llama-8B-shaped layers, and on a tiny
    model run on both the device and the CPU, the share of identical codes (ties may round either way)."""
    from slimlm.compress.awq import AWQ
    from slimlm.compress.gptq import GPTQ
    from slimlm.compress.job import CalibData, Quantization, quantize_weights
    from slimlm.compress.rtn import RTN
    from slimlm.formats import reader
    from slimlm.formats.quantized import QuantArgs

    big = None if DRY else random_llama(Path("out/device_check_calib"), {**LLAMA8B, "num_hidden_layers": 2})
    tiny = random_llama(Path("out/device_check_calib_tiny"), TINY)
    text = Path("out/device_check_calib.txt")
    gen = torch.Generator().manual_seed(1)
    words = torch.randint(2, TINY["vocab_size"], (40_000,), generator=gen).tolist()
    text.write_text("\n\n".join(" ".join(f"t{w}" for w in words[i : i + 400]) for i in range(0, len(words), 400)))
    args = QuantArgs(4, 128 if not DRY else 32, True)
    methods = {"gptq": lambda: [GPTQ(args)], "awq+rtn": lambda: [AWQ(args), RTN(args)]}
    result = {"timed": [], "agreement": []}
    for name, steps in methods.items():
        samples, seq_len = (16, 512) if not DRY else (4, 32)
        if not DRY:  # a dry run's "big" model would be the tiny one again: only the agreement check runs
            start = time.perf_counter()
            calib = CalibData(str(text), samples, seq_len, device=device)
            quantize_weights(
                Quantization(name, steps(), args, str(big), Path(f"out/device_check_{name}"), calib, overwrite=True),
                progress=False,
            )
            seconds = time.perf_counter() - start
            result["timed"].append(
                {
                    "method": name,
                    "layers": 2,
                    "samples": samples,
                    "seq_len": seq_len,
                    "seconds": seconds,
                    "per_layer_s": seconds / 2,
                }
            )
            print(f"calibration {name} on {device}: 2 layers in {seconds:.1f} s", flush=True)
        codes = {}
        for where in (device, "cpu"):
            out = Path(f"out/device_check_{name}_tiny_{where}")
            calib = CalibData(str(text), 4, 32, device=where)
            quantize_weights(Quantization(name, steps(), args, str(tiny), out, calib, overwrite=True), progress=False)
            codes[where] = reader.read_checkpoint(out)[0]
        same = sum((codes[device][n].codes == q.codes).sum().item() for n, q in codes["cpu"].items())
        total = sum(q.codes.numel() for q in codes["cpu"].values())
        result["agreement"].append({"method": name, "same_codes": same / total})
        print(f"calibration {name}: {same / total:.4%} of codes equal on {device} and cpu", flush=True)
    return result


def _median_step_ms(engine, steps: int = 20) -> float:
    """Engine steps are host-synchronous (the sampled tokens come back to Python), so wall time is right."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def summary(report: dict) -> str:
    ceil = report["ceilings"]
    lines = [
        f"copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
        f"correctness: worst rel. error {max(r['rel_err'] for r in report['correctness']):.2e} over "
        f"{len(report['correctness'])} kernel/dtype cases",
        "W4A16 ÷ bf16 cuBLAS time (speedup), per M:",
        "  K×N".ljust(16) + "".join(f"{m:>7}" for m in sorted({r["M"] for r in report["gemm"]})),
    ]
    for k, n in sorted({(r["K"], r["N"]) for r in report["gemm"]}):
        cells = [r for r in report["gemm"] if (r["K"], r["N"]) == (k, n)]
        lines.append(f"  {k}×{n}".ljust(16) + "".join(f"{r['speedup']:>6.2f}×" for r in cells))
    lines.append("paged decode attention, share of copy bandwidth (batch × context):")
    for r in report["decode_attention"]:
        lines.append(
            f"  {r['kv_dtype']:<20} b={r['batch']:<3} ctx={r['context']:<5} {r['GBps']:>7.0f} GB/s "
            f"{r['of_copy_bw']:>6.0%}"
        )
    lines.append("runtime decode step vs roofline (Llama-3-8B layer shapes, 8 layers, random weights):")
    for r in report["end_to_end"]:
        lines.append(
            f"  {r['variant']:<6} b={r['batch']:<3} ctx={r['context']:<5} {r['step_ms']:>8.3f} ms "
            f"floor {r['floor_ms']:>7.3f} ms  {r['of_roofline']:>6.0%} of roofline"
        )
    lines.append("calibration on the device (Llama-3-8B layer shapes, random weights):")
    timed = {r["method"]: r for r in report["calibration"]["timed"]}
    for agree in report["calibration"]["agreement"]:
        r = timed.get(agree["method"])
        speed = f"{r['per_layer_s']:.2f} s/layer over {r['samples']}×{r['seq_len']} tokens" if r else "not timed"
        lines.append(f"  {agree['method']:<8} {speed}; same codes as on CPU (tiny model): {agree['same_codes']:.2%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timings")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/device_check"))
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device; run with --dry-run to check the script on CPU")
    torch.manual_seed(0)
    start = time.time()
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.machine() + " (dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dry_run": args.dry_run,
    }
    report["ceilings"] = ceilings(device)
    print("ceilings:", report["ceilings"], flush=True)
    report["correctness"] = correctness(device)
    bad = [r for r in report["correctness"] if not r["rel_err"] < (1e-5 if "float32" in r["dtype"] else 2e-2)]
    print(f"correctness: {len(report['correctness'])} cases, {len(bad)} above tolerance", flush=True)
    report["gemm"] = gemm(device)
    report["decode_attention"] = decode_attention(device, report["ceilings"]["copy_GBps"])
    report["end_to_end"] = end_to_end(device, report["ceilings"]["copy_GBps"])
    report["calibration"] = calibration(device)
    report["seconds"] = time.time() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_check.json").write_text(json.dumps(report, indent=1, default=str))
    print()
    print(summary(report))
    if bad:
        print("FAILED correctness:", *(f"{r['kernel']} {r['dtype']}: {r['rel_err']:.2e}" for r in bad), sep="\n  ")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
