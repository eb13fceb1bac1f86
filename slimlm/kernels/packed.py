"""The weight layout the quantized GEMMs read, repacked once at load time from a checkpoint's codes.

Checkpoints stay compressed-tensors or GPTQ (row-major codes, one row per output feature). The kernels want
something else: for every input index k, a short contiguous run of output features, so that one load feeds
many lanes (AVX-512 or AVX2 on CPU, a Triton tile on GPU) and the whole matrix streams once. So output features are
cut into blocks of `BLOCK_N` and each block is stored k-major:

    codes   uint8 [N/BLOCK_N, K, BLOCK_N·bits/8]   4-bit: byte j of a row holds feature j (low nibble)
                                                   and feature j+BLOCK_N/2 (high nibble); 8-bit: one per byte
    scales  fp16  [N/BLOCK_N, K/group, BLOCK_N]
    zeros   uint8 [N/BLOCK_N, K/group, BLOCK_N]    unsigned codes: w = scale · (code − zero)

Codes are stored unsigned (signed code − qmin), so symmetric and asymmetric weights take the same path.
Dense weights (pack_dense) take the same blocks, with no scales or zeros: fp32 (bits 32) as codes fp32
[N/BLOCK_N, K, BLOCK_N], k-major; bf16 (bits 16) as codes bf16 [N/BLOCK_N, K, BLOCK_N] holding, for each pair
of inputs k, k+1, the block's features with their two weights side by side (the operand of the CPU's bf16
dot product, and its tile unit's).
With act-order (a g_idx), input columns are permuted once so every group is contiguous; the kernels then
read x[:, perm]. N is padded to a multiple of BLOCK_N with zero weights that the caller slices off.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from slimlm.errors import SlimlmError
from slimlm.formats.quantized import QuantizedWeight

BLOCK_N = 64
# Each checkpoint width (formats.quantized.SUPPORTED_BITS) and the kernel width it is served at. 2- and 3-bit
# codes are widened to 4 at load: an unsigned code u of b bits is read as w = scale · (u − zero) at any width,
# so the 4-bit kernels give the checkpoint's weights exactly; the memory read is a 4-bit one (docs/limits.md).
SERVED_BITS = {2: 4, 3: 4, 4: 4, 8: 8}


@dataclass
class PackedWeight:
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int  # K when the checkpoint is per channel
    out_features: int  # before padding to BLOCK_N
    perm: torch.Tensor | None = None  # int64 [K]: read x[:, perm]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def padded_out_features(self) -> int:
        return self.codes.shape[0] * BLOCK_N

    @functools.cached_property
    def kernel_args(self) -> tuple[int, int, int, int, int]:
        """The C kernels' weight arguments (codes, scales and zeros addresses, blocks, group size), built once:
        a decode step makes ~120 quantized calls, and rebuilding them was a few µs of each."""
        blocks = self.codes.shape[0]
        return self.codes.data_ptr(), self.scales.data_ptr(), self.zeros.data_ptr(), blocks, self.group_size

    def to(self, device: torch.device | str) -> PackedWeight:
        perm = None if self.perm is None else self.perm.to(device)
        return PackedWeight(
            self.codes.to(device),
            self.scales.to(device),
            self.zeros.to(device),
            self.bits,
            self.group_size,
            self.out_features,
            perm,
        )

    def nbytes(self) -> int:
        """Bytes a matmul must read for the weight: what decode speed is decided by."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros))


def pack(q: QuantizedWeight) -> PackedWeight:
    """Repack checkpoint codes [N, K] (signed, compressed-tensors convention) into the kernel layout."""
    bits = SERVED_BITS[q.args.bits]
    n, k = q.codes.shape
    group = k if q.args.group_size == -1 else q.args.group_size
    # The codes' bytes, offset to unsigned (code + 2^(bits-1)) only after the one copy the transpose makes:
    # uint8 arithmetic wraps to exactly that. No wider or extra copies: an 8-bit lm_head is 233 MB a copy.
    offset = -q.args.qmin
    codes = q.codes.to(torch.int8).view(torch.uint8)
    zeros = torch.full_like(q.scale, -q.args.qmin, dtype=torch.int16) if q.zero is None else q.zero - q.args.qmin
    perm = None
    if q.g_idx is not None:
        perm = torch.argsort(q.g_idx.long(), stable=True)
        if not torch.equal(q.g_idx.long()[perm], torch.arange(k) // group):
            raise SlimlmError("g_idx does not split the input columns into equal groups; cannot repack this weight")
        codes = codes[:, perm]
    pad = -n % BLOCK_N
    scales = q.scale.to(torch.float16)
    if pad:
        codes = torch.cat([codes, codes.new_full((pad, k), -offset % 256)])  # unsigned 0 once offset
        zeros = torch.cat([zeros.to(torch.int16), zeros.new_zeros(pad, zeros.shape[1], dtype=torch.int16)])
        scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
    blocks = codes.shape[0] // BLOCK_N
    # [N, K] -> [blocks, K, BLOCK_N]
    codes = codes.reshape(blocks, BLOCK_N, k).transpose(1, 2).clone(memory_format=torch.contiguous_format)
    codes.add_(offset)  # in place: the clone is always a copy, never the caller's codes
    if bits == 4:
        half = BLOCK_N // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)
    return PackedWeight(
        codes=codes.contiguous(),
        scales=scales.reshape(blocks, BLOCK_N, -1).transpose(1, 2).contiguous(),
        zeros=zeros.to(torch.uint8).reshape(blocks, BLOCK_N, -1).transpose(1, 2).contiguous(),
        bits=bits,
        group_size=group,
        out_features=n,
        perm=perm,
    )


def pack_dense(weight: torch.Tensor) -> PackedWeight:
    """A float weight [N, K], fp32 or bf16 (then K even), in the kernel's blocks (see the module doc)."""
    n, k = weight.shape
    bits = {torch.float32: 32, torch.bfloat16: 16}[weight.dtype]
    if bits == 16 and k % 2:
        raise SlimlmError(f"a bf16 weight packs in pairs of inputs; {k} inputs is odd")
    w = torch.cat([weight, weight.new_zeros(-n % BLOCK_N, k)])
    blocks = w.shape[0] // BLOCK_N
    if bits == 16:  # [blocks, K/2, BLOCK_N, 2]
        w = w.reshape(blocks, BLOCK_N, k // 2, 2).transpose(1, 2).reshape(blocks, k, BLOCK_N)
    else:
        w = w.reshape(blocks, BLOCK_N, k).transpose(1, 2)
    none = torch.empty(blocks, 0, BLOCK_N)
    return PackedWeight(w.contiguous(), none.half(), none.byte(), bits, k, n)


def unpacked_codes(p: PackedWeight) -> torch.Tensor:
    """Unsigned codes [N_padded, K] in the permuted column order (dense weights: the weights)."""
    c = p.codes
    if p.bits == 16:
        blocks, k = c.shape[:2]
        return c.reshape(blocks, k // 2, BLOCK_N, 2).transpose(1, 2).reshape(blocks * BLOCK_N, k)
    if p.bits == 32:
        return c.transpose(1, 2).reshape(p.padded_out_features, p.in_features)
    if p.bits == 4:
        c = torch.cat([c & 0xF, c >> 4], dim=-1)
    return c.transpose(1, 2).reshape(p.padded_out_features, p.in_features)


def dequantize(p: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float weight [N_padded, K] in the permuted column order (what x[:, perm] multiplies)."""
    if p.bits in (16, 32):
        return unpacked_codes(p).to(dtype)
    per_row = p.scales.shape[1]
    scales = p.scales.to(dtype).transpose(1, 2).reshape(-1, per_row).repeat_interleave(p.group_size, dim=1)
    zeros = p.zeros.to(dtype).transpose(1, 2).reshape(-1, per_row).repeat_interleave(p.group_size, dim=1)
    return (unpacked_codes(p).to(dtype) - zeros) * scales
