"""`compress bench` on the tiny model: the synthetic decode layout is a real one (its logits equal
transformers'), the offline and online figures are consistent, the baseline comes from slimlm.json and
gets a ratio column, goodput follows the SLO, bad input is named."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from slimlm import SlimlmError
from slimlm.cli import main
from slimlm.eval import plan
from slimlm.perf import bench
from slimlm.perf.config import BenchConfig, baseline_of, pool_bytes
from slimlm.perf.http import online_http
from slimlm.perf.load import busy_warnings, others_load
from slimlm.perf.offline import offline, resident_batch
from slimlm.perf.workload import online, percentiles, workload

SMALL = BenchConfig(
    batch=[1, 3],
    context=40,
    prefill_len=32,
    steps=2,
    kv_cache_memory=4 << 20,
    requests=5,
    rate=50.0,
    prompt_len=(8, 16),
    output_len=(3, 6),
)


@torch.inference_mode()
def test_the_resident_batch_computes_what_transformers_does(tiny_llama):
    """Prefill 40 tokens into each of 3 sequences' blocks, then one decode step at context 40, both through the
    runner's own input builder: each sequence's logits equal transformers' on its 41 tokens, so the timed
    steps do real attention work."""
    from transformers import AutoModelForCausalLM

    from slimlm.runtime.engine import Engine, EngineConfig
    from slimlm.runtime.scheduler import Batch, ScheduledSeq

    runner = Engine(str(tiny_llama), EngineConfig(kv_cache_memory=4 << 20, max_model_len=64)).runner
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    decode = resident_batch(3, 40, runner.block_size, 1, vocab=hf.config.vocab_size)
    prefill = Batch([ScheduledSeq(dataclasses.replace(item.seq, num_computed=0), 40) for item in decode.items])
    runner.model(*runner.inputs(prefill), runner.kv_cache)
    hidden = runner.model(*runner.inputs(decode), runner.kv_cache)
    ids = torch.tensor([item.seq.token_ids for item in decode.items])
    expected = hf(ids).logits[:, -1]
    assert torch.allclose(runner.model.logits(hidden), expected, atol=1e-4)


def test_offline_figures_are_consistent(tiny_llama):
    result = offline(str(tiny_llama), SMALL, bandwidth=10e9)
    assert [d["batch"] for d in result["decode"]] == [1, 3] and result["prefill_tok_s"] > 0
    for d in result["decode"]:
        assert d["tok_s"] == pytest.approx(d["batch"] * 1e3 / d["step_ms"])
        floor = (result["weight_bytes"] + d["batch"] * 40 * result["kv_bytes_per_token"]) / 10e9
        assert d["floor_ms"] == pytest.approx(1e3 * floor)
        assert d["floor_ratio"] == pytest.approx(d["step_ms"] / d["floor_ms"])
    assert result["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # layers · K/V · KV heads · head_dim · fp32
    assert result["max_batch"] == (4 << 20) // (result["kv_bytes_per_token"] * 16) * 16 // 40


def test_the_workload_is_seeded_and_the_online_run_serves_it_all(tiny_llama):
    from slimlm import models

    tokenizer = models.load_tokenizer(tiny_llama)
    requests = workload(SMALL, tokenizer)
    assert requests == workload(SMALL, tokenizer) and len(requests) == 5
    assert all(8 <= len(r["prompt"]) <= 16 and 3 <= r["output_len"] <= 6 for r in requests)
    assert all(a["arrival"] < b["arrival"] for a, b in zip(requests, requests[1:], strict=False))
    result = online(str(tiny_llama), SMALL, requests)
    total = sum(r["output_len"] for r in requests)
    assert result["output_tok_s"] == pytest.approx(total / result["wall_s"])
    assert result["ttft_s"]["p50"] <= result["ttft_s"]["p99"] and result["slo_met"] == 1.0
    strict = online(str(tiny_llama), BenchConfig(**{**SMALL.__dict__, "slo_ttft": 1e-9}), requests)
    assert strict["goodput_req_s"] == 0 and strict["slo_met"] == 0


def test_percentiles():
    values = [float(v) for v in range(1, 101)]
    assert percentiles(values) == {"p50": pytest.approx(50.5), "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}
    assert percentiles([2.0]) == {"p50": 2.0, "p90": 2.0, "p99": 2.0}


def test_rounds_keep_the_median_of_each_figure():
    def run(prefill, steps, peak):
        return {
            "prefill_tok_s": prefill,
            "peak_rss_bytes": peak,
            "weight_bytes": 10,
            "decode": [
                {"batch": b, "step_ms": ms, "tok_s": 1e3 * b / ms, "floor_ms": 2.0, "floor_ratio": ms / 2}
                for b, ms in steps
            ],
        }

    disturbed = run(2.0, [(1, 400.0), (8, 900.0)], None)  # a neighbour's burst through one whole round
    merged = bench.merged([run(100.0, [(1, 4.0), (8, 10.0)], 50), disturbed, run(120.0, [(1, 5.0), (8, 12.0)], 70)])
    assert merged["rounds"] == 3 and merged["weight_bytes"] == 10
    assert merged["prefill_tok_s"] == 100.0 and merged["peak_rss_bytes"] == 50  # the first round's
    assert [(d["batch"], d["step_ms"], d["floor_ratio"]) for d in merged["decode"]] == [(1, 5.0, 2.5), (8, 12.0, 6.0)]
    assert [d["tok_s"] for d in merged["decode"]] == pytest.approx([200.0, 8e3 / 12])


def test_online_rounds_keep_the_run_of_median_throughput_whole():
    runs = [
        {"output_tok_s": tok_s, "ttft_s": {"p50": ttft}, "other_cores": load}
        for tok_s, ttft, load in ((500.0, 1.0, 0.1), (90.0, 9.0, 1.2), (520.0, 0.9, None))
    ]
    kept = bench.median_run(runs)
    assert kept["output_tok_s"] == 500.0 and kept["ttft_s"] == {"p50": 1.0}  # its own latencies, not a mix
    assert kept["rounds_output_tok_s"] == [500.0, 90.0, 520.0] and kept["other_cores"] == 1.2
    assert "rounds_output_tok_s" not in runs[0]  # the runs themselves stay as they were


def test_the_busiest_round_sets_the_load_beside_it():
    rounds = [{"prefill_tok_s": 1.0, "decode": [], "other_cores": c} for c in (0.1, 1.4, None)]
    assert bench.merged(rounds)["other_cores"] == 1.4
    assert bench.merged([{**r, "other_cores": None} for r in rounds])["other_cores"] is None


def test_other_processes_load_is_measured_and_warned_about():
    import subprocess
    import sys

    with others_load() as idle:
        pass
    assert idle["other_cores"] is not None and idle["other_cores"] >= 0
    spin = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    with others_load() as load:
        subprocess.run([sys.executable, "-c", spin], check=True)  # another process, busy while we wait
    assert load["other_cores"] >= 0.5  # one spinning core (less what a startup in sleep costs), at least half
    quiet = {"offline": {"other_cores": 0.2}, "online": {"other_cores": None}}
    result = {
        "systems": {"baseline": {"offline": {"other_cores": 1.6}, "online": {"other_cores": 0.1}}, "model": quiet}
    }
    (line,) = busy_warnings(result)
    assert line.startswith("warning: other processes kept 1.6 of") and "the baseline's offline measurement" in line


def test_the_command_measures_the_source_beside_a_checkpoint(tiny_llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plan, "matmul_rate", lambda *args: 1.0)  # a probe slower than the models' own kernels
    out = tmp_path / "w4"
    assert main(["rtn", "--model", str(tiny_llama), "--group-size", "32", "--out", str(out)]) == 0
    capsys.readouterr()
    assert baseline_of(out) == str(tiny_llama)
    args = [
        "bench",
        str(out),
        "--batch",
        "1,2",
        "--context",
        "32",
        "--prefill-len",
        "16",
        "--requests",
        "3",
        "--rate",
        "inf",
        "--prompt-len",
        "8,12",
        "--output-len",
        "2,4",
        "--kv-cache-memory",
        "4M",
        "--rounds",
        "2",
        "--json",
        str(tmp_path / "bench.json"),
    ]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "ratio" in table and "decode b2 / floor" in table and "goodput req/s" in table
    result = json.loads((tmp_path / "bench.json").read_text())
    assert set(result["systems"]) == {"baseline", "model"} and result["systems"]["baseline"]["path"] == str(tiny_llama)
    assert all(result["systems"][n]["offline"]["rounds"] == 2 for n in ("model", "baseline"))
    for n in ("model", "baseline"):  # the online workload in as many rounds: the run of median throughput kept
        on = result["systems"][n]["online"]
        assert len(on["rounds_output_tok_s"]) == 2 and on["output_tok_s"] == max(on["rounds_output_tok_s"])
    parts = [result["systems"][n][p] for n in ("model", "baseline") for p in ("offline", "online")]
    assert all(part["other_cores"] >= 0 for part in parts)
    assert result["warnings"] == busy_warnings(result)
    w4, base = (result["systems"][n]["offline"]["weight_bytes"] for n in ("model", "baseline"))
    assert w4 < base  # the packed linears read fewer bytes
    assert "online / roofline" in table and result["matmul_flops"] > 0
    for name in ("model", "baseline"):  # the roofline of each system's own bytes; every request sent at once
        on, off = result["systems"][name]["online"], result["systems"][name]["offline"]
        assert on["roofline"]["arrivals_s"] == 0 and on["roofline"]["bytes"] >= 4 * off["weight_bytes"]
        assert on["of_roofline"] == pytest.approx(on["output_tok_s"] / on["roofline"]["output_tok_s"])
        # the arithmetic bound holds for the system's own kernels too: at least the rate its prefill reached
        dims = plan.Dims.from_config(json.loads((Path(result["systems"][name]["path"]) / "config.json").read_text()))
        assert on["roofline"]["peak_flops"] == pytest.approx(off["prefill_tok_s"] * 2 * plan.linear_params(dims))


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--prompt-len", "9,3"], "--prompt-len: '9,3': give LO,HI with LO <= HI"),
        (["--batch", "1,x"], "--batch: '1,x'"),
        (["--rate", "0"], "must be positive"),
        (["--rate", "nan"], "must be positive"),
        (["--slo-itl", "-1"], "must be positive"),
    ],
)
def test_bad_flags_are_refused_by_the_parser(tiny_llama, capsys, args, fragment):
    with pytest.raises(SystemExit) as e:
        main(["bench", str(tiny_llama), "--baseline", "none", *args])
    assert e.value.code == 2 and fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--batch", "4096", "--context", "64", "--kv-cache-memory", "1M"], "cannot hold batch 4096"),
        (["--context", "512"], "--context: 513 tokens are past"),
        (
            ["--context", "64", "--prompt-len", "300,400", "--output-len", "100,200"],
            "--prompt-len and --output-len: 600 tokens are past",
        ),
    ],
)
def test_bad_input_is_one_line(tiny_llama, capsys, args, fragment):
    assert main(["bench", str(tiny_llama), "--baseline", "none", *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


def test_rounds_must_be_a_positive_integer(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "smollm2-135m", "--rounds", "0"])
    assert e.value.code == 2 and "argument --rounds: '0' must be a positive integer" in capsys.readouterr().err


def test_a_checkpoint_without_a_source_needs_a_baseline(tmp_path):
    (tmp_path / "slimlm.json").write_text("{}")
    with pytest.raises(SlimlmError, match="pass baseline DIR"):
        baseline_of(tmp_path)


def test_the_workload_over_http_gets_every_token(tiny_llama):
    from slimlm import models

    requests = workload(SMALL, models.load_tokenizer(tiny_llama))[:3]
    result = online_http(str(tiny_llama), SMALL, requests)
    assert result["output_tok_s"] == pytest.approx(sum(r["output_len"] for r in requests) / result["wall_s"])
    assert 0 < result["ttft_s"]["p50"] <= result["ttft_s"]["p99"] and result["slo_met"] == 1.0


def test_the_default_pool_holds_the_largest_batch(tiny_llama):
    per_token = 2 * 2 * 2 * 16 * 4  # the tiny model's fp32 KV per token
    assert pool_bytes(str(tiny_llama), BenchConfig(batch=[1, 8], context=40)) == 512 << 20
    big = BenchConfig(batch=[100_000], context=40)
    assert pool_bytes(str(tiny_llama), big) == (100_000 * 3 + 1) * 16 * per_token
    assert pool_bytes(str(tiny_llama), BenchConfig(kv_cache_memory=1 << 20)) == 1 << 20
