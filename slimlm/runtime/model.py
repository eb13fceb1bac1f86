"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3; SmolLM is Llama) over one packed batch of tokens per step.

Tokens of all scheduled sequences are concatenated: every linear layer sees a single [tokens, hidden] matrix,
and only attention knows where one sequence ends and the next begins (through `StepInputs`). Module and
parameter names follow transformers', so checkpoints load by name. Linear layers hold either a float
weight or a PackedWeight that slimlm.kernels multiplies without ever materializing the float matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from slimlm import kernels
from slimlm.kernels.packed import BLOCK_N, PackedWeight


@dataclass
class StepInputs:
    """Where each packed token sits: its position, its KV slot, and each sequence's cache (see kernels)."""

    positions: torch.Tensor  # int64 [T]
    slots: torch.Tensor  # int64 [T]: block_id · block_size + offset, where the token's K/V are written
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]: cached tokens per sequence after this step
    query_start: torch.Tensor  # int32 [S+1]
    query_lens: list[int]  # the same on the host, built once per step so no layer syncs to read it
    observe: torch.Tensor | None = None  # int64 rows whose rotated queries every layer keeps (kv_policy snapkv)
    observed: list[torch.Tensor] = field(default_factory=list)  # per layer: q[observe], [len(observe), heads, D]


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.dtype = in_features, dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None
        self.quant_matmul = kernels.quant_matmul  # the load-time Backend's, once set_backend ran

    def set_packed(self, packed: PackedWeight) -> None:
        self.packed = packed
        self.weight = None  # the float weight is never needed again

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        y = self.quant_matmul(x, self.packed)
        return y if self.bias is None else y + self.bias


def fuse(parts: list[Linear]) -> Linear | None:
    """One Linear whose output is the parts' outputs side by side (q, k and v; gate and up: they read the same
    input), so a step makes one call where it made several. None when their weights cannot be joined as they
    are: all float, or all packed alike (bits, groups, act-order permutation) in whole blocks of features."""
    if len({p.bias is None for p in parts}) > 1:
        return None
    if all(p.packed is None for p in parts):
        weight, packed = torch.cat([p.weight for p in parts]), None
    elif all(p.packed is not None for p in parts):
        ws = [p.packed for p in parts]
        alike = all(w.bits == ws[0].bits and w.group_size == ws[0].group_size and _same(w.perm, ws[0].perm) for w in ws)
        if not alike or any(w.out_features % BLOCK_N for w in ws[:-1]):
            return None
        weight = None
        packed = PackedWeight(
            *(torch.cat([getattr(w, key) for w in ws]) for key in ("codes", "scales", "zeros")),
            ws[0].bits,
            ws[0].group_size,
            sum(w.out_features for w in ws),
            ws[0].perm,
        )
    else:
        return None
    out_features = weight.shape[0] if packed is None else packed.out_features
    with torch.device("meta"):
        joined = Linear(parts[0].in_features, out_features, parts[0].bias is not None, parts[0].dtype)
    joined.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
    joined.packed = packed
    if joined.bias is not None:
        joined.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    joined.quant_matmul = parts[0].quant_matmul
    return joined


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.add_rms_norm = kernels.reference.add_rms_norm  # the load-time Backend's, once set_backend ran

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of h, h) for the residual stream h = x + residual; `residual` may be updated in place."""
        return self.add_rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.heads * self.head_dim, bias, dtype)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, bias, dtype)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim, bias, dtype)
        self.o_proj = Linear(self.heads * self.head_dim, hidden, getattr(config, "attention_bias", False), dtype)
        self.qkv = [self.q_proj, self.k_proj, self.v_proj]  # one joined Linear after fuse_projections()
        self.scale = self.head_dim**-0.5
        self.attention = kernels.paged_attention  # the load-time Backend's, once set_backend ran
        self.rotary_kv_write = kernels.reference.rotary_kv_write  # likewise
        self.k_scale = self.v_scale = None  # fp32 [kv_heads] for an fp8/int8 cache (loader.set_kv_cache)
        self.k_offset = None  # fp32 [kv_heads, head_dim]: the mean key a 4-bit or fp8 cache's keys lose (ModelRunner)
        self.qk_norm = config.model_type == "qwen3"  # each head's q and k RMS-normed before RoPE
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def normed_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """q and k of every head RMS-normed over head_dim (Qwen3), v as it is: the rotary kernel's input."""
        rows, q_width, kv_width = qkv.shape[0], self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q = self.q_norm(q.reshape(-1, self.head_dim).contiguous())[0].reshape(rows, q_width)
        k = self.k_norm(k.reshape(-1, self.head_dim).contiguous())[0].reshape(rows, kv_width)
        return torch.cat([q, k, v], dim=-1)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepInputs, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, head_dim]
        qkv = joined_outputs(self.qkv, x)
        if self.qk_norm:
            qkv = self.normed_heads(qkv)
        q = self.rotary_kv_write(
            qkv, cos, sin, step.slots, k_cache, v_cache, self.k_scale, self.v_scale, k_offset=self.k_offset
        )
        if step.observe is not None:
            step.observed.append(q[step.observe])
        out = self.attention(
            q,
            k_cache,
            v_cache,
            step.block_tables,
            step.seq_lens,
            step.query_start,
            self.scale,
            self.k_scale,
            self.v_scale,
            query_lens=step.query_lens,
        )
        return self.o_proj(out.reshape(x.shape[0], self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, False, dtype)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, False, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, dtype)
        self.gate_up = [self.gate_proj, self.up_proj]  # one joined Linear after fuse_projections()
        self.silu_mul = kernels.reference.silu_mul  # the load-time Backend's, once set_backend ran
        self.row_pieces = kernels.one_piece

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = self.gate_up[0].packed if len(self.gate_up) == 1 else None
        pieces = 1 if joined is None else self.row_pieces(x, joined)
        if pieces > 1:  # a long prompt's rows in turn, each piece's gate/up output reused memory (cpu_gemm.row_pieces)
            return torch.cat(
                [self.down_proj(self.silu_mul(self.gate_up[0](piece))) for piece in x.tensor_split(pieces)]
            )
        return self.down_proj(self.silu_mul(joined_outputs(self.gate_up, x)))


def joined_outputs(linears: list[Linear], x: torch.Tensor) -> torch.Tensor:
    return linears[0](x) if len(linears) == 1 else torch.cat([linear(x) for linear in linears], dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(config, dtype)
        self.mlp = MLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x, residual, cos, sin, step: StepInputs, kv_cache: torch.Tensor):
        """(this layer's output, the residual stream before it): the stream's adds happen in the next norm,
        fused with it (as vLLM does), so the model's output is x + residual."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, step, kv_cache), residual)
        return self.mlp(h), residual


class Decoder(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config, dtype)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)
        self.cos = self.sin = None  # [positions, head_dim], from set_rope (sin with its first half negated)
        self.decode_stack = None  # all layers in one call for decode steps, where the backend has it (set_backend)
        self.row_logprobs = kernels.reference.row_logprobs  # scored prompt rows; the Backend's once set_backend ran

    def fuse_projections(self, after_layer: Callable[[], None] = lambda: None) -> None:
        """Join q, k, v and gate, up into one Linear each where their weights allow (see fuse); the parts go.
        `after_layer` runs once a layer's parts are gone (the loader hands their memory back there)."""
        for layer in self.model.layers:
            for owner, names, attr in (
                (layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv"),
                (layer.mlp, ("gate_proj", "up_proj"), "gate_up"),
            ):
                joined = fuse([getattr(owner, name) for name in names])
                if joined is not None:
                    for name in names:
                        delattr(owner, name)
                    owner.add_module(f"{attr}_proj", joined)  # vLLM's names for the joined projections
                    setattr(owner, attr, [joined])
            after_layer()

    def set_backend(self, backend: kernels.Backend) -> None:
        """Bind every layer to the kernels chosen for the model's device, once, instead of per call."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.quant_matmul = backend.quant_matmul
            elif isinstance(module, Attention):
                module.attention, module.rotary_kv_write = backend.paged_attention, backend.rotary_kv_write
            elif isinstance(module, RMSNorm):
                module.add_rms_norm = backend.add_rms_norm
            elif isinstance(module, MLP):
                module.silu_mul, module.row_pieces = backend.silu_mul, backend.row_pieces
        self.decode_stack = None if backend.decode_stack is None else self._decode_stack(backend.decode_stack)
        self.row_logprobs = backend.row_logprobs
        self.backend_name = backend.name

    def _decode_stack(self, factory):
        """Every layer in one call for decode steps (kernels' DecodeStack), or None unless all of them allow it:
        the four projections packed (q/k/v and gate/up joined), attention the C kernel's shape."""
        dtype, layers = self.model.norm.weight.dtype, []
        attn = self.model.layers[0].self_attn
        if attn.qk_norm:  # the C layer has no per-head q/k norm: Qwen3 decodes through the modules
            return None
        for layer in self.model.layers:
            parts = [*layer.self_attn.qkv, layer.self_attn.o_proj, *layer.mlp.gate_up, layer.mlp.down_proj]
            linears, biases = [p.packed for p in parts], [p.bias for p in parts]
            if len(parts) != 4 or not factory.applies(dtype, linears, biases, attn.heads, attn.kv_heads, attn.head_dim):
                return None
            layers.append(((layer.input_layernorm.weight, layer.post_attention_layernorm.weight), linears, biases))
        scales = [layer.self_attn for layer in self.model.layers]  # their KV scales come after (loader.set_kv_cache)
        return factory(
            layers,
            self.model.norm.eps,
            attn.heads,
            attn.kv_heads,
            attn.head_dim,
            lambda: [(a.k_scale, a.v_scale, a.k_offset) for a in scales],
        )

    def set_rope(self, max_positions: int, device: str) -> None:
        cos, sin = rope_tables(self.config, max_positions)
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # pairs with roll() in reference.rotate
        dtype = self.model.norm.weight.dtype
        self.cos, self.sin = cos.to(device, dtype), signed_sin.to(device, dtype)

    def forward(self, input_ids: torch.Tensor, step: StepInputs, kv_caches: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; kv_caches [layers, 2, blocks, block_size, kv_heads, D]."""
        x, residual = self.model.embed_tokens(input_ids).to(self.model.norm.weight.dtype), None
        cos, sin = self.cos[step.positions], self.sin[step.positions]
        if self.decode_stack is not None and step.observe is None and all(n == 1 for n in step.query_lens):
            out = self.decode_stack(x, cos, sin, step.slots, kv_caches, step.block_tables, step.seq_lens)
            if out is not None:  # None when this step's tensors are not what it takes: the modules run instead
                return self.model.norm(*out)[0]
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, step, kv_cache)
        return self.model.norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: whoever reads them takes fp32 per slice. (A scoring step's fp32 logits for a
        thousand rows were 600 MB, written to fresh pages: ~10% of an eval's time.)"""
        return self.lm_head(hidden)


def rope_tables(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, head_dim] from transformers' own rotary module, so every RoPE variant
    (default, linear, llama3, yarn...) matches the reference implementation exactly."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config=config)
    positions = torch.arange(max_positions)[None]
    cos, sin = rotary(torch.empty(1, dtype=torch.float32), positions)
    return cos[0], sin[0]
