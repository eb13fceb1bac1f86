"""Run a command under a hard memory cap (a cgroup's memory limit) and report whether it finished and its peak.

The product's larger-than-memory claims are checked this way: a job that holds more than the cap is killed by
the kernel (exit -9, an oom_kill counted), one that streams its weights finishes. Needs a writable cgroup
memory controller (v2: /sys/fs/cgroup with "memory" in cgroup.subtree_control; v1: /sys/fs/cgroup/memory), as
root in a container or a VM; elsewhere it says so and exits 3.

    .venv/bin/python benchmarks/memory_cap.py --cap 4G --json out.json -- \\
        .venv/bin/compress kv qwen2.5-coder-1.5b --kv-dtype fp8 --compute-dtype float32 --out /tmp/kv --overwrite

The cgroup's peak counts the page cache its reads fill (reclaimable: the kernel drops it before it kills
anything), so the child's own peak resident size (getrusage's ru_maxrss) is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path

from slimlm.jobs.options import parse_size  # the sizes --kv-cache-memory takes

V2, V1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")


def _controller() -> tuple[Path, dict[str, str]] | None:
    """The directory new groups go under and the names of its limit, peak and OOM files, or None."""
    subtree = V2 / "cgroup.subtree_control"
    if subtree.exists() and "memory" in subtree.read_text().split():
        return V2, {"limit": "memory.max", "peak": "memory.peak", "events": "memory.events"}
    if (V1 / "memory.limit_in_bytes").exists():
        return V1, {
            "limit": "memory.limit_in_bytes",
            "peak": "memory.max_usage_in_bytes",
            "events": "memory.oom_control",
        }
    return None


def available() -> bool:
    found = _controller()
    return found is not None and os.access(found[0], os.W_OK)


def run_capped(argv: list[str], cap: int, timeout: float | None = None) -> dict:
    """`argv` in a new memory cgroup limited to `cap` bytes: its exit code, wall time and peaks."""
    found = _controller()
    if found is None or not os.access(found[0], os.W_OK):
        raise RuntimeError("no writable cgroup memory controller here (needs root, cgroup v1 or v2)")
    root, files = found
    group = root / f"slimlm-cap-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / files["limit"]).write_text(str(cap))
        swap = group / ("memory.swap.max" if root == V2 else "memory.memsw.limit_in_bytes")
        if swap.exists():  # no swapping around the cap
            swap.write_text("0" if root == V2 else str(cap))

        def enter() -> None:  # in the child, before exec: it and all it starts are in the group
            (group / "cgroup.procs").write_text(str(os.getpid()))

        start = time.perf_counter()
        proc = subprocess.run(argv, preexec_fn=enter, timeout=timeout)  # its output as it goes: progress
        seconds = time.perf_counter() - start
        events = (group / files["events"]).read_text().split()
        oom_kills = int(events[events.index("oom_kill") + 1]) if "oom_kill" in events else 0
        peak_file = group / files["peak"]
        return {
            "argv": argv,
            "cap_bytes": cap,
            "returncode": proc.returncode,
            "seconds": seconds,
            "cgroup_peak_bytes": int(peak_file.read_text()) if peak_file.exists() else None,
            "child_maxrss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            "oom_kills": oom_kills,
        }
    finally:
        for _ in range(50):  # the group can be removed once its last process is gone
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap", required=True, type=parse_size, help="memory limit, e.g. 4G or 2500M")
    p.add_argument("--json", type=Path, help="also write the result here")
    p.add_argument("--timeout", type=float)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    a = p.parse_args()
    argv = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not argv:
        p.error("give the command after --")
    if not available():
        print("no writable cgroup memory controller here (needs root, cgroup v1 or v2)", file=sys.stderr)
        return 3
    try:
        result = run_capped(argv, a.cap, a.timeout)
    except OSError as e:  # the command itself could not start
        print(f"cannot run {argv[0]}: {e.strerror or e}", file=sys.stderr)
        return 2
    gb = 1e9
    peak = result["cgroup_peak_bytes"]
    print(
        f"cap {result['cap_bytes'] / gb:.2f} GB: exit {result['returncode']} after {result['seconds']:.0f} s; "
        f"peak resident {result['child_maxrss_bytes'] / gb:.2f} GB, cgroup peak (with page cache) "
        f"{'n/a' if peak is None else f'{peak / gb:.2f} GB'}; OOM kills {result['oom_kills']}"
    )
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
