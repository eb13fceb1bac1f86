"""What else the machine is doing while a part is timed, and the peak memory of a model's measurement."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path


def peak_reset() -> int:
    """Reset the peak resident memory (Linux) and return the current resident bytes."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return status("VmRSS")
    except OSError:
        return 0


def status(key: str) -> int:
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
                lines.append(
                    f"warning: other processes kept {cores:.1f} of {os.cpu_count()} cores busy during "
                    f"the {name}'s {part} measurement: its figures and ratios may not hold on a quiet "
                    "machine"
                )
    return lines
