"""The CPU quantized GEMM (cpu_gemm.c, through cpu_library).

Which loop runs, by CPU and by x (thresholds measured with benchmarks/kernels_cpu.py). fp32 x runs one loop for
every row count, so that a row's bits do not depend on the rows beside it (batch invariance; path() says why):

    fp32 x, any CPU           the fused fp32 loop (weights unpacked to fp32 in registers, fp32 sums), dense fp32
                              weights (packed.pack_dense) too; on AVX2, 4-bit weights outside exact_activations():
    AVX2, 4-bit               x quantized to int8 per run of INT8_RUN inputs, codes times bytes (vpmaddubsw: 32
                              weights an instruction; the product is exactly W·x̂, llama.cpp's Q4×Q8): 1.3–1.5×
                              the fused loop at batch 1 on Qwen2.5-1.5B, 2.4–2.9× the fp32 slices at 24–32 rows,
                              ~1.6× at 512, for +0.1–0.15% perplexity; from 3 rows on each block's codes are
                              unpacked once for all rows (another 1.1–1.3× at 3–8 rows, 1.4–1.6× at 32–512; the
                              same bits per row). Steps inside exact_activations() (ModelRunner enters it for a
                              scored prompt, and for every step under activations="exact"), 8-bit weights and
                              widths not a multiple of INT8_RUN: the fused loop.
    AVX-512 BF16, bf16 x      up to CODE_MAX_ROWS[bits] rows: code tiles (exact codes into the bf16 dot
                              products, scales applied per segment); above: dequantized bf16 weight tiles;
                              with AMX, from AMX_MIN_ROWS rows on, the tile unit: up to 16 rows the code
                              tiles' exact pairs (as cheap to unpack as one row's code tile, so a step of 2-16
                              rows costs about one row's), above that the weight tiles (2-4× any AVX-512 loop)
    AVX-512 without BF16      bf16 x: the fused loop; above FUSED_MAX_ROWS_BF16 rows bf16 matmul on dequantized
                              slices
    AVX2, bf16 x              as fp32 x (int8 or fused), above FUSED_MAX_ROWS_AVX2 rows fp32 matmul on
                              dequantized slices for the fused loop's weights

Dense bf16 weights (packed.pack_dense, where dense_fits) take the bf16 loops, as they are.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from slimlm.errors import SlimlmError
from slimlm.kernels import cpu_library
from slimlm.kernels.packed import BLOCK_N, PackedWeight

CODE_MAX_ROWS = {4: 32, 8: 16, 16: 4}  # AVX-512 BF16: code tiles up to here (bf16 rows), weight tiles above
AMX_MIN_ROWS = {4: 2, 8: 2, 16: 3}  # AMX CPUs, bf16 x: the tile unit from here on, by bits; code tiles below
# (benchmarks/amx_rows.py on an AMX Xeon, Qwen2.5-1.5B's linears: 2 rows 0.72-0.97× the code tiles' time;
# dense weights, with nothing to unpack, gain from 3 rows)
FUSED_MAX_ROWS_BF16 = 16  # AVX-512 without BF16: above this, bf16 matmul on dequantized slices wins
FUSED_MAX_ROWS_AVX2 = 24  # AVX2, bf16 x: above this, fp32 matmul on dequantized slices wins
INT8_RUN = 32  # AVX2 4-bit loop: inputs per activation scale (XB in cpu_gemm_avx2.c)
SLICE_BLOCKS = 16  # weight blocks (of BLOCK_N features) dequantized at a time: a few MB, stays in cache


def quant_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, out_features] in x's dtype."""
    dense = {16: torch.bfloat16, 32: torch.float32}.get(w.bits)
    if dense is not None and x.dtype != dense:
        return quant_matmul(x.to(dense), w).to(x.dtype)
    if w.perm is not None:
        x = x[:, w.perm]
    dtype = x.dtype
    kernel = path(x.shape[0], dtype, w)
    if kernel == "dequant-slices":  # bf16 x: bf16 slices on AVX-512, fp32 ones on AVX2 (slow bf16 matmul there)
        slices = torch.bfloat16 if cpu_library.vector_bits() == 512 else torch.float32
        return _dequantized_matmul(x.to(slices).contiguous(), w).to(dtype)
    lib = cpu_library.load()
    m, k = x.shape
    blocks = w.kernel_args
    threads = torch.get_num_threads()
    if kernel in ("bf16-codes", "bf16-weights", "bf16-amx"):  # written in x's dtype, without the padding
        x = x.contiguous()
        y = torch.empty(m, w.out_features, dtype=dtype)
        args = (w.bits, x.data_ptr(), m, k, *blocks, y.data_ptr(), w.out_features, 1)
        if kernel == "bf16-amx":
            status = lib.slimlm_quant_matmul_amx(*args, threads)
        else:
            status = lib.slimlm_quant_matmul_bf16(*args, CODE_MAX_ROWS[w.bits], threads)
    else:  # "int8" or "fused": fp32 x, into the padded width
        x = x.to(torch.float32).contiguous()
        y = torch.empty(m, w.padded_out_features)
        if kernel == "int8":
            status = lib.slimlm_quant_matmul_i8(x.data_ptr(), m, k, *blocks, y.data_ptr(), threads)
        else:  # cannot fail: it allocates nothing
            lib.slimlm_quant_matmul(w.bits, x.data_ptr(), m, k, *blocks, y.data_ptr(), threads)
            status = 0
        y = y[:, : w.out_features]
    if status:  # the bf16 and int8 kernels allocate
        raise SlimlmError(f"out of memory in the CPU quantized matmul ({m}×{k} rows of x)")
    return y if y.dtype == dtype else y.to(dtype)


def path(rows: int, dtype: torch.dtype, w: PackedWeight) -> str:
    """The loop quant_matmul runs for `rows` rows of `dtype` against `w` on this CPU (see the module doc). fp32
    rows take one loop whatever their number (fused, or AVX2's int8, which quantizes each row alone): a row gets
    the same bits however many rows share its step (batch invariance), at the price of the loops that won at
    some row counts only (measured in benchmarks/results/batch-invariance-*)."""
    if not _EXACT.get() and int8_fits(w):  # AVX2, either dtype of x
        return "int8"
    if dtype != torch.bfloat16 or w.bits == 32:  # fp32 x (the kernels take any other dtype as fp32)
        return "fused"
    pairs = w.in_features % 2 == 0 and w.group_size % 2 == 0  # the bf16 dot product takes inputs in pairs
    if cpu_library.has_bf16_gemm() and pairs:
        if rows >= AMX_MIN_ROWS[w.bits] and cpu_library.has_amx():
            return "bf16-amx"
        return "bf16-codes" if rows <= CODE_MAX_ROWS[w.bits] else "bf16-weights"
    if cpu_library.vector_bits() == 512:
        return "dequant-slices" if rows > FUSED_MAX_ROWS_BF16 else "fused"
    return "dequant-slices" if rows > FUSED_MAX_ROWS_AVX2 else "fused"


def int8_fits(w: PackedWeight) -> bool:
    """Whether AVX2's int8 loop takes w: the AVX2 build, 4-bit codes, whole runs of INT8_RUN inputs."""
    runs = w.in_features % INT8_RUN == 0 and w.group_size % INT8_RUN == 0
    return cpu_library.vector_bits() == 256 and w.bits == 4 and runs


FRESH_BYTES = 32 << 20  # glibc maps an allocation above this anew every time, and the kernel zeroes its pages
MIN_PIECE_ROWS = 33  # above every loop's small-row tiles (CODE_MAX_ROWS; AMX's code tiles up to 16 rows)


def row_pieces(x: torch.Tensor, w: PackedWeight) -> int:
    """How many pieces of x's rows to multiply by w one after another so that no output is above FRESH_BYTES:
    a 500-row prompt's gate/up output on Qwen2.5-1.5B (36 MB in fp32) spent 10 of its 88 ms in page faults.
    Only where a piece runs the loop the whole would, so that every row comes out the same, and that loop does
    no per-call work on the whole weight (dequantized slices), which a piece would repeat."""
    rows = x.shape[0]
    pieces = -(-rows * w.out_features * x.element_size() // FRESH_BYTES)
    if pieces <= 1 or -(-rows // pieces) < MIN_PIECE_ROWS:  # every decode step and short prompt stops here
        return 1
    loop = path(rows, x.dtype, w)
    if loop == "dequant-slices" or path(-(-rows // pieces), x.dtype, w) != loop:
        return 1
    return pieces


ACTIVATIONS = ("auto", "exact")  # an engine's choice: the fastest loop, or never a quantized x (exact_activations)
_EXACT = contextvars.ContextVar("exact_activations", default=False)


@contextlib.contextmanager
def exact_activations(exact: bool = True) -> Iterator[None]:
    """Inside, no loop quantizes x (AVX2's int8 loop steps aside): prompt tokens are scored with the activations
    transformers multiplies, so prompt log-probabilities and evaluations do not depend on this CPU's loops."""
    token = _EXACT.set(exact)
    try:
        yield
    finally:
        _EXACT.reset(token)


def quantizes_activations() -> bool:
    """Whether some loop here multiplies x rounded to int8 (AVX2's 4-bit loop) outside exact_activations()."""
    return cpu_library.available() and cpu_library.vector_bits() == 256 and not _EXACT.get()


def dense_fits(weight: torch.Tensor) -> bool:
    """Whether a float weight runs here, packed by pack_dense: bf16 on a CPU with the bf16 dot product, K a
    multiple of 32 (the tile unit's step, read in place); fp32 everywhere, so that no fp32 row goes through
    torch's matmul, whose bits for a row depend on how many rows it multiplies (below 12, measured)."""
    if weight.dtype == torch.bfloat16:
        return weight.shape[1] % 32 == 0 and cpu_library.has_bf16_gemm()
    return weight.dtype == torch.float32


def _dequantized_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    k = x.shape[1]
    blocks = w.codes.shape[0]
    out = torch.empty(x.shape[0], w.padded_out_features, dtype=x.dtype)
    buffers = {}  # by width: reused, since fresh pages for every slice cost as much as the arithmetic
    lib = cpu_library.load()
    for b0 in range(0, blocks, SLICE_BLOCKS):
        b1 = min(b0 + SLICE_BLOCKS, blocks)
        width = (b1 - b0) * BLOCK_N
        if width not in buffers:
            buffers[width] = torch.empty(k, width, dtype=x.dtype)
        wt = buffers[width]
        lib.slimlm_dequantize(  # bf16 on AVX-512, fp32 on AVX2: x's dtype here (quant_matmul chose it)
            w.bits,
            k,
            w.codes.data_ptr(),
            w.scales.data_ptr(),
            w.zeros.data_ptr(),
            b0,
            b1,
            w.group_size,
            wt.data_ptr(),
            torch.get_num_threads(),
        )
        out[:, b0 * BLOCK_N : b1 * BLOCK_N] = x @ wt
    return out[:, : w.out_features]
