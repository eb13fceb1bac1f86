"""What slimlm knows about the Llama family (Llama, Mistral, Qwen2; SmolLM is Llama), in one place.

Compression steps, the pruner and the GQA converter read names and groups from here instead of
hard-coding them, so a new architecture of the same shape is one entry.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYERS = "model.layers"  # the decoder layers' ModuleList
EMBED = "model.embed_tokens"
LM_HEAD = "lm_head"

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LINEARS = ATTENTION + MLP


def decoder_linear(tensor: str) -> str | None:
    """The linear (local name, e.g. mlp.up_proj) a stored tensor of a decoder layer belongs to
    (model.layers.3.mlp.up_proj.weight_scale), else None."""
    if not tensor.startswith(LAYERS + "."):
        return None
    module = tensor.removeprefix(LAYERS + ".").partition(".")[2].rpartition(".")[0]
    return module if module in LINEARS else None


@dataclass(frozen=True)
class Mapping:
    """An op and the linears that read its output: AWQ scales are folded across this edge."""

    prev: str  # module whose output feeds the balanced linears (an RMSNorm or a linear)
    linears: tuple[str, ...]  # linears reading that output; their input columns get scaled
    block: str  # module whose output error judges a scale (it contains the linears)


def awq_mappings(gqa: bool) -> list[Mapping]:
    """v→o only when every query head has its own KV head: with GQA, v's rows do not line up with o's columns."""
    maps = [Mapping("input_layernorm", ATTENTION[:3], "self_attn")]
    if not gqa:
        maps.append(Mapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"))
    maps.append(Mapping("post_attention_layernorm", MLP[:2], "mlp"))
    maps.append(Mapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"))
    return maps


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def linear_input_dims(config: dict) -> dict[str, int]:
    """in_features of each decoder-layer linear, from config.json alone."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    dims = dict.fromkeys(LINEARS, hidden)
    dims["self_attn.o_proj"] = heads * head_dim(config)
    dims["mlp.down_proj"] = config["intermediate_size"]
    return dims


# What each axis of a weight runs along, for structured pruning: "hidden" (the residual stream's channels),
# "heads" / "kv_heads" (head_dim rows or columns per head), "ffn" (MLP neurons), None (the vocabulary, kept).
MODEL_AXES = {
    f"{EMBED}.weight": (None, "hidden"),
    f"{LM_HEAD}.weight": (None, "hidden"),
    "model.norm.weight": ("hidden",),
}
LAYER_AXES = {  # names within a decoder layer
    "input_layernorm.weight": ("hidden",),
    "post_attention_layernorm.weight": ("hidden",),
    "self_attn.q_proj.weight": ("heads", "hidden"),
    "self_attn.q_proj.bias": ("heads",),
    "self_attn.k_proj.weight": ("kv_heads", "hidden"),
    "self_attn.k_proj.bias": ("kv_heads",),
    "self_attn.v_proj.weight": ("kv_heads", "hidden"),
    "self_attn.v_proj.bias": ("kv_heads",),
    "self_attn.o_proj.weight": ("hidden", "heads"),
    "self_attn.o_proj.bias": ("hidden",),
    "mlp.gate_proj.weight": ("ffn", "hidden"),
    "mlp.up_proj.weight": ("ffn", "hidden"),
    "mlp.down_proj.weight": ("hidden", "ffn"),
    # Qwen3's per-head q and k norms: one weight over head_dim that every head shares, so no cut touches it
    "self_attn.q_norm.weight": ("head_dim",),
    "self_attn.k_norm.weight": ("head_dim",),
}
# The config field that holds each pruned dimension's size ("layers": the decoder layers' count).
SIZE_FIELD = {
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "ffn": "intermediate_size",
    "layers": "num_hidden_layers",
}
