"""The one place that picks an implementation for each kernel.

    cuda tensors  -> Triton (triton_gemm, triton_attention)
    cpu tensors   -> the AVX-512 GEMM (cpu_gemm.py) for quantized linears, PyTorch for attention
    SLIMLM_KERNELS=reference  -> the plain PyTorch definitions (reference.py) everywhere

Callers (the runtime's layers) only see quant_matmul and paged_attention.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from slimlm.kernels import cpu_attention, cpu_library, reference
from slimlm.kernels.packed import PackedWeight, pack

__all__ = ["PackedWeight", "backend", "pack", "paged_attention", "quant_matmul"]


@functools.cache
def cpu_kernels_available() -> bool:
    if cpu_library.available():
        return True
    warnings.warn("the AVX-512 CPU kernels could not be built here; using the PyTorch paths", stacklevel=3)
    return False


def backend(device: torch.device) -> str:
    """'reference', 'triton' or 'cpu': what runs for tensors on `device`."""
    if os.environ.get("SLIMLM_KERNELS", "") == "reference":
        return "reference"
    if device.type == "cuda":
        return "triton"
    return "cpu"


def quant_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] @ dequantized(w).T -> [M, out_features], in x's dtype."""
    chosen = backend(x.device)
    if chosen == "triton":
        from slimlm.kernels import triton_gemm

        return triton_gemm.quant_matmul(x, w)
    if chosen == "cpu" and cpu_kernels_available():
        from slimlm.kernels import cpu_gemm

        return cpu_gemm.quant_matmul(x, w)
    return reference.quant_matmul(x, w)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over their sequences' paged KV (see reference.py for shapes)."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, k_scale, v_scale)
    chosen = backend(q.device)
    if chosen == "triton":
        from slimlm.kernels import triton_attention

        return triton_attention.paged_attention(*args)
    if chosen == "cpu":
        return cpu_attention.paged_attention(*args, native=cpu_kernels_available())
    return reference.paged_attention(*args)
