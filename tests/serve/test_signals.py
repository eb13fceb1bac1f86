"""`compress serve` as a process: SIGTERM drains (new requests get 503, the running one finishes), exit 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest


def test_sigterm_lets_running_requests_finish_then_exits_0(smollm2):
    # The real model: the tiny one's 300 tokens could finish (and the server exit) before the checks below ran
    # No wall-clock budget decides the outcome: the drain waits as long as the request takes (--drain-timeout),
    # and each wait below is for an event the server shows (a token streamed, /health turning 503, the exit);
    # their limits only catch a hang.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slimlm.cli",
            "serve",
            str(smollm2),
            "--port",
            "0",
            "--kv-cache-memory",
            "64M",
            "--max-model-len",
            "512",
            "--drain-timeout",
            "600",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        line = ""
        while "serving on" not in line:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
        url = line.split()[-1].removesuffix("/v1")
        pieces, started = [], threading.Event()

        def stream() -> None:
            body = {"prompt": "the city", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        pieces.append(json.loads(line[6:])["choices"][0])
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(300)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 300
        while httpx.get(f"{url}/health").status_code != 503:  # the signal lands asynchronously
            assert time.monotonic() < deadline
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        streamed = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert streamed.status_code == 503  # refused before a stream starts, not an error event inside one
        reader.join(600)
        assert pieces[-1]["finish_reason"] == "length"  # the running request was not cut
        assert proc.wait(300) == 0
    finally:
        proc.kill()


@pytest.mark.parametrize("after", ["spawn", "max context", "serving on"])
def test_sigterm_at_any_point_of_start_up_stops_the_server(tiny_llama, after):
    """A signal that comes before the server runs is remembered, not dropped: the process exits (0 once the
    handler is in place) and nothing answers on its port afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "slimlm.cli", "serve", str(tiny_llama), "--port", "0", "--kv-cache-memory", "8M"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        line = ""
        while after != "spawn" and after not in line:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(300)
        assert code == 0 if after != "spawn" else code in (0, 130, -signal.SIGTERM), proc.stderr.read()
        if after == "serving on":
            with pytest.raises(httpx.ConnectError):
                httpx.get(line.split()[-1].removesuffix("/v1") + "/health")
    finally:
        proc.kill()
