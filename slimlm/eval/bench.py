"""`compress bench`: the speed and memory a checkpoint buys, measured against its baseline in the same run.

Offline, on the engine's model runner (no scheduler in the way):
- prefill: tokens/s of one `prefill_len`-token prompt in one forward pass;
- decode: the step at each batch size with every sequence holding `context` tokens of KV (the cache holds
  random values: a step's cost does not depend on them), as tokens/s and against the bandwidth floor, the
  bytes a step must read (the weights as stored, every sequence's KV) ÷ the copy bandwidth measured in
  this run;
- memory: weight bytes, KV bytes per token, the largest batch the KV pool holds at `context`, and the peak
  resident memory while the model was loaded and measured (Linux resets the peak per model).
Online, through the engine (with `http`, also to `compress serve` over HTTP): a seeded Poisson workload
(prompts cut from the bundled owt text, lengths uniform in `prompt_len`, outputs uniform in `output_len`,
greedy with EOS ignored): output tokens/s, TTFT and inter-token latency p50/p90/p99, and goodput, the
requests per second that met the SLO (TTFT ≤ `slo_ttft_s` and mean inter-token latency ≤ `slo_itl_s`),
and the output throughput against the workload's roofline (`plan.serving_roofline`: its arithmetic at the
matmul rate and its bytes at the copy bandwidth, both measured in this run, or its last arrival; a rate of
inf sends every request at once, which saturates the engine).
The baseline (by default the float source named in the checkpoint's slimlm.json) is measured in the same
process and every figure gets a ratio. The offline part runs in `rounds`, the baseline and the checkpoint in
turn, and keeps each timing's median over the rounds: on a shared machine a neighbour's burst can slow one
system's whole measurement (a demo run beside a test suite once reported an 88× RTN speedup from one such
baseline), and alternating rounds put both systems through the same minutes. The online workload runs in as
many rounds, in turn too, and keeps each system's run of median throughput (one run per system moved the
ratio 0.94-1.13x between two runs of one command). Each part also records how many cores other processes
(and the hypervisor) kept busy meanwhile, and the result carries a warning where that was enough to move the
ratios.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from slimlm.errors import SlimlmError
from slimlm.eval import plan


@dataclass
class BenchConfig:
    batches: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    context: int = 512
    prefill_len: int = 512
    steps: int = 5  # decode steps timed per batch size (the median is kept)
    rounds: int = 3  # measurements of each system, in turn (offline: each figure's median; online: the median run)
    kv_cache_memory: int | None = None  # None: what the largest decode batch at `context` needs
    dtype: str = "float32"
    requests: int = 24
    rate: float = 2.0  # Poisson arrivals per second
    prompt_len: tuple[int, int] = (64, 256)
    output_len: tuple[int, int] = (16, 64)
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.2
    seed: int = 0
    http: bool = False  # also send the workload to `compress serve` over HTTP


def baseline_of(model_dir: Path) -> str:
    """The float source a checkpoint names in its slimlm.json, or a one-line error saying to pass one."""
    manifest = Path(model_dir) / "slimlm.json"
    source = json.loads(manifest.read_text()).get("source_model", {}) if manifest.exists() else {}
    spec = source.get("spec") or source.get("path")
    if not spec:
        raise SlimlmError(f"{model_dir} names no source model in a slimlm.json; pass --baseline DIR")
    return spec


def pool_bytes(model: str, config: BenchConfig) -> int:
    """The KV pool: as given, or enough for the largest decode batch at `context` (4 bytes per element, the
    most any cache dtype takes) and at least 512 MiB for the online workload."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    from slimlm import models

    dims = plan.Dims.from_config(models.read_config(models.resolve(model)))
    blocks = max(config.batches) * -(-(config.context + 1) // 16) + 1  # the engine's 16-token blocks
    return max(512 << 20, blocks * 16 * plan.kv_bytes_per_token(dims, "fp32"))


def _max_seqs(config: BenchConfig) -> int:
    return max(64, max(config.batches))


def _engine(model: str, config: BenchConfig, max_len: int):
    from slimlm.runtime.engine import Engine, EngineConfig

    return Engine(model, EngineConfig(dtype=config.dtype, kv_cache_memory=pool_bytes(model, config),
                                      max_model_len=max_len, max_num_seqs=_max_seqs(config),
                                      max_num_batched_tokens=max(512, config.prefill_len)))  # fmt: skip


def _step_inputs(batch: int, context: int, block_size: int, new_tokens: int = 1):
    """Every sequence at `context` cached tokens, in its own consecutive blocks, adding `new_tokens`."""
    from slimlm.runtime.model import StepInputs

    per_seq = -(-(context + new_tokens) // block_size)
    blocks = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    positions = torch.arange(context, context + new_tokens).repeat(batch)
    slots = blocks.long().repeat_interleave(new_tokens, 0).gather(1, (positions // block_size)[:, None])[:, 0]
    return StepInputs(positions=positions, slots=slots * block_size + positions % block_size, block_tables=blocks,
                      seq_lens=torch.full((batch,), context + new_tokens, dtype=torch.int32),
                      query_start=torch.arange(0, batch * new_tokens + 1, new_tokens, dtype=torch.int32),
                      query_lens=[new_tokens] * batch)  # fmt: skip


def _peak_reset() -> int:
    """Reset the peak resident memory (Linux) and return the current resident bytes."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status("VmRSS")
    except OSError:
        return 0


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


# Other processes' load, in cores, above which a part's timings get a warning. Two CPU hogs beside a 2-core run
# slowed both systems alike (b1 ratio 3.44x against 3.51x quiet); a demo beside a test suite did not (62x).
BUSY_CORES = 0.5


def _cpu_seconds() -> tuple[float, float] | None:
    """Busy seconds of all CPUs (time the hypervisor took, steal, included) and this process's CPU seconds;
    None where /proc/stat is not there."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return busy, time.process_time()


@contextlib.contextmanager
def others_load() -> Iterator[dict]:
    """Yields a dict that holds, once the block is done, `other_cores`: the cores other processes kept busy
    while it ran, on average (None where it cannot be told)."""
    seen: dict = {"other_cores": None}
    start, first = time.perf_counter(), _cpu_seconds()
    yield seen
    wall, last = time.perf_counter() - start, _cpu_seconds()
    if first and last and wall > 0:
        seen["other_cores"] = max(0.0, (last[0] - first[0] - (last[1] - first[1])) / wall)


def busy_warnings(result: dict) -> list[str]:
    """One line per system and part whose measurement ran beside other work (BUSY_CORES or more)."""
    lines = []
    for name, system in result["systems"].items():
        for part in ("offline", "online"):
            cores = system.get(part, {}).get("other_cores") or 0.0
            if cores >= BUSY_CORES:
                lines.append(f"warning: other processes kept {cores:.1f} of {os.cpu_count()} cores busy during "
                             f"the {name}'s {part} measurement: its figures and ratios may not hold on a quiet "
                             "machine")  # fmt: skip
    return lines


@torch.inference_mode()
def offline(model: str, config: BenchConfig, bandwidth: float) -> dict:
    """Prefill, decode steps at each batch size against the bandwidth floor, and memory, for one model."""
    before = _peak_reset()
    engine = _engine(model, config, max(config.context + 1, config.prefill_len))
    runner = engine.runner
    bs = engine.config.block_size
    largest = max(config.batches)
    if runner.num_blocks < largest * -(-(config.context + 1) // bs):
        raise SlimlmError(f"the KV pool ({pool_bytes(model, config) >> 20} MiB) cannot hold batch {largest} at "
                          f"context {config.context}; raise --kv-cache-memory or lower --batch")  # fmt: skip
    cache = runner.kv_cache
    if cache.dtype.itemsize == 1:  # random finite bytes: fp8 codes below its NaN pattern, int8 anything
        cache.view(torch.uint8).random_(0, 120)
    else:
        cache.normal_()
    vocab = runner.model.config.vocab_size
    cuda = str(runner.device).startswith("cuda")

    def forward(batch: int, context: int, new: int) -> float:
        ids = torch.randint(0, vocab, (batch * new,), device=runner.device)
        step = _step_inputs(batch, context, bs, new)
        step = type(step)(**{k: v.to(runner.device) if torch.is_tensor(v) else v for k, v in asdict(step).items()})
        start = time.perf_counter()
        hidden = runner.model(ids, step, cache)
        runner.model.logits(hidden[step.query_start[1:].long() - 1])
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    forward(1, 0, config.prefill_len)  # warm-up: first calls at a shape pay one-time costs
    prefill_s = min(forward(1, 0, config.prefill_len) for _ in range(2))
    weights, per_token = runner.weight_bytes(), runner.kv_bytes_per_token
    decode = []
    for batch in config.batches:
        forward(batch, config.context, 1)
        step_s = statistics.median(forward(batch, config.context, 1) for _ in range(config.steps))
        floor = (weights + batch * config.context * per_token) / bandwidth
        decode.append({"batch": batch, "step_ms": 1e3 * step_s, "tok_s": batch / step_s, "floor_ms": 1e3 * floor,
                       "floor_ratio": step_s / floor})  # fmt: skip
    result = {"prefill_tok_s": config.prefill_len / prefill_s, "decode": decode, "weight_bytes": weights,
              "kv_bytes_per_token": per_token, "max_batch": runner.num_blocks * bs // config.context,
              "peak_rss_bytes": max(0, _status("VmHWM") - before) or None}  # fmt: skip
    return result


def workload(config: BenchConfig, tokenizer) -> list[dict]:
    """The seeded Poisson arrivals: prompts cut at random places from the owt text joined in order."""
    from slimlm.data import passages, token_stream

    rng = random.Random(config.seed)
    texts = passages("owt")
    rng.shuffle(texts)
    stream = token_stream(texts, tokenizer, max_tokens=60_000)
    t, out = 0.0, []
    for i in range(config.requests):
        t += rng.expovariate(config.rate)
        n = rng.randint(*config.prompt_len)
        start = rng.randrange(0, len(stream) - n)
        out.append({"id": f"r{i}", "arrival": t, "prompt": stream[start : start + n],
                    "output_len": rng.randint(*config.output_len)})  # fmt: skip
    return out


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


def online(model: str, config: BenchConfig, requests: list[dict]) -> dict:
    """The workload through the engine, arrivals on the wall clock: throughput, latencies, goodput."""
    from slimlm.runtime.sampling import SamplingParams

    longest = max(len(r["prompt"]) + r["output_len"] for r in requests)
    engine = _engine(model, config, longest)
    engine.add_request(requests[0]["prompt"][:16], SamplingParams(max_tokens=2, temperature=0), "warm-up")
    while engine.has_unfinished():
        engine.step(detokenize=False)
    pending, times = list(requests), {}
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0]["arrival"] <= now:
            r = pending.pop(0)
            engine.add_request(r["prompt"], SamplingParams(max_tokens=r["output_len"], temperature=0,
                                                           ignore_eos=True), r["id"])  # fmt: skip
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0]["arrival"] - (time.perf_counter() - start)))
            continue
        for out in engine.step(detokenize=False):
            if out.finished:
                times[out.request_id] = [t - start for t in out.outputs[0].token_times]
    return latency_figures(requests, times, time.perf_counter() - start, config)


def latency_figures(requests: list[dict], times: dict[str, list[float]], wall: float, config: BenchConfig) -> dict:
    """Throughput, TTFT and inter-token latency percentiles and goodput from each request's token times
    (seconds from the workload's start)."""
    ttft, itl, good = [], [], 0
    for r in requests:
        t = times[r["id"]]
        first = t[0] - r["arrival"]
        gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
        ttft.append(first)
        itl += gaps
        good += first <= config.slo_ttft_s and (not gaps or statistics.mean(gaps) <= config.slo_itl_s)
    tokens = sum(len(times[r["id"]]) for r in requests)
    return {"output_tok_s": tokens / wall, "ttft_s": _percentiles(ttft), "itl_s": _percentiles(itl),
            "goodput_req_s": good / wall, "slo_met": good / len(requests), "wall_s": wall}  # fmt: skip


@contextlib.contextmanager
def served(model: str, *options: str) -> Iterator[str]:
    """`compress serve MODEL OPTIONS` in its own process on a free port: yields its base URL."""
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "slimlm.cli", "serve", model, "--port", "0", *options]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "serving on" not in line:
            line = server.stdout.readline()
            if not line:
                raise SlimlmError(f"compress serve did not start: {server.stderr.read()[-300:].strip()}")
        yield line.split()[-1].removesuffix("/v1")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


def online_http(model: str, config: BenchConfig, requests: list[dict]) -> dict:
    """The same workload sent to `compress serve` (its own process) by an open-loop streaming client."""
    longest = max(len(r["prompt"]) + r["output_len"] for r in requests)
    pool = str(pool_bytes(model, config))
    with served(model, "--dtype", config.dtype, "--max-num-seqs", str(_max_seqs(config)),
                "--max-model-len", str(longest), "--kv-cache-memory", pool) as url:  # fmt: skip
        times, wall = http_client(url, requests)
    return latency_figures(requests, times, wall, config)


def http_client(url: str, requests: list[dict]) -> tuple[dict[str, list[float]], float]:
    """Open-loop: each request is sent at its arrival time whatever the others are doing; streamed, with
    logprobs=0 so every chunk says how many tokens it carries (a chunk's text can hold back a partial
    character); a token's time is when its chunk arrived. Returns the token times and the wall time."""
    import asyncio

    import httpx

    async def one(http, r: dict, start: float) -> list[float]:
        await asyncio.sleep(max(0.0, r["arrival"] - (time.perf_counter() - start)))
        body = {"prompt": r["prompt"], "max_tokens": r["output_len"], "temperature": 0, "ignore_eos": True,
                "stream": True, "logprobs": 0}  # fmt: skip
        times = []
        async with http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter() - start
                    times += [now] * len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
        return times

    async def run() -> tuple[dict, float]:
        limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=len(requests) + 1)
        async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
            await one(http, {"arrival": 0, "prompt": requests[0]["prompt"][:32], "output_len": 4}, 0.0)  # warm-up
            start = time.perf_counter()
            times = await asyncio.gather(*(one(http, r, start) for r in requests))
            wall = time.perf_counter() - start
        return {r["id"]: t for r, t in zip(requests, times, strict=True)}, wall

    return asyncio.run(run())


def merged(rounds: list[dict]) -> dict:
    """One system's offline figures over its rounds: the median of each timing; the peak memory of the first
    round (later ones start beside what the allocator kept of earlier engines: it read 1.3× the float model's
    for a W4 checkpoint)."""
    out = {**rounds[0], "rounds": len(rounds), "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in rounds)}
    out["other_cores"] = busiest(rounds)
    out["decode"] = []
    for i, first in enumerate(rounds[0]["decode"]):
        step_ms = statistics.median(r["decode"][i]["step_ms"] for r in rounds)
        out["decode"].append({**first, "step_ms": step_ms, "tok_s": 1e3 * first["batch"] / step_ms,
                              "floor_ratio": step_ms / first["floor_ms"]})  # fmt: skip
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

    log = (lambda msg: print(msg, flush=True)) if progress else (lambda msg: None)
    systems = {"baseline": baseline, "model": model} if baseline else {"model": model}
    for path in systems.values():  # before anything loads: a length past a model's context is the user's flag
        context = models.context_length(models.read_config(models.resolve(path)))
        for flag, tokens in (("--prefill-len", config.prefill_len), ("--context", config.context + 1),
                             ("--prompt-len and --output-len", config.prompt_len[1] + config.output_len[1])):
            if tokens > context:
                raise SlimlmError(f"{flag}: {tokens} tokens are past {path}'s context of {context}; lower it")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bandwidth, peak = plan.copy_bandwidth(device), plan.matmul_rate(config.dtype, device)
    log(f"[bench] copy bandwidth {bandwidth / 1e9:.1f} GB/s, {config.dtype} matmul {peak / 1e9:.0f} GFLOP/s")
    result = {"config": asdict(config), "bandwidth_bytes_s": bandwidth, "matmul_flops": peak,
              "threads": torch.get_num_threads(),
              "systems": {name: {"path": path} for name, path in systems.items()}}  # fmt: skip
    runs = in_turns(systems, config.rounds, lambda path: offline(path, config, bandwidth), "offline", log)
    for name, rounds in runs.items():
        result["systems"][name]["offline"] = merged(rounds)
    tokenizer = models.load_tokenizer(models.resolve(model))
    requests = workload(config, tokenizer)
    online_runs = in_turns(systems, config.rounds, lambda path: online(path, config, requests),
                           f"online ({config.requests} requests at {config.rate}/s)", log)  # fmt: skip
    for name, path in systems.items():
        on = result["systems"][name]["online"] = median_run(online_runs[name])
        off = result["systems"][name]["offline"]
        dims = plan.Dims.from_config(models.read_config(models.resolve(path)))
        # The probe's matmul is not always the fastest arithmetic here: on an EPYC torch's fp32 matmul ran
        # 182 GFLOP/s where the runtime's own fp32 loops prefilled a W4 model at ~350, and a bound must bound
        # both systems. Their own prefill rate (the linears' FLOPs alone) is at least what they reach.
        flops = max(peak, off["prefill_tok_s"] * 2 * plan.linear_params(dims))
        on["roofline"] = plan.serving_roofline(
            dims, [(r["arrival"], len(r["prompt"]), r["output_len"]) for r in requests], _max_seqs(config),
            off["weight_bytes"], off["kv_bytes_per_token"], flops, bandwidth)  # fmt: skip
        on["roofline"]["peak_flops"] = flops
        on["of_roofline"] = on["output_tok_s"] / on["roofline"]["output_tok_s"]
    for name, path in systems.items() if config.http else ():
        log(f"[bench] online over HTTP: {name} behind compress serve")
        result["systems"][name]["http"] = online_http(path, config, requests)
    result["warnings"] = busy_warnings(result)
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
    rows.update({"weight MB": off["weight_bytes"] / 1e6, "KV bytes/token": off["kv_bytes_per_token"],
                 "max batch at context": off["max_batch"],
                 "peak RSS MB": off["peak_rss_bytes"] / 1e6 if off["peak_rss_bytes"] else None,
                 "online output tok/s": on["output_tok_s"], "online / roofline": on.get("of_roofline"),
                 "TTFT p50 s": on["ttft_s"]["p50"],
                 "TTFT p99 s": on["ttft_s"]["p99"], "ITL p50 s": on["itl_s"]["p50"], "ITL p99 s": on["itl_s"]["p99"],
                 "goodput req/s": on["goodput_req_s"]})  # fmt: skip
    if "http" in system:
        http = system["http"]
        rows.update({"HTTP output tok/s": http["output_tok_s"], "HTTP TTFT p50 s": http["ttft_s"]["p50"],
                     "HTTP ITL p50 s": http["itl_s"]["p50"], "HTTP goodput req/s": http["goodput_req_s"]})  # fmt: skip
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
