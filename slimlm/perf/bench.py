"""The bench as a whole: each part measured for every system in turn, merged over rounds, with the
workload's roofline, the ratios and the table."""

from __future__ import annotations

import gc
import statistics
from dataclasses import asdict

import torch

from slimlm import devices
from slimlm.errors import SlimlmError
from slimlm.eval import plan, records
from slimlm.perf.config import BenchConfig, max_seqs
from slimlm.perf.http import online_http
from slimlm.perf.load import busy_warnings, others_load
from slimlm.perf.offline import offline
from slimlm.perf.workload import online, workload


def merged(rounds: list[dict]) -> dict:
    """One system's offline figures over its rounds: the median of each timing; the peak memory of the first
    round (later ones start beside what the allocator kept of earlier engines: it read 1.3× the float model's
    for a W4 checkpoint)."""
    out = {**rounds[0], "rounds": len(rounds), "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in rounds)}
    out["other_cores"] = busiest(rounds)
    out["decode"] = []
    for i, first in enumerate(rounds[0]["decode"]):
        step_ms = statistics.median(r["decode"][i]["step_ms"] for r in rounds)
        out["decode"].append(
            {
                **first,
                "step_ms": step_ms,
                "tok_s": 1e3 * first["batch"] / step_ms,
                "floor_ratio": step_ms / first["floor_ms"],
            }
        )
    return out


def median_run(runs: list[dict]) -> dict:
    """One system's online figures over its rounds: the run of median output throughput, whole (its latencies
    belong to that run), with every round's throughput beside it and the busiest round's load."""
    out = dict(sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2])
    out["rounds_output_tok_s"] = [r["output_tok_s"] for r in runs]
    out["other_cores"] = busiest(runs)
    return out


def busiest(rounds: list[dict]) -> float | None:
    """The most cores other processes kept busy in any round: any one round can move a median."""
    loads = [r["other_cores"] for r in rounds if r.get("other_cores") is not None]
    return max(loads) if loads else None


def in_turns(systems: dict[str, str], rounds: int, measure, part: str, log) -> dict[str, list[dict]]:
    """measure(path) for every system, `rounds` times, the systems taking turns; each result with the cores
    other processes kept busy meanwhile."""
    runs = {name: [] for name in systems}
    for turn in range(rounds):
        for name, path in systems.items():
            log(f"[bench] {part}, round {turn + 1} of {rounds}: {name} ({path})")
            with others_load() as load:
                runs[name].append(measure(path))
            runs[name][-1]["other_cores"] = load["other_cores"]
            gc.collect()  # the engine's memory back before the next one loads
    return runs


def bench(model: str, baseline: str | None, config: BenchConfig, progress: bool = True) -> dict:
    """Both models, part by part (offline, then online), the baseline first in each part."""
    from slimlm import models
    from slimlm.runtime import engine

    log = (lambda msg: print(msg, flush=True)) if progress else (lambda msg: None)
    systems = {"baseline": baseline, "model": model} if baseline else {"model": model}
    for path in systems.values():  # before anything loads: a length past a model's context is the user's flag
        context = models.context_length(models.read_config(models.resolve(path)))
        for flag, tokens in (
            ("--prefill-len", config.prefill_len),
            ("--context", config.context + 1),
            ("--prompt-len and --output-len", config.prompt_len[1] + config.output_len[1]),
        ):
            if tokens > context:
                raise SlimlmError(f"{flag}: {tokens} tokens are past {path}'s context of {context}; lower it")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # what the engines run (auto: the machine's fast dtype), named in the result for plan.against_bench
    hf_config = models.read_config(models.resolve(model))
    dtype = devices.dtype_name(engine.activation_dtype(config.dtype, hf_config, torch.device(device)))
    bandwidth, peak = plan.copy_bandwidth(device), plan.matmul_rate(dtype, device)
    log(f"[bench] copy bandwidth {bandwidth / 1e9:.1f} GB/s, {dtype} matmul {peak / 1e9:.0f} GFLOP/s")
    result = {
        "config": asdict(config),
        "bandwidth_bytes_s": bandwidth,
        "matmul_flops": peak,
        "activation_dtype": dtype,
        "threads": torch.get_num_threads(),
        "systems": {name: {"path": path} for name, path in systems.items()},
    }
    runs = in_turns(systems, config.rounds, lambda path: offline(path, config, bandwidth), "offline", log)
    for name, rounds in runs.items():
        result["systems"][name]["offline"] = merged(rounds)
        log(f"[bench] {name}: {rounds[0]['arithmetic']}")
    tokenizer = models.load_tokenizer(models.resolve(model))
    requests = workload(config, tokenizer)
    online_runs = in_turns(
        systems,
        config.rounds,
        lambda path: online(path, config, requests),
        f"online ({config.requests} requests at {config.rate}/s)",
        log,
    )
    for name, path in systems.items():
        on = result["systems"][name]["online"] = median_run(online_runs[name])
        off = result["systems"][name]["offline"]
        dims = plan.Dims.from_config(models.read_config(models.resolve(path)))
        # The probe's matmul is not always the fastest arithmetic here: on an EPYC torch's fp32 matmul ran
        # 182 GFLOP/s where the runtime's own fp32 loops prefilled a W4 model at ~350, and a bound must bound
        # both systems. Their own prefill rate (the linears' FLOPs alone) is at least what they reach.
        flops = max(peak, off["prefill_tok_s"] * 2 * plan.linear_params(dims))
        on["roofline"] = plan.serving_roofline(
            dims,
            [(r["arrival"], len(r["prompt"]), r["output_len"]) for r in requests],
            max_seqs(config),
            off["weight_bytes"],
            off["kv_bytes_per_token"],
            flops,
            bandwidth,
        )
        on["roofline"]["peak_flops"] = flops
        on["of_roofline"] = on["output_tok_s"] / on["roofline"]["output_tok_s"]
    for name, path in systems.items() if config.http else ():
        log(f"[bench] online over HTTP: {name} behind compress serve")
        result["systems"][name]["http"] = online_http(path, config, requests)
    result["warnings"] = busy_warnings(result)
    records.read(records.Bench, result, "the bench result")  # the shape report.py reads: checked as written
    for line in result["warnings"]:
        log(f"[bench] {line}")
    return result


def _rows(system: dict) -> dict[str, float | None]:
    """The flat figures of one system, in table order."""
    off, on = system["offline"], system["online"]
    rows = {"prefill tok/s": off["prefill_tok_s"]}
    for d in off["decode"]:
        rows[f"decode b{d['batch']} tok/s"] = d["tok_s"]
        rows[f"decode b{d['batch']} / floor"] = d["floor_ratio"]
    rows.update(
        {
            "weight MB": off["weight_bytes"] / 1e6,
            "KV bytes/token": off["kv_bytes_per_token"],
            "max batch at context": off["max_batch"],
            "peak RSS MB": off["peak_rss_bytes"] / 1e6 if off["peak_rss_bytes"] else None,
            "online output tok/s": on["output_tok_s"],
            "online / roofline": on.get("of_roofline"),
            "TTFT p50 s": on["ttft_s"]["p50"],
            "TTFT p99 s": on["ttft_s"]["p99"],
            "ITL p50 s": on["itl_s"]["p50"],
            "ITL p99 s": on["itl_s"]["p99"],
            "goodput req/s": on["goodput_req_s"],
        }
    )
    if "http" in system:
        http = system["http"]
        rows.update(
            {
                "HTTP output tok/s": http["output_tok_s"],
                "HTTP TTFT p50 s": http["ttft_s"]["p50"],
                "HTTP ITL p50 s": http["itl_s"]["p50"],
                "HTTP goodput req/s": http["goodput_req_s"],
            }
        )
    return rows


def table(result: dict) -> str:
    systems = result["systems"]
    rows = {name: _rows(s) for name, s in systems.items()}
    names = list(systems)
    header = f"{'':26}" + "".join(f"{n:>14}" for n in names) + ("       ratio" if "baseline" in systems else "")
    lines = [header]
    for key in rows[names[0]]:
        values = [rows[n][key] for n in names]
        cells = "".join(f"{v:>14.4g}" if v is not None else f"{'-':>14}" for v in values)
        ratio = ""
        if "baseline" in systems and values[0] and values[-1] is not None:
            ratio = f"{values[-1] / values[0]:>11.2f}x"
        lines.append(f"{key:26}{cells}{ratio}")
    return "\n".join(lines)
