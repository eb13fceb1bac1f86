"""Serving benchmark: slimlm's runtime vs transformers on the same seeded Poisson workload, same run.

Workload: `--requests` requests arriving as a Poisson process at `--rate` per second; prompt lengths
uniform in `--prompt-len`, output lengths uniform in `--output-len` (every request generates exactly its
length: EOS is ignored by all systems). Prompts are real text (the bundled owt passages).
Systems, each in its own process (so peak memory is its own):
  slimlm      the bundled runtime (continuous batching, chunked prefill, paged KV)
  hf-static   transformers generate() in static batches of --hf-batch, in arrival order, left-padded; a batch
              starts when its last request has arrived and the previous batch is done, and runs until its
              longest request ends
  hf-cb       transformers' own continuous batching (generate_batch's manager), requests added on arrival
  slimlm-http the same runtime behind `compress serve` (its own process, on loopback), driven by an async
              client: open-loop arrivals, streaming, token times taken when each chunk reaches the client
TTFT is measured from each request's scheduled arrival. Then the decode step of the runtime at batch 1, 8
and 32 against the memory-bandwidth floor: bytes that must move per step (weights + KV read) ÷ the
bandwidth of a large tensor copy measured in the same run.

    .venv/bin/python benchmarks/serve_vs_hf.py [--requests 64 --rate 2 ...]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

MODEL = "smollm2-135m"


def workload(args) -> list[dict]:
    from slimlm import models
    from slimlm.data import passages, token_stream

    rng = random.Random(args.seed)
    tok = models.load_tokenizer(models.resolve(MODEL))
    texts = passages("owt")
    rng.shuffle(texts)
    stream = token_stream(texts, tok, max_tokens=60_000)
    t, requests = 0.0, []
    lo, hi = args.prompt_len
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        n = rng.randint(lo, hi)
        start = rng.randrange(0, len(stream) - n)
        requests.append(
            {
                "id": f"r{i}",
                "arrival": t,
                "prompt": stream[start : start + n],
                "output_len": rng.randint(*args.output_len),
            }
        )
    return requests


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


# ---- systems (each runs in a worker process) -----------------------------------------------------


def slimlm_engine(dtype: str):
    from slimlm.runtime.engine import Engine, EngineConfig

    return Engine(MODEL, EngineConfig(dtype=dtype, max_num_seqs=64, max_num_batched_tokens=512))


def run_slimlm(requests: list[dict], dtype: str) -> dict:
    from slimlm.runtime.sampling import SamplingParams

    engine = slimlm_engine(dtype)
    warm = engine.add_request(requests[0]["prompt"][:32], SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished():
        engine.step()
    del warm
    pending = list(requests)
    start = time.perf_counter()
    times: dict[str, list[float]] = {}
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0]["arrival"] <= now:
            r = pending.pop(0)
            params = SamplingParams(max_tokens=r["output_len"], temperature=0, ignore_eos=True)
            engine.add_request(r["prompt"], params, r["id"])
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0]["arrival"] - (time.perf_counter() - start)))
            continue
        for out in engine.step():
            if out.finished:
                times[out.request_id] = [t - start for t in out.outputs[0].token_times]
    return {"token_times": times, "decode_steps": decode_steps(engine, requests)}


def decode_steps(engine, requests: list[dict], context: int = 256, steps: int = 12) -> dict:
    """Median time of a pure decode step with `batch` sequences of `context` tokens each."""
    from slimlm.runtime.sampling import SamplingParams

    result = {}
    for batch in (1, 8, 32):
        for i in range(batch):
            prompt = requests[i % len(requests)]["prompt"][:context]
            params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
            engine.add_request(prompt, params, f"d{batch}-{i}")
        while engine.stats().prefilling:
            engine.step()  # prefill everything first
        samples = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            samples.append(time.perf_counter() - t)
        seq_len = engine.stats().mean_context
        for i in range(batch):
            engine.abort(f"d{batch}-{i}")
        result[batch] = {"step_s": statistics.median(samples), "context": seq_len}
    return result


def run_slimlm_http(requests: list[dict], dtype: str) -> dict:
    """`compress serve` as its own process (engine settings as above), this process as the client."""
    from slimlm.perf.http import served

    with served(MODEL, "--dtype", dtype, "--max-num-seqs", "64", "--max-num-batched-tokens", "512") as url:
        return http_client(url, requests)


def http_client(url: str, requests: list[dict]) -> dict:
    """`compress bench`'s open-loop streaming client."""
    from slimlm.perf.http import http_client as client

    return {"token_times": client(url, requests)[0]}


def run_hf_static(requests: list[dict], dtype: str, batch: int) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    from slimlm import models

    model, tok, _ = models.load(MODEL, dtype=getattr(torch, dtype))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    class StepClock(LogitsProcessor):
        """Called once per generated token of the batch: when each step's logits exist."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(group: list[dict], clock: StepClock) -> None:
        width = max(len(r["prompt"]) for r in group)
        ids = torch.tensor([[pad] * (width - len(r["prompt"])) + r["prompt"] for r in group])
        mask = torch.tensor([[0] * (width - len(r["prompt"])) + [1] * len(r["prompt"]) for r in group])
        longest = max(r["output_len"] for r in group)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([clock]),
            )

    generate([{"prompt": requests[0]["prompt"][:32], "output_len": 4}], StepClock())  # warm-up
    start = time.perf_counter()
    times = {}
    for i in range(0, len(requests), batch):
        group = requests[i : i + batch]
        wait = group[-1]["arrival"] - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        clock = StepClock()
        generate(group, clock)
        for r in group:
            times[r["id"]] = [t - start for t in clock.times[: r["output_len"]]]
    return {"token_times": times}


def run_hf_cb(requests: list[dict], dtype: str) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from slimlm import models

    model, tok, _ = models.load(MODEL, dtype=getattr(torch, dtype))
    config = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=max(r["output_len"] for r in requests))
    # sized like slimlm's engine (512 MiB of KV, 512 tokens per step); its default takes a share of all RAM
    blocks = (512 << 20) // (kv_bytes_per_token(dtype) * 32)
    cb = ContinuousBatchingConfig(num_blocks=blocks, block_size=32, max_batch_tokens=512)
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
    manager.start()
    manager.add_request(requests[0]["prompt"][:32], request_id="warm", max_new_tokens=4)
    manager.get_result("warm", timeout=600)
    start = time.perf_counter()
    for r in requests:
        wait = r["arrival"] - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        manager.add_request(r["prompt"], request_id=r["id"], max_new_tokens=r["output_len"], record_timestamps=True)
    times = {}
    while len(times) < len(requests):  # results come in completion order
        out = manager.get_result(timeout=3600)
        if out is None or out.error:
            raise RuntimeError(f"transformers continuous batching failed: {out and out.error}")
        times[out.request_id] = [t - start for t in out.timestamps]
    manager.stop()
    return {"token_times": times}


def worker(system: str, workload_path: str, dtype: str, hf_batch: int) -> None:
    torch.set_num_threads(torch.get_num_threads())
    requests = json.loads(Path(workload_path).read_text())
    t = time.perf_counter()
    if system == "slimlm":
        result = run_slimlm(requests, dtype)
    elif system == "slimlm-http":
        result = run_slimlm_http(requests, dtype)
    elif system == "hf-static":
        result = run_hf_static(requests, dtype, hf_batch)
    else:
        result = run_hf_cb(requests, dtype)
    result["wall_s"] = time.perf_counter() - t
    result["peak_rss_gb"] = peak_rss_gb()
    print("RESULT " + json.dumps(result))


# ---- analysis --------------------------------------------------------------------------------------


def summarize(requests: list[dict], result: dict) -> dict:
    ttft, itl, last = [], [], 0.0
    for r in requests:
        times = result["token_times"][r["id"]]
        assert len(times) == r["output_len"], (r["id"], len(times), r["output_len"])
        ttft.append(times[0] - r["arrival"])
        itl += [b - a for a, b in zip(times, times[1:], strict=False)]
        last = max(last, times[-1])
    tokens = sum(r["output_len"] for r in requests)

    def pct(xs, q):
        return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]

    return {
        "output_tok_s": tokens / last,
        "makespan_s": last,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_mean_ms": 1e3 * statistics.mean(itl),
        "itl_p50_ms": 1e3 * pct(itl, 50),
        "itl_p99_ms": 1e3 * pct(itl, 99),
        "peak_rss_gb": result["peak_rss_gb"],
    }


def http_vs_offline(offline: dict, http: dict) -> None:
    """What HTTP (server, SSE, client) adds to the same workload, and the issue's targets."""
    print(
        "\nHTTP vs offline, same workload: "
        + ", ".join(
            f"{k.replace('_', ' ')} +{(1e3 if k.endswith('_s') else 1) * (http[k] - offline[k]):.1f} ms"
            for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms")
        )
    )
    cost = 1 - http["output_tok_s"] / offline["output_tok_s"]
    added = 1e3 * (http["ttft_p50_s"] - offline["ttft_p50_s"])
    print(
        f"target: HTTP costs ≤ 5% throughput and adds ≤ 20 ms p50 TTFT: {cost:.1%}, {added:+.1f} ms -> "
        f"{'met' if cost <= 0.05 and added <= 20 else 'missed'}"
    )


def copy_bandwidth() -> float:
    """GB/s of a 256 MiB tensor copy (bytes read + written): `compress plan`'s probe."""
    from slimlm.eval.plan import copy_bandwidth as probe

    return probe() / 1e9


def weight_bytes(dtype: str) -> int:
    """Bytes of every weight a decode step reads: all linears, the norms, and the (tied) LM head once."""
    from slimlm import models

    config = models.read_config(models.resolve(MODEL))
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return (layers * per_layer + h + config["vocab_size"] * h) * getattr(torch, dtype).itemsize


def kv_bytes_per_token(dtype: str) -> int:
    from slimlm import models

    c = models.read_config(models.resolve(MODEL))
    return (
        c["num_hidden_layers"]
        * 2
        * c["num_key_value_heads"]
        * (c["hidden_size"] // c["num_attention_heads"])
        * (getattr(torch, dtype).itemsize)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--prompt-len", type=lambda s: tuple(map(int, s.split(","))), default=(64, 512))
    parser.add_argument("--output-len", type=lambda s: tuple(map(int, s.split(","))), default=(32, 256))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--systems", default="slimlm,hf-static,hf-cb")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each system, interleaved; medians reported")
    parser.add_argument("--json", help="write everything here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.workload, args.dtype, args.hf_batch)

    requests = workload(args)
    path = Path("out/serve_vs_hf-workload.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(requests))
    in_tokens = sum(len(r["prompt"]) for r in requests)
    out_tokens = sum(r["output_len"] for r in requests)
    last = requests[-1]["arrival"]
    print(
        f"workload: {len(requests)} requests, Poisson {args.rate}/s (last arrives at {last:.1f} s), "
        f"prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens ({in_tokens} in all), outputs "
        f"{args.output_len[0]}-{args.output_len[1]} ({out_tokens}), seed {args.seed}, {args.dtype}, "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    results, runs = {}, {}
    for repeat in range(args.repeats):  # interleaved, so a slow patch of a shared machine hits every system
        for system in args.systems.split(","):
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                system,
                "--workload",
                str(path),
                "--dtype",
                args.dtype,
                "--hf-batch",
                str(args.hf_batch),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                print(f"{system}: failed ({reason})", flush=True)
                continue
            results[system] = json.loads(line[0][len("RESULT ") :])
            s = summarize(requests, results[system])
            runs.setdefault(system, []).append(s)
            wall = results[system]["wall_s"]
            print(
                f"{system} (run {repeat + 1}): {s['output_tok_s']:.1f} output tok/s, TTFT p50 "
                f"{s['ttft_p50_s']:.2f} s, ITL p50 {s['itl_p50_ms']:.0f} ms (wall {wall:.0f} s)",
                flush=True,
            )
    summary = {system: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for system, rs in runs.items()}
    if args.repeats > 1:
        print(f"\n(medians over {args.repeats} runs of each system)")

    base = "hf-static"
    print(
        f"\n{'system':<11}{'out tok/s':>10}{'TTFT mean':>11}{'p50':>9}{'p99':>9}{'ITL mean':>10}{'p50':>8}{'p99':>8}"
        f"{'peak GB':>9}{'tok/s ÷ ' + base:>18}{'TTFT p50 ÷':>12}"
    )
    for system, s in summary.items():
        ratio = s["output_tok_s"] / summary[base]["output_tok_s"] if base in summary else float("nan")
        tratio = s["ttft_p50_s"] / summary[base]["ttft_p50_s"] if base in summary else float("nan")
        print(
            f"{system:<11}{s['output_tok_s']:>10.1f}{s['ttft_mean_s']:>10.2f}s{s['ttft_p50_s']:>8.2f}s"
            f"{s['ttft_p99_s']:>8.2f}s{s['itl_mean_ms']:>8.0f}ms{s['itl_p50_ms']:>6.0f}ms{s['itl_p99_ms']:>6.0f}ms"
            f"{s['peak_rss_gb']:>9.2f}{ratio:>17.2f}×{tratio:>11.2f}×"
        )

    floor = {}
    if "slimlm" in results:
        bandwidth = copy_bandwidth()
        weights, kv = weight_bytes(args.dtype), kv_bytes_per_token(args.dtype)
        print(
            f"\ndecode step vs memory-bandwidth floor (copy bandwidth {bandwidth:.1f} GB/s, weights "
            f"{weights / 1e6:.0f} MB, KV {kv / 1e3:.1f} kB/token):"
        )
        print(f"{'batch':>6}{'context':>9}{'step ms':>9}{'floor ms':>10}{'÷ floor':>9}{'tok/s':>8}")
        for batch, d in results["slimlm"]["decode_steps"].items():
            moved = weights + int(batch) * d["context"] * kv
            floor_s = moved / (bandwidth * 1e9)
            floor[batch] = {**d, "bytes": moved, "floor_s": floor_s, "ratio": d["step_s"] / floor_s}
            print(
                f"{batch:>6}{d['context']:>9.0f}{d['step_s'] * 1e3:>9.1f}{floor_s * 1e3:>10.1f}"
                f"{d['step_s'] / floor_s:>8.2f}×{int(batch) / d['step_s']:>8.0f}"
            )
        if base in summary:
            r = summary["slimlm"]["output_tok_s"] / summary[base]["output_tok_s"]
            t = summary["slimlm"]["ttft_p50_s"] <= summary[base]["ttft_p50_s"]
            print(
                f"\ntarget: throughput ≥ 5× {base} at equal or better p50 TTFT: {r:.2f}×, TTFT "
                f"{'better or equal' if t else 'worse'} -> {'met' if r >= 5 and t else 'missed'}"
            )
        if "slimlm-http" in summary:
            http_vs_offline(summary["slimlm"], summary["slimlm-http"])
        b1 = floor.get("1") or floor.get(1)
        verdict = "met" if b1["ratio"] <= 2 else "missed"
        print(f"target: decode step ≤ 2× floor at batch 1: {b1['ratio']:.2f}× -> {verdict}")
    if args.json:
        everything = {"args": vars(args), "summary": summary, "runs": runs, "decode_floor": floor}
        Path(args.json).write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
