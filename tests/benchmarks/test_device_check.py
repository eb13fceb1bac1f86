"""The GPU check must run end to end before a GPU session spends its minutes on it."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_device_check_dry_run_exercises_every_stage(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        ["bash", "benchmarks/device_check.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["dry_run"] and report["correctness"] and report["gemm"] and report["decode_attention"]
    assert all(r["rel_err"] < 2e-2 for r in report["correctness"])
    assert "W4A16 ÷ bf16 cuBLAS" in run.stdout
