"""A decoder layer's small operations in one C call each (cpu_layer.c): the residual add with its RMSNorm, the
rotary embedding with the KV-cache write, and SiLU·up. Same contracts as reference.add_rms_norm,
reference.rotary_kv_write and reference.silu_mul, which run instead for what the C code does not cover (fp16,
quantized KV caches, tensors that are not laid out flat).

And all decoder layers in one call for decode steps (DecodeStack): the same kernels in the same order as the
model's modules call them, without the ~40 Python-level calls a layer costs otherwise.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from slimlm.formats import kv_cache, kv_int4
from slimlm.kernels import cpu_attention, cpu_gemm, cpu_library, reference
from slimlm.kernels.packed import PackedWeight

DTYPES = (torch.float32, torch.bfloat16)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of h, h) for h = x + residual; h is written into `residual` in place (not a new tensor)."""
    flat = [x, weight] if residual is None else [x, weight, residual]
    if x.dtype not in DTYPES or any(t.dtype != x.dtype or not t.is_contiguous() for t in flat):
        return reference.add_rms_norm(x, weight, eps, residual)
    out = torch.empty_like(x)
    dim = x.shape[-1]
    cpu_library.load().slimlm_add_rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // dim,
        dim,
        eps,
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out, x if residual is None else residual


def row_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.row_logprobs in one C pass a row for the maximum and one for the sum (no fp32 copy of the
    logits, no log-softmax written out: scoring a Qwen2.5 prompt token reads 152K logits)."""
    if logits.dtype not in DTYPES or not logits.is_contiguous() or logits.dim() != 2:
        return reference.row_logprobs(logits, targets)
    rows, vocab = logits.shape
    targets = targets.to(torch.int64).contiguous()
    chosen, best = torch.empty(rows), torch.empty(rows)
    best_ids = torch.empty(rows, dtype=torch.int64)
    cpu_library.load().slimlm_row_logprobs(
        logits.data_ptr(),
        rows,
        vocab,
        int(logits.dtype == torch.bfloat16),
        targets.data_ptr(),
        chosen.data_ptr(),
        best.data_ptr(),
        best_ids.data_ptr(),
        torch.get_num_threads(),
    )
    return chosen, best, best_ids


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """reference.silu_mul in one C pass over the rows, rounded as torch rounds each step."""
    if gate_up.dtype not in DTYPES or not gate_up.is_contiguous():
        return reference.silu_mul(gate_up)
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    cpu_library.load().slimlm_silu_mul(
        gate_up.data_ptr(),
        out.data_ptr(),
        gate_up.numel() // (2 * width),
        width,
        int(gate_up.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


def rotary_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotated q [T, Hq, D]; rotated keys and the values written at `slots` into the caches: float ones of qkv's
    dtype, unscaled, 8-bit ones (int8, fp8 e4m3) with both per-head scales or neither (a scale of 1), or 4-bit rows;
    quantized keys less k_offset [Hkv, D] when given (fp8 keys, and then q, rotated: reference.rotary_kv_write)."""
    if not _c_writes(qkv, cos, signed_sin, slots, k_cache, v_cache, k_scale, v_scale, k_offset):
        return reference.rotary_kv_write(qkv, cos, signed_sin, slots, k_cache, v_cache, k_scale, v_scale, k_offset)
    kv_heads, dim = k_cache.shape[2], cos.shape[-1]
    heads = qkv.shape[1] // dim - 2 * kv_heads
    q = torch.empty(qkv.shape[0], heads, dim, dtype=qkv.dtype)
    (ks, vs), _held = cpu_attention._scales(k_scale, v_scale)
    offset = None if k_offset is None else k_offset.to(torch.float32).contiguous()
    rotation = kv_int4.rotation(dim) if k_cache.dtype == torch.uint8 else kv_cache.key_rotation(k_cache.dtype, dim)
    cpu_library.load().slimlm_rotary_kv_write(
        qkv.data_ptr(),
        qkv.shape[0],
        heads,
        kv_heads,
        dim,
        cos.data_ptr(),
        signed_sin.data_ptr(),
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        q.data_ptr(),
        int(qkv.dtype == torch.bfloat16),
        cpu_attention.KINDS[k_cache.dtype],
        ks,
        vs,
        0 if offset is None else offset.data_ptr(),
        0 if rotation is None else rotation.data_ptr(),
        torch.get_num_threads(),
    )
    return q


MAX_KV_VALUES = 16 * 256  # a token's keys, kv_heads·head_dim, that the C write's scratch holds (MAX_KV_BYTES)


def _c_writes(qkv, cos, signed_sin, slots, k_cache, v_cache, k_scale, v_scale, k_offset=None) -> bool:
    """Whether the C rotary + KV write takes these: flat tensors of one float dtype, and caches of that dtype
    unscaled, 8-bit ones with both scales or neither, or 4-bit ones (head_dim at most 256, its offsets fp32)."""
    flat = all(t.dtype == qkv.dtype and t.is_contiguous() for t in (qkv, cos, signed_sin))
    caches = k_cache.dtype == v_cache.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
    if k_cache.dtype == torch.uint8:
        caches = (
            caches
            and k_scale is None
            and v_scale is None
            and cos.shape[-1] <= 256
            and k_cache.shape[2] * cos.shape[-1] <= MAX_KV_VALUES
            and (k_offset is None or k_offset.is_contiguous())
        )
    elif k_cache.dtype in cpu_attention.EIGHT_BIT:
        fits = k_cache.shape[2] * k_cache.shape[3] <= MAX_KV_VALUES and cos.shape[-1] <= 256  # a rotated head
        offset = k_offset is None or k_offset.is_contiguous()
        caches = caches and (k_scale is None) == (v_scale is None) and fits and offset
    elif k_offset is not None:
        return False
    else:
        caches = caches and k_cache.dtype == qkv.dtype and k_scale is None and v_scale is None
    return qkv.dtype in DTYPES and flat and caches and slots.dtype == torch.int64 and slots.is_contiguous()


class _Linear(ctypes.Structure):  # cpu_layer.c's Linear
    _fields_ = (
        [(name, ctypes.c_void_p) for name in ("codes", "scales", "zeros")]
        + [
            (name, ctypes.c_int64)
            for name in ("blocks", "group", "bits", "in_features", "out_features", "code_rows", "loop")
        ]
        + [("bias", ctypes.c_void_p)]
    )


LOOPS = {"bf16-codes": 0, "bf16-weights": 0, "fused": 2, "bf16-amx": 3, "int8": 4}  # path -> C loop
BF16_LOOPS = (0, 3)


class _Layer(ctypes.Structure):  # cpu_layer.c's Layer
    _fields_ = [(name, ctypes.c_void_p) for name in ("norm1", "norm2", "k_scale", "v_scale", "k_offset", "rotation")]
    _fields_ += [("w", _Linear * 4)]


class DecodeStack:
    """A decode step through every decoder layer as a single C call: each layer's RMSNorm weights, four packed
    linears (joined q/k/v, o, joined gate/up, down) with their biases (None for none) and the attention shape,
    bound once; called with one token per sequence. kv_scales() gives each layer's (k_scale, v_scale, k_offset)
    for an 8-bit KV cache; it is asked when a plan is first made (they are set after the model's backend)."""

    def __init__(
        self,
        layers: list[tuple[tuple[torch.Tensor, torch.Tensor], list[PackedWeight], list[torch.Tensor | None]]],
        eps: float,
        heads: int,
        kv_heads: int,
        head_dim: int,
        kv_scales: Callable[[], list[tuple]] | None = None,
    ) -> None:
        self.layers, self.eps, self.kv_scales = layers, eps, kv_scales
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, head_dim**-0.5
        self._plans: dict[tuple, tuple | None] = {}

    @staticmethod
    def applies(
        dtype: torch.dtype,
        linears: list[PackedWeight | None],
        biases: list[torch.Tensor | None],
        heads: int,
        kv_heads: int,
        head_dim: int,
    ) -> bool:
        """Whether a layer of this dtype, these linears and biases and this attention shape can run in the C call
        here (biases of the layer's dtype, laid out flat)."""
        return (
            cpu_library.available()
            and hasattr(cpu_library.load(), "slimlm_decode_layers")
            and dtype in DTYPES
            and all(w is not None and w.perm is None for w in linears)
            and all(b is None or (b.dtype == dtype and b.is_contiguous()) for b in biases)
            and cpu_attention.kernel_takes(heads, kv_heads, head_dim)
        )

    def _plan(self, rows: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple | None:
        """The layers as the C code takes them, with the GEMM loop cpu_gemm picks for this many rows, and the fp32
        scales they point to (kept alive with them); None where a layer cannot run in the call."""
        key = (rows, dtype, kv_dtype, cpu_gemm.quantizes_activations())  # the loops differ inside exact_activations
        if key not in self._plans:
            scales = self.kv_scales() if self.kv_scales else [(None, None, None)] * len(self.layers)
            rotation = kv_cache.key_rotation(kv_dtype, self.head_dim)
            layers, held = [], [rotation]
            for (norms, linears, biases), (k_scale, v_scale, k_offset) in zip(self.layers, scales, strict=True):
                loops = [LOOPS.get(cpu_gemm.path(rows, dtype, w)) for w in linears]
                bf16 = dtype == torch.bfloat16  # bf16 x runs the bf16 loops only, fp32 x the others
                if (
                    not all(loop is not None and (loop in BF16_LOOPS) == bf16 for loop in loops)
                    or (k_scale is None) != (v_scale is None)
                    or (k_scale is not None and kv_dtype not in cpu_attention.EIGHT_BIT)
                ):
                    layers = None
                    break
                code_rows = [cpu_gemm.CODE_MAX_ROWS.get(w.bits, 0) for w in linears]  # dense fp32: none
                bias = [None if b is None else b.data_ptr() for b in biases]
                linear = [
                    _Linear(*w.kernel_args, w.bits, w.in_features, w.out_features, rows, loop, b)
                    for w, rows, loop, b in zip(linears, code_rows, loops, bias, strict=True)
                ]
                pointers, tensors = cpu_attention._scales(k_scale, v_scale)
                offset = None if k_offset is None else k_offset.float().contiguous()
                held += [tensors, offset]
                keys = [None if t is None else t.data_ptr() for t in (offset, rotation)]
                norm_ptrs = (norms[0].data_ptr(), norms[1].data_ptr())
                layers.append(_Layer(*norm_ptrs, *pointers, *keys, (_Linear * 4)(*linear)))
            self._plans[key] = None if layers is None else ((_Layer * len(layers))(*layers), held)
        return self._plans[key]

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        slots: torch.Tensor,
        kv_caches: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's output, the residual stream) for the embeddings x [S, hidden], one token per
        sequence, x becoming the stream; kv_caches [layers, 2, blocks, block_size, kv_heads, head_dim]. None when
        these tensors are not what the C code takes (the caller runs the modules instead)."""
        indices = ((slots, torch.int64), (block_tables, torch.int32), (seq_lens, torch.int32))
        cache_ok = kv_caches.dtype in (x.dtype, *cpu_attention.EIGHT_BIT) and kv_caches.is_contiguous()
        if (
            not cache_ok
            or any(t.dtype != x.dtype or not t.is_contiguous() for t in (x, cos, signed_sin))
            or any(t.dtype != dtype or not t.is_contiguous() for t, dtype in indices)
            or kv_caches.shape[-2] * kv_caches.shape[-1] > MAX_KV_VALUES
        ):
            return None
        plan = self._plan(x.shape[0], x.dtype, kv_caches.dtype)
        if plan is None:
            return None
        plan = plan[0]
        out, tmp = torch.empty_like(x), torch.empty_like(x)
        status = cpu_library.load().slimlm_decode_layers(
            plan,
            len(plan),
            x.data_ptr(),
            tmp.data_ptr(),
            out.data_ptr(),
            self.eps,
            cos.data_ptr(),
            signed_sin.data_ptr(),
            slots.data_ptr(),
            kv_caches.data_ptr(),
            kv_caches[0].nbytes,
            block_tables.data_ptr(),
            block_tables.shape[1],
            seq_lens.data_ptr(),
            x.shape[0],
            self.heads,
            self.kv_heads,
            self.head_dim,
            kv_caches.shape[3],
            self.scale,
            int(x.dtype == torch.bfloat16),
            cpu_attention.KINDS[kv_caches.dtype],
            int(cpu_library.has_amx()),
            torch.get_num_threads(),
        )
        if status:
            raise MemoryError("the decode step could not allocate its buffers")
        return out, x
