"""Where a batch-1 decode step's time goes on CPU, and what the fused layer operations (cpu_layer.c: residual add
+ RMSNorm, rotary + KV write; all layers in one call) save against their PyTorch definitions, in one run.

For each checkpoint and dtype: the decode step (batch 1, 256 cached tokens, random KV) with the layer's small
operations as PyTorch operators (reference.py), as C calls, and with all layers in one C call (packed
checkpoints), timed in turn; each against the bandwidth floor (weights as stored + the KV history, ÷ the copy
bandwidth measured here); then, for the per-operation C variant, the time inside each kind of call (the rest
is Python, module calls and the remaining small operators: embedding, splits, SiLU·up).

    PYTHONPATH=. .venv/bin/python benchmarks/decode_overhead.py out/speed/w4h8 smollm2-135m [--threads 2]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import time

import torch

from slimlm import kernels
from slimlm.eval import plan
from slimlm.kernels import reference
from slimlm.perf.config import BenchConfig, engine_for
from slimlm.perf.offline import decode_inputs

CONTEXT = 256
RUN = 10  # steps back to back per variant and turn, as a server runs them (one step between the others'
# ran 1.2x slower than steps in a row: the caches then hold another variant's data)


def step_timer(engine):
    runner = engine.runner
    runner.kv_cache.normal_()
    ids, step = decode_inputs(1, CONTEXT, engine.config.block_size)

    def step_s() -> float:
        start = time.perf_counter()
        hidden = runner.model(ids, step, runner.kv_cache)
        runner.model.logits(hidden)
        return time.perf_counter() - start

    return step_s


def split(engine, step_s, steps: int) -> dict[str, float]:
    """ms per step inside each kind of call (wrappers added for this measurement, then removed)."""
    spent = collections.defaultdict(float)

    def timed(name, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name] += time.perf_counter() - start
            return out

        return call

    model = engine.runner.model
    saved = []
    for module in model.modules():
        for attr, name in (
            ("quant_matmul", "quantized linears"),
            ("attention", "paged attention"),
            ("add_rms_norm", "add + RMSNorm"),
            ("rotary_kv_write", "rotary + KV write"),
        ):
            if hasattr(module, attr) and not (attr == "quant_matmul" and module.packed is None):
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, timed(name, getattr(module, attr)))
    total = sum(step_s() for _ in range(steps))
    for module, attr, fn in saved:
        setattr(module, attr, fn)
    out = {name: 1e3 * s / steps for name, s in spent.items()}
    out["rest (Python, modules, other operators)"] = 1e3 * total / steps - sum(out.values())
    return out


@torch.inference_mode()
def measure(model: str, dtype: str, bandwidth: float, budget_s: float) -> dict:
    engine = engine_for(model, BenchConfig(dtype=dtype, batch=[1]), CONTEXT + 8)
    runner = engine.runner
    cpu = kernels.select("cpu")
    per_op = dataclasses.replace(cpu, decode_stack=None)
    variants = {
        "pytorch layer ops": dataclasses.replace(
            per_op, add_rms_norm=reference.add_rms_norm, rotary_kv_write=reference.rotary_kv_write
        ),
        "C layer ops": per_op,
        "one call per step": cpu,
    }
    step_s = step_timer(engine)
    times = {name: [] for name in variants}
    for backend in variants.values():  # warm-up
        runner.model.set_backend(backend)
        step_s()
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end or min(map(len, times.values())) < 10:
        for name, backend in variants.items():  # in turn: both share the machine's moods
            runner.model.set_backend(backend)
            step_s()  # untimed: the first step after set_backend builds the one-call plan, once per server
            times[name] += [step_s() for _ in range(RUN)]
    floor_s = (runner.weight_bytes() + CONTEXT * runner.kv_bytes_per_token) / bandwidth
    result = {"model": model, "dtype": dtype, "floor_ms": 1e3 * floor_s, "variants": {}}
    for name, ts in times.items():
        ms = 1e3 * statistics.median(ts)
        result["variants"][name] = {"step_ms": ms, "floor_ratio": ms / 1e3 / floor_s, "steps": len(ts)}
    base = result["variants"]["pytorch layer ops"]["step_ms"]
    result["speedup"] = {name: base / v["step_ms"] for name, v in result["variants"].items()}
    result["one_call_step"] = runner.model.decode_stack is not None
    runner.model.set_backend(per_op)
    result["split_ms"] = split(engine, step_s, 30)  # of the C layer ops variant: one call per step hides it
    runner.model.set_backend(cpu)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0, help="timing budget per checkpoint and dtype")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = plan.copy_bandwidth("cpu")
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, {args.threads} threads, batch 1, context {CONTEXT}")
    results = []
    for model in args.models:
        for dtype in args.dtypes.split(","):
            r = measure(model, dtype, bandwidth, args.seconds)
            results.append(r)
            print(f"\n{model} {dtype}: floor {r['floor_ms']:.2f} ms")
            for name, v in r["variants"].items():
                print(f"  {name:18s} step {v['step_ms']:6.2f} ms  {v['floor_ratio']:4.2f}× floor  ({v['steps']} steps)")
            print(
                "  speedup over pytorch layer ops: "
                + ", ".join(f"{k} {v:.2f}×" for k, v in r["speedup"].items())
                + ("" if r["one_call_step"] else " (one call per step does not apply: float linears)")
            )
            print("  split (C variant, ms/step): " + ", ".join(f"{k} {v:.2f}" for k, v in r["split_ms"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_bytes_s": bandwidth, "threads": args.threads, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
