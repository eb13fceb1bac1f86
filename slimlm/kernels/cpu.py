"""The CPU quantized GEMM (cpu_gemm.c): built with gcc on first use, cached by source hash, called via ctypes.

A plain shared library rather than a torch extension: it needs no torch headers, so it builds in about a
second from a clean clone, and the OpenMP runtime it links is the one torch has already loaded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from slimlm import SlimlmError
from slimlm.assets import cache_dir
from slimlm.kernels.packed import BLOCK_N, PackedWeight

SOURCE = Path(__file__).with_name("cpu_gemm.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
FUSED_MAX_ROWS_BF16 = 16  # above this, bf16 matmul on dequantized slices wins (benchmarks/kernels_cpu.py)
SLICE_BLOCKS = 16  # weight blocks (of BLOCK_N features) dequantized at a time: a few MB, stays in cache


def library_path() -> Path:
    """Where the built library lives: keyed by source and flags, so an edit rebuilds it."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / key / "libslimlm_cpu.so"


@functools.cache
def library() -> ctypes.CDLL:
    path = library_path()
    if not path.exists():
        compiler = os.environ.get("CC", "gcc")
        if shutil.which(compiler) is None:
            raise SlimlmError(f"the CPU kernels need a C compiler ({compiler} not found); install gcc or set CC")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
            if result.returncode != 0:
                raise SlimlmError(f"building the CPU kernels failed: {result.stderr.strip().splitlines()[-1]}")
            built.replace(path)  # atomic: concurrent builders each rename a complete file
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.slimlm_quant_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int]
    lib.slimlm_quant_matmul.restype = None
    lib.slimlm_dequantize_bf16.argtypes = [ctypes.c_int, i64, ptr, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.slimlm_dequantize_bf16.restype = None
    return lib


def available() -> bool:
    """Whether the library builds and loads here (it needs gcc and AVX-512)."""
    try:
        library()
    except (SlimlmError, OSError):
        return False
    return True


def quant_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, out_features] in x's dtype.

    Few rows (or fp32): the fused loop, fp32 accumulation, weights read once per 4 rows. Many bf16 rows: the
    weight is dequantized to bf16 a slice at a time and torch's bf16 matmul does the arithmetic, which wins
    there (benchmarks/kernels_cpu.py measures both)."""
    if w.perm is not None:
        x = x[:, w.perm]
    if x.dtype == torch.bfloat16 and x.shape[0] > FUSED_MAX_ROWS_BF16:
        return _dequantized_matmul(x.contiguous(), w)
    xf = x.to(torch.float32).contiguous()
    m, k = xf.shape
    y = torch.empty(m, w.padded_out_features, dtype=torch.float32)
    library().slimlm_quant_matmul(
        w.bits, xf.data_ptr(), m, k, w.codes.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(),
        w.codes.shape[0], w.group_size, y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    y = y[:, : w.out_features]
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _dequantized_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    k = x.shape[1]
    blocks = w.codes.shape[0]
    out = torch.empty(x.shape[0], w.padded_out_features, dtype=torch.bfloat16)
    buffers = {}  # by width: reused, since fresh pages for every slice cost as much as the arithmetic
    for b0 in range(0, blocks, SLICE_BLOCKS):
        b1 = min(b0 + SLICE_BLOCKS, blocks)
        width = (b1 - b0) * BLOCK_N
        if width not in buffers:
            buffers[width] = torch.empty(k, width, dtype=torch.bfloat16)
        wt = buffers[width]
        library().slimlm_dequantize_bf16(
            w.bits, k, w.codes.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(), b0, b1, w.group_size,
            wt.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        out[:, b0 * BLOCK_N : b1 * BLOCK_N] = x @ wt
    return out[:, : w.out_features]
