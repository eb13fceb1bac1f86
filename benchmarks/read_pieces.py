"""What bounds the batch-1 decode step of a small model: its GEMVs against a plain read of the same bytes,
matrix by matrix, from memory, in one run.

The bandwidth floor divides a step's bytes by what one long read moves. The step reads them as ~120 matrices
of 0.2–1 MB, one after another, each split over the threads. For each of the default model's quantized
matrices (W4 g64 q/k/v, o, gate/up, down; the 8-bit lm_head), read_pieces.c times the GEMV the decode step
calls (one row of bf16 x) and a sum over the same bytes, piece after piece, with the same threads, each matrix
in enough copies to come from memory, against a 1 GiB read; then the step's sum of each (30 layers and the
lm_head) against its floor.

    PYTHONPATH=. .venv/bin/python benchmarks/read_pieces.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from slimlm.kernels import cpu_library

# name, K, N, bits, group, how many in a step of SmolLM2-135M (W4 g64, 8-bit lm_head; q/k/v and gate/up joined)
MATRICES = [
    ("qkv", 576, 960, 4, 64, 30),
    ("o", 576, 576, 4, 64, 30),
    ("gate_up", 576, 3072, 4, 64, 30),
    ("down", 1536, 576, 4, 64, 30),
    ("lm_head", 576, 49152, 8, 64, 1),
]
FROM_MEMORY = 256 << 20  # bytes of copies per matrix: well past any L3 here


def build(out: Path) -> Path:
    lib = cpu_library.library_path()
    cpu_library.load()  # builds the library if this tree's kernels are not built yet
    binary = out / "read_pieces"
    source = Path(__file__).with_name("read_pieces.c")
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-fopenmp",
            "-march=native",
            str(source),
            str(lib),
            "-o",
            str(binary),
            f"-Wl,-rpath,{lib.parent}",
        ],
        check=True,
    )
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows, step = [], {"gemv": 0.0, "pieces": 0.0, "floor": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        for name, k, n, bits, group, count in MATRICES:
            nbytes = k * n * bits // 8 + k // group * n * 3
            copies = max(4, FROM_MEMORY // nbytes)
            out = subprocess.run(
                [str(binary), *map(str, (k, n, bits, group, copies, args.threads))],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            gemv, pieces, stream = map(float, out[:3])
            stream_rate = (1 << 30) / stream
            rows.append(
                {
                    "name": name,
                    "bytes": nbytes,
                    "gemv_s": gemv,
                    "pieces_s": pieces,
                    "stream_bytes_s": stream_rate,
                    "count": count,
                }
            )
            step["gemv"] += count * gemv
            step["pieces"] += count * pieces
            step["floor"] += count * nbytes / stream_rate
    print(f"one row of bf16 x, {args.threads} threads, every matrix from memory")
    print(
        f"{'matrix':8s} {'KB':>6s} {'GEMV µs':>8s} {'GB/s':>6s} {'read µs':>8s} {'GB/s':>6s} {'1 GiB GB/s':>10s}"
        f" {'GEMV÷read':>9s} {'read÷1GiB':>9s}"
    )
    for r in rows:
        gemv_rate, piece_rate = r["bytes"] / r["gemv_s"], r["bytes"] / r["pieces_s"]
        print(
            f"{r['name']:8s} {r['bytes'] / 1e3:6.0f} {1e6 * r['gemv_s']:8.2f} {gemv_rate / 1e9:6.1f} "
            f"{1e6 * r['pieces_s']:8.2f} {piece_rate / 1e9:6.1f} {r['stream_bytes_s'] / 1e9:10.1f} "
            f"{r['pieces_s'] / r['gemv_s']:8.2f}× {piece_rate / r['stream_bytes_s']:8.2f}×"
        )
    print(
        f"a step's matrices: GEMVs {1e3 * step['gemv']:.2f} ms, the same pieces read {1e3 * step['pieces']:.2f} ms, "
        f"floor {1e3 * step['floor']:.2f} ms: GEMVs {step['gemv'] / step['floor']:.2f}× the floor, "
        f"reading the pieces {step['pieces'] / step['floor']:.2f}×"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": args.threads, "matrices": rows, "step_s": step}, indent=1))


if __name__ == "__main__":
    main()
