"""Xᵀ·X of bf16 activations with exact products and fp32 sums (cpu_gram.c): GPTQ's Hessians at the rate of the
CPU's bf16 dot-product unit, twice its fp32 one (AVX-512 BF16 only), or of its AMX tile unit where it has one
and the width is a multiple of AMX_WIDTH (a Qwen2.5-1.5B down_proj's 8960² from 4096 tokens on one Sapphire
Rapids core: 3.7 s on the dot-product unit, 0.6 s on the tiles)."""

from __future__ import annotations

import functools

import torch

from slimlm.errors import SlimlmError
from slimlm.kernels import cpu_library

TILE = 16  # cpu_gram.c computes 16×16 tiles
AMX_WIDTH = 32  # its tile-unit loop, 32×32 blocks of them


@functools.cache
def built() -> bool:
    try:
        return hasattr(cpu_library.load(), "slimlm_bf16_gram")
    except SlimlmError:  # no compiler: the callers' torch path runs
        return False


def applies(x: torch.Tensor) -> bool:
    """Whether add_gram takes these activations: bf16 on the CPU, a width of whole tiles, the kernel built."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.shape[-1] % TILE == 0 and built()


def uses_amx(width: int) -> bool:
    """Whether add_gram of activations this wide runs on the AMX tile unit."""
    return width % AMX_WIDTH == 0 and cpu_library.has_amx() and hasattr(cpu_library.load(), "slimlm_bf16_gram_amx")


def add_gram(out: torch.Tensor, x: torch.Tensor, alpha: float, beta: float) -> None:
    """out ← beta·out + alpha·xᵀx on the 16×16 tiles on and above the diagonal; the tiles below are left as they
    were (the caller mirrors them). x [tokens, n] bf16, out [n, n] fp32."""
    x = x.contiguous()
    assert applies(x) and out.dtype == torch.float32 and out.is_contiguous() and out.shape == (x.shape[1],) * 2
    lib = cpu_library.load()
    gram = lib.slimlm_bf16_gram_amx if uses_amx(x.shape[1]) else lib.slimlm_bf16_gram
    if gram(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), alpha, beta, torch.get_num_threads()):
        raise MemoryError(f"no memory for the {x.shape[0]}×{x.shape[1]} token pairs of a Hessian")
