"""Peak memory of loading a checkpoint into the runtime, against the checkpoint's own weight bytes (the issue's
target: a W4 checkpoint's load peaks at most 1.3× them).

Each checkpoint loads in a fresh process, twice: the first load pages in the libraries and makes the one-time
allocations; then freed memory goes back to the OS, the peak mark is reset (Linux clear_refs), and the second
load's peak over the resident size just before it is the load's own. The same probe as
tests/runtime/test_loader.py, on real checkpoints.

    .venv/bin/python benchmarks/load_memory.py DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, sys
from pathlib import Path
import torch
from slimlm.perf.load import peak_reset, status
from slimlm.formats import shards
from slimlm.runtime import loader
d = Path(sys.argv[1])
loader.load_model(d, torch.float32, "cpu", 64)
loader.release_freed()
base = peak_reset()
model = loader.load_model(d, torch.float32, "cpu", 64)
print(json.dumps({"weight_bytes": shards.total_size(d), "peak_bytes": status("VmHWM") - base,
                  "resident_bytes": status("VmRSS") - base}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    rows = []
    print(f"{'checkpoint':40} {'weights GB':>10} {'peak GB':>8} {'peak/weights':>12} {'after/weights':>13}")
    for d in a.checkpoints:
        out = subprocess.run([sys.executable, "-c", PROBE, str(d)], capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{d}: {out.stderr.strip().splitlines()[-1]}")
        r = {"checkpoint": str(d), **json.loads(out.stdout.splitlines()[-1])}
        rows.append(r)
        w = r["weight_bytes"]
        print(
            f"{d.name:40} {w / 1e9:>10.3f} {r['peak_bytes'] / 1e9:>8.3f} {r['peak_bytes'] / w:>12.2f} "
            f"{r['resident_bytes'] / w:>13.2f}"
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
