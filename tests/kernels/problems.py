"""Random kernel inputs with real structure, shared by the tests, the CPU benchmark and the GPU device check.

Never zeros: weights are Gaussian and quantized by the real quantizer; caches hold Gaussian values in the
requested dtype; block tables are shuffled so no kernel can get away with assuming contiguous blocks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from slimlm.compress.quantize import quantize_rtn
from slimlm.formats import kv_int4
from slimlm.formats.quantized import QuantArgs, QuantizedWeight
from slimlm.kernels import cpu_gemm, cpu_library, reference
from slimlm.kernels.packed import PackedWeight, pack


def quantized_weight(
    n: int, k: int, bits: int, group_size: int, sym: bool, act_order: bool = False, seed: int = 0
) -> tuple[QuantizedWeight, PackedWeight]:
    g = torch.Generator().manual_seed(seed)
    q = quantize_rtn(torch.randn(n, k, generator=g), QuantArgs(bits, group_size, sym))
    if act_order:  # shuffle columns the way GPTQ's act-order leaves them: groups scattered over K
        size = k if group_size == -1 else group_size
        q.g_idx = (torch.arange(k) // size)[torch.randperm(k, generator=g)].int()
    return q, pack(q)


@dataclass
class PagedProblem:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    scale: float
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start,
            self.scale,
            self.k_scale,
            self.v_scale,
        )

    def kv_bytes(self) -> int:
        """Bytes of K and V a kernel must read: every cached token of every sequence, both caches."""
        per_token = self.k_cache.shape[2] * self.k_cache.shape[3] * self.k_cache.element_size()
        return 2 * int(self.seq_lens.sum()) * per_token


def paged_problem(
    seq_lens: list[int],
    q_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    kv_dtype: torch.dtype = torch.float16,
    q_dtype: torch.dtype = torch.float16,
    device: str = "cpu",
    seed: int = 0,
) -> PagedProblem:
    """Sequences of `seq_lens` cached tokens whose last `q_lens` tokens are the queries. Values are drawn on
    `device` (a GPU check's caches run to gigabytes); the block order is drawn on the host."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # a couple of blocks nobody owns
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, v = torch.randn(shape, generator=g, device=device), torch.randn(shape, generator=g, device=device)
    k_scale = v_scale = None
    if kv_dtype == torch.int8:
        k_scale, v_scale = ((torch.rand(kv_heads, generator=g, device=device) + 0.5) / 40 for _ in range(2))
        k = (k / k_scale[:, None]).round().clamp(-127, 127)
        v = (v / v_scale[:, None]).round().clamp(-127, 127)
    elif kv_dtype == torch.float8_e4m3fn:
        k_scale, v_scale = (torch.rand(kv_heads, generator=g, device=device) + 0.5 for _ in range(2))
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).int()
    table = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        table[s, :n] = order[start : start + n]
        start += n
    if kv_dtype != torch.int8:  # every slot no sequence has written holds NaN: a kernel must never read it
        written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for s, n in enumerate(seq_lens):
            written.view(-1)[
                (table[s, : blocks_per_seq[s]].long()[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
            ] = True
        k[~written.to(device)] = float("nan")
        v[~written.to(device)] = float("nan")
    if kv_dtype == torch.uint8:  # 4-bit rows; an unwritten one's step is NaN (a NaN x̂ wherever it is read)
        k, v = kv_int4.quantize(k), kv_int4.quantize(v)
        for rows in (k, v):
            rows[~written.to(device)] = kv_int4.quantize(torch.full((head_dim,), float("nan")))[None].to(device)
    query_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(query_start[-1]), heads, head_dim, generator=g, device=device)

    def put(t: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=dtype or t.dtype)

    return PagedProblem(
        q=put(q, q_dtype),
        k_cache=put(k, kv_dtype),
        v_cache=put(v, kv_dtype),
        block_tables=put(table),
        seq_lens=put(torch.tensor(seq_lens, dtype=torch.int32)),
        query_start=put(query_start),
        scale=head_dim**-0.5,
        k_scale=put(k_scale),
        v_scale=put(v_scale),
    )


def x_as_multiplied(x: torch.Tensor, w) -> torch.Tensor:
    """x in float64 as the loop for its rows multiplies it: AVX2's 4-bit loop quantizes it to int8 (x̂)."""
    if not cpu_library.available() or cpu_gemm.path(x.shape[0], x.dtype, w) != "int8":
        return x.double()
    permuted = x if w.perm is None else x[:, w.perm]
    x_hat = reference.int8_activations(permuted.double())
    return x_hat if w.perm is None else torch.empty_like(x_hat).index_copy_(1, w.perm, x_hat)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere (an unwritten output) makes it NaN."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """While active, every buffer from torch.empty/empty_like starts as NaN (floats) or 77 (integers), so an
    output element a kernel forgot to write shows up in the comparison instead of passing by luck."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else 77)

    torch.empty = lambda *a, **kw: fill(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: fill(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch (and the C kernels, which take torch's thread count) on n threads while active."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class Spy:
    """The C library, recording which slimlm_* function each call reaches (and optionally failing them)."""

    def __init__(self, lib, status: int | None = None):
        self.lib, self.status, self.calls = lib, status, []

    def __getattr__(self, name):
        fn = getattr(self.lib, name)
        if not name.startswith("slimlm_"):
            return fn

        def call(*args):
            self.calls.append(name)
            return fn(*args) if self.status is None else self.status

        return call


def haswell_library(monkeypatch) -> Spy:
    """The AVX2 build, spied on, in place of this CPU's (skips where this CPU cannot run it)."""
    if not (cpu_library.available() and (cpu_library.vector_bits() == 256 or cpu_library.has_bf16_gemm())):
        pytest.skip("needs an AVX2 CPU or one that runs every build")
    spy = Spy(cpu_library.load("haswell"))
    spy.calls = []
    monkeypatch.setattr(cpu_library, "load", lambda: spy)
    monkeypatch.setattr(cpu_library, "vector_bits", lambda: 256)
    monkeypatch.setattr(cpu_library, "has_bf16_gemm", lambda: False)
    return spy
