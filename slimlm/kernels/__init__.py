"""The one place that picks an implementation for each kernel.

    cuda tensors  -> Triton (triton_gemm, triton_attention)
    cpu tensors   -> the C kernels, AVX-512 or AVX2 (cpu_gemm, cpu_layer, and cpu_attention's C decode for fp32/bf16
                     caches; its batched PyTorch path otherwise); PyTorch everywhere if they cannot be built here
    SLIMLM_KERNELS=reference  -> the plain PyTorch definitions (reference.py) everywhere

The runtime calls select(device) once at load and keeps the Backend; quant_matmul and paged_attention
below choose per call, for tests and one-off use.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slimlm.kernels import cpu_attention, cpu_library, reference
from slimlm.kernels.cpu_gemm import ACTIVATIONS, exact_activations
from slimlm.kernels.packed import PackedWeight, pack

__all__ = [
    "ACTIVATIONS",
    "Backend",
    "PackedWeight",
    "backend",
    "exact_activations",
    "pack",
    "paged_attention",
    "quant_matmul",
    "select",
]


@functools.cache
def cpu_kernels_available() -> bool:
    if cpu_library.available():
        return True
    warnings.warn(
        "the CPU kernels (AVX-512, or AVX2 with FMA) could not be built here; using the PyTorch paths", stacklevel=3
    )
    return False


def backend(device: torch.device) -> str:
    """'reference', 'triton' or 'cpu': what runs for tensors on `device`."""
    if os.environ.get("SLIMLM_KERNELS") == "reference":
        return "reference"
    if device.type == "cuda":
        return "triton"
    return "cpu"


def one_piece(x: torch.Tensor, w: PackedWeight) -> int:
    """A whole x in one call, however many rows: what every backend but the CPU kernels wants."""
    return 1


@dataclass(frozen=True)
class Backend:
    name: str
    quant_matmul: Callable[[torch.Tensor, PackedWeight], torch.Tensor]
    paged_attention: Callable[..., torch.Tensor]  # paged_attention's signature below
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = reference.add_rms_norm
    rotary_kv_write: Callable[..., torch.Tensor] = reference.rotary_kv_write
    silu_mul: Callable[[torch.Tensor], torch.Tensor] = reference.silu_mul
    decode_stack: type | None = None  # every decoder layer in one call for decode steps (cpu_layer.DecodeStack)
    row_logprobs: Callable[..., tuple[torch.Tensor, ...]] = reference.row_logprobs  # scored prompt rows
    row_pieces: Callable[[torch.Tensor, PackedWeight], int] = one_piece  # how many calls x's rows take (cpu_gemm)


def select(device: torch.device | str) -> Backend:
    """The kernels that run for tensors on `device`, decided once."""
    chosen = backend(torch.device(device))
    if chosen == "triton":
        from slimlm.kernels import triton_attention, triton_gemm

        return Backend("triton", triton_gemm.quant_matmul, triton_attention.paged_attention)
    if chosen == "cpu" and cpu_kernels_available():
        from slimlm.kernels import cpu_gemm, cpu_layer

        return Backend(
            "cpu",
            cpu_gemm.quant_matmul,
            functools.partial(cpu_attention.paged_attention, native=True),
            cpu_layer.add_rms_norm,
            cpu_layer.rotary_kv_write,
            cpu_layer.silu_mul,
            cpu_layer.DecodeStack,
            cpu_layer.row_logprobs,
            cpu_gemm.row_pieces,
        )
    if chosen == "cpu":
        return Backend(
            "cpu-pytorch", reference.quant_matmul, functools.partial(cpu_attention.paged_attention, native=False)
        )
    return Backend("reference", reference.quant_matmul, reference.paged_attention)


def quant_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] @ dequantized(w).T -> [M, out_features], in x's dtype."""
    return select(x.device).quant_matmul(x, w)


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
    return select(q.device).paged_attention(*args)
