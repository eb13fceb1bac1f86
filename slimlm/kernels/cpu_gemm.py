"""The CPU quantized GEMM (cpu_gemm.c, through cpu_library).

Which loop runs, by CPU and by x (thresholds measured with benchmarks/kernels_cpu.py):

    AVX-512 BF16, bf16 x      up to CODE_MAX_ROWS[bits] rows: code tiles (exact codes into the bf16 dot
                              products, scales applied per segment); above: dequantized bf16 weight tiles;
                              with AMX, from AMX_MIN_ROWS rows on, the tile unit: up to 16 rows the code
                              tiles' exact pairs (as cheap to unpack as one row's code tile, so a step of 2-16
                              rows costs about one row's), above that the weight tiles (2-4× any AVX-512 loop)
    AVX-512 BF16, fp32 x      up to a third of that: each row split exactly into three bf16 rows for the code
                              tiles (fp32 accuracy); above: the fused fp32 loop. With AMX: the fused loop up
                              to FUSED_MAX_ROWS_AMX rows (it beat the split 1.2–3.3× there, measured; the split
                              won on the EPYC), fp32 matmul on dequantized fp32 slices above
    AVX-512 without BF16      fused fp32 loop; bf16 x above FUSED_MAX_ROWS_BF16 rows: bf16 matmul on
                              dequantized slices
    AVX2                      4-bit, any rows: x quantized to int8 per run of INT8_RUN inputs, codes times
                              bytes (vpmaddubsw: 32 weights an instruction; the product is exactly W·x̂,
                              llama.cpp's Q4×Q8): 1.3–1.5× the fused loop at batch 1 on Qwen2.5-1.5B,
                              2.4–2.9× the fp32 slices at 24–32 rows, ~1.6× at 512, for +0.1–0.15% perplexity;
                              from 3 rows on each block's codes are unpacked once for all rows (another
                              1.1–1.3× at 3–8 rows, 1.4–1.6× at 32–512; the same bits per row)
                              Steps inside exact_activations() (ModelRunner enters it for a scored prompt), 8-bit
                              weights (at memory bandwidth already) and widths not a multiple of INT8_RUN: the
                              fused fp32 loop; above FUSED_MAX_ROWS_AVX2 rows, fp32 matmul on dequantized slices

Dense weights (packed.pack_dense, where dense_fits) take the same loops, as they are, with x in their dtype:
bf16 ones the bf16 loops; fp32 ones (AVX-512 CPUs) the fused loop up to FUSED_MAX_ROWS_DENSE rows and above,
torch's batched fp32 matmul of x by every block as it lies (no copy of the weights).
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
FUSED_MAX_ROWS_AVX2 = 24  # AVX2: above this, fp32 matmul on dequantized slices wins, for either dtype of x
FUSED_MAX_ROWS_AMX = 96  # AMX CPUs, fp32 x: above this, fp32 matmul on dequantized fp32 slices wins
FUSED_MAX_ROWS_DENSE = 32  # dense fp32 weights: above this, torch's matmul block by block (measured on Sapphire Rapids)
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
    if kernel == "dense-blocks":  # [blocks, M, BLOCK_N] -> [M, N]
        return torch.matmul(x, w.codes).transpose(0, 1).reshape(x.shape[0], -1)[:, : w.out_features]
    if kernel == "dequant-slices":  # fp32 slices for fp32 x, and for any x where there are no bf16 ones (AVX2)
        slices = torch.bfloat16 if cpu_library.vector_bits() == 512 and dtype == torch.bfloat16 else torch.float32
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
    elif kernel == "fp32-split":
        x = x.to(torch.float32).contiguous()
        y = torch.empty(m, w.out_features)
        status = lib.slimlm_quant_matmul_f32_split(
            w.bits, x.data_ptr(), m, k, *blocks, y.data_ptr(), w.out_features, threads
        )
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
    """The loop quant_matmul runs for `rows` rows of `dtype` against `w` on this CPU (see the module doc)."""
    if w.bits == 32:
        return "fused" if rows <= FUSED_MAX_ROWS_DENSE else "dense-blocks"
    pairs = w.in_features % 2 == 0 and w.group_size % 2 == 0  # the bf16 dot product takes inputs in pairs
    if cpu_library.has_bf16_gemm() and pairs:
        limit = CODE_MAX_ROWS[w.bits]
        if dtype == torch.bfloat16 or w.bits == 16:
            if rows >= AMX_MIN_ROWS[w.bits] and cpu_library.has_amx():
                return "bf16-amx"
            return "bf16-codes" if rows <= limit else "bf16-weights"
        if cpu_library.has_amx():
            return "dequant-slices" if rows > FUSED_MAX_ROWS_AMX else "fused"
        return "fp32-split" if 3 * rows <= limit else "fused"
    if cpu_library.vector_bits() == 512:
        return "dequant-slices" if dtype == torch.bfloat16 and rows > FUSED_MAX_ROWS_BF16 else "fused"
    if not _EXACT.get() and w.bits == 4 and w.in_features % INT8_RUN == 0 and w.group_size % INT8_RUN == 0:
        return "int8"
    return "dequant-slices" if rows > FUSED_MAX_ROWS_AVX2 else "fused"


FRESH_BYTES = 32 << 20  # glibc maps an allocation above this anew every time, and the kernel zeroes its pages
MIN_PIECE_ROWS = 33  # above every loop's small-row tiles (CODE_MAX_ROWS; AMX's code tiles up to 16 rows)


def row_pieces(x: torch.Tensor, w: PackedWeight) -> int:
    """How many pieces of x's rows to multiply by w one after another so that no output is above FRESH_BYTES:
    a 500-row prompt's gate/up output on Qwen2.5-1.5B (36 MB in fp32) spent 10 of its 88 ms in page faults.
    Only where a piece runs the loop the whole would, so that every row comes out the same, and that loop does
    no per-call work on the whole weight (dequantized slices, dense blocks), which a piece would repeat."""
    rows = x.shape[0]
    pieces = -(-rows * w.out_features * x.element_size() // FRESH_BYTES)
    if pieces <= 1 or -(-rows // pieces) < MIN_PIECE_ROWS:  # every decode step and short prompt stops here
        return 1
    loop = path(rows, x.dtype, w)
    if loop in ("dequant-slices", "dense-blocks") or path(-(-rows // pieces), x.dtype, w) != loop:
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
    multiple of 32 (the tile unit's step, read in place); fp32 on an AVX-512 CPU."""
    if weight.dtype == torch.bfloat16:
        return weight.shape[1] % 32 == 0 and cpu_library.has_bf16_gemm()
    return weight.dtype == torch.float32 and cpu_library.vector_bits() == 512


def _dequantized_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    k = x.shape[1]
    blocks = w.codes.shape[0]
    out = torch.empty(x.shape[0], w.padded_out_features, dtype=x.dtype)
    buffers = {}  # by width: reused, since fresh pages for every slice cost as much as the arithmetic
    lib = cpu_library.load()
    f32_from_512 = x.dtype == torch.float32 and cpu_library.vector_bits() == 512
    dequantize = lib.slimlm_dequantize_f32 if f32_from_512 else lib.slimlm_dequantize  # AVX2's writes fp32
    for b0 in range(0, blocks, SLICE_BLOCKS):
        b1 = min(b0 + SLICE_BLOCKS, blocks)
        width = (b1 - b0) * BLOCK_N
        if width not in buffers:
            buffers[width] = torch.empty(k, width, dtype=x.dtype)
        wt = buffers[width]
        dequantize(
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
