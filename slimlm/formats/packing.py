"""Dense bit packing of signed b-bit codes into int32 words, the layout compressed-tensors and GPTQ use.

Codes are offset to unsigned (z + 2^(b−1)) and written as one little-endian bit stream per row: element i
occupies bits [i·b, (i+1)·b) of the row, so for b = 4 or 8 each word holds 32/b whole codes and for b = 3
codes straddle word boundaries.
"""

from __future__ import annotations

import math
import sys

import torch

CHUNK_ELEMENTS = 1 << 20


def packed_words(n: int, bits: int) -> int:
    """int32 words that hold n codes of `bits` bits."""
    return math.ceil(n * bits / 32)


def pack_int32(codes: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Pack signed `bits`-bit codes into int32 words along `dim`: element i sits at bit i·bits of its row."""
    rows_first = codes.transpose(0, 1) if dim == 0 else codes
    # Rows are independent; packing a few at a time keeps the int64 temporaries small.
    # Each slice is written into the result as it is made: no list of slices to concatenate (an 8-bit lm_head of
    # 151,936 rows would hold its packed words twice).
    rows, n = rows_first.shape
    step = max(1, CHUNK_ELEMENTS // max(n, 1))
    out = torch.empty(rows, packed_words(n, bits), dtype=torch.int32, device=codes.device)
    for r in range(0, rows, step):
        out[r : r + step] = _pack_rows(rows_first[r : r + step], bits)
    return out.transpose(0, 1).contiguous() if dim == 0 else out


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    u = codes.to(torch.int64) + (1 << (bits - 1))
    rows, n = u.shape
    words = math.ceil(n * bits / 32)
    start = torch.arange(n, device=u.device) * bits
    word, offset = start // 32, start % 32
    out = torch.zeros(rows, words + 1, dtype=torch.int64, device=u.device)
    out.index_add_(1, word, (u << offset) & 0xFFFFFFFF)
    # A code that straddles two words puts its high bits at the bottom of the next one.
    spill = offset + bits > 32
    if spill.any():
        out.index_add_(1, word[spill] + 1, u[:, spill] >> (32 - offset[spill]))
    out = out[:, :words]
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def unpack_int32(packed: torch.Tensor, bits: int, n: int, dim: int = 1) -> torch.Tensor:
    """Inverse of pack_int32: `n` signed int8 codes per row (or per column when dim=0)."""
    rows_first = packed.transpose(0, 1) if dim == 0 else packed
    if bits in (4, 8) and sys.byteorder == "little":
        codes = _unpack_bytes(rows_first.contiguous(), bits, n)
    else:  # a few rows at a time, as in pack_int32: the int64 temporaries stay small
        step = max(1, CHUNK_ELEMENTS // max(n, 1))
        codes = torch.cat([_unpack_rows(rows_first[r : r + step], bits, n) for r in range(0, len(rows_first), step)])
    return codes.transpose(0, 1).contiguous() if dim == 0 else codes


def _unpack_bytes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """4 and 8 bits: a little-endian word's bytes are its codes in order (4-bit: low nibble first), so they
    unpack in bytes, with no int64 temporaries (those were ~8x the codes: a GB for an 8-bit lm_head)."""
    b = packed.view(torch.uint8)
    if bits == 4:
        b = torch.stack((b & 15, b >> 4), dim=-1).flatten(1)
    # Offset codes 0..2^bits-1 minus 2^(bits-1), in bytes: wrapping uint8 arithmetic read as int8 is exactly
    # that, with no wider temporaries (an 8-bit lm_head's int16 copies were 0.5 GB each).
    return (b[:, :n] - (1 << (bits - 1))).view(torch.int8)


def _unpack_rows(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    p = torch.nn.functional.pad(packed.to(torch.int64) & 0xFFFFFFFF, (0, 1))
    start = torch.arange(n, device=p.device) * bits
    word, offset = start // 32, start % 32
    # Two adjacent words as one 64-bit value cover any code, straddling or not.
    pair = p[:, word] | (p[:, word + 1] << 32)
    u = (pair >> offset) & ((1 << bits) - 1)
    return (u - (1 << (bits - 1))).to(torch.int8)
