"""The records eval and bench write and report reads: one definition, a wrong file refused by its field."""

import json

import pytest

from slimlm.errors import SlimlmError
from slimlm.eval import records, report

STEP = {"batch": 1, "step_ms": 10.0, "tok_s": 100.0, "floor_ms": 5.0, "floor_ratio": 2.0}
LATENCY = {"p50": 0.1, "p90": 0.2, "p99": 0.3}
ONLINE = {
    "output_tok_s": 50.0,
    "ttft_s": LATENCY,
    "itl_s": LATENCY,
    "goodput_req_s": 1.0,
    "slo_met": 1.0,
    "wall_s": 9.0,
}
OFFLINE = {
    "prefill_tok_s": 900.0,
    "decode": [STEP],
    "weight_bytes": 1000,
    "kv_bytes_per_token": 10,
    "max_batch": 4,
    "peak_rss_bytes": None,
}


def bench(**model) -> dict:
    return {
        "config": {"context": 100},
        "bandwidth_bytes_s": 1e10,
        "matmul_flops": 1e11,
        "threads": 2,
        "systems": {"model": {"path": "m", "offline": OFFLINE, "online": ONLINE, **model}},
    }


def test_a_bench_record_keeps_every_figure_and_reads_as_attributes():
    data = bench(extra_figure=7)
    record = records.read(records.Bench, data, "x")
    assert record.systems["model"].offline.decode[0].floor_ratio == 2.0 and record.warnings == []
    assert record.systems["model"].model_dump()["extra_figure"] == 7  # a writer's further figures are kept


def test_a_run_whose_bench_json_lacks_a_figure_is_refused_by_name(tmp_path):
    data = bench()
    del data["systems"]["model"]["online"]["goodput_req_s"]
    (tmp_path / "bench.json").write_text(json.dumps(data))
    with pytest.raises(SlimlmError) as e:
        report.load_run(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / 'bench.json'} is not a bench record: systems.model.online.goodput_req_s: Field required"
    )
    data["systems"]["model"]["online"]["goodput_req_s"] = 2.0
    (tmp_path / "bench.json").write_text(json.dumps(data))
    run = report.load_run(tmp_path)
    assert (run["goodput_req_s"], run["mb_per_token"], run["floors"][0]["ratio"]) == (2.0, 1000 / 1e6 + 1000 / 1e6, 2.0)
