"""Structured pruning, Minitron style: remove whole layers, attention heads, MLP neurons and hidden channels.

Importance comes from activations on calibration data, gathered in one pass of the shared layer-by-layer
pipeline (a step that changes nothing, so every layer sees the float model's inputs):
- a query head: the RMS over tokens of its contribution to the layer's output, |W_o[:, h] · o_h(t)|, o_h(t)
  being the head's attention output;
- an MLP neuron: the RMS over tokens of its activation act(gate)·up, times the norm of its down_proj column;
- a hidden channel: the RMS of each RMSNorm output in that channel, summed over the norms of all layers;
- a layer: the mean cosine distance between its input and output hidden states (ShortGPT's block influence:
  a layer that barely turns the residual stream costs least to drop).
The head and neuron scores measure what removing the unit takes from the output; a bare activation norm
would not (scaling up_proj's row by c and down_proj's column by 1/c changes it, not the function).

Widths stay uniform (every layer keeps the same counts, each layer its own most important units), so the
result is a standard config of the same architecture. Kept units keep their order: keeping everything is
the identity. Query heads go inside each KV head's group (every group keeps as many), or, when the count
asks for it, whole groups go with their KV head.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from slimlm import arch
from slimlm.compress import pipeline
from slimlm.errors import FieldError, SlimlmError

GROUP_SIZES = (32, 64, 128)  # the quantization group sizes a later `compress gptq|awq|rtn` would use
# The candidates `--target-params` compares: the dimensions each shrinks, all by the same fraction.
FAMILIES = {
    "depth": ("layers",),
    "width-mlp": ("ffn",),
    "width": ("ffn", "hidden"),
    "width-heads": ("ffn", "hidden", "heads"),
    "width+depth": ("ffn", "hidden", "layers"),
}


@dataclass(frozen=True)
class Shape:
    """The sizes a pruned model has (uniform across its layers)."""

    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    layers: int

    @classmethod
    def of(cls, config) -> Shape:
        sizes = {dim: getattr(config, field, None) for dim, field in arch.SIZE_FIELD.items()}
        sizes["kv_heads"] = sizes["kv_heads"] or sizes["heads"]  # old configs leave it out: multi-head
        return cls(**sizes)


@dataclass
class Importance:
    heads: list[torch.Tensor]  # per layer: [num_attention_heads]
    ffn: list[torch.Tensor]  # per layer: [intermediate_size]
    hidden: torch.Tensor  # [hidden_size]
    layers: torch.Tensor  # [num_hidden_layers]: cosine distance between the layer's input and output


@dataclass
class Keep:
    """What stays, as original indices in their original order."""

    layers: list[int]
    hidden: list[int]
    heads: list[list[int]]  # per kept layer
    kv_heads: list[list[int]]
    ffn: list[list[int]]


class _Observer:
    """A pipeline step that changes nothing: it sums each layer's unit statistics as the calibration passes."""

    needs_data = True
    changes_layer = False
    float_target = 0.0  # the pipeline's float chain: not wanted (pipeline.Step)

    def __init__(self, config):
        self.heads, self.head_dim = config.num_attention_heads, arch.head_dim(config.to_dict())
        self.sums: list[dict] = []

    def observe(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> list:
        n, hd = self.heads, self.head_dim
        w_o = layer.self_attn.o_proj.weight.detach().double().view(-1, n, hd)  # [hidden, head, head_dim]
        gram = torch.einsum("dnh,dnk->nhk", w_o, w_o)  # |W_h x|² = xᵀ (W_hᵀ W_h) x, per head
        s = {
            "heads": 0.0,
            "ffn": 0.0,
            "norms": [0.0, 0.0],
            "distance": 0.0,
            "tokens": 0,
            "down_norm": layer.mlp.down_proj.weight.detach().double().norm(dim=0),
        }
        self.sums.append(s)

        def heads(module, args):
            x = args[0].detach().double().reshape(-1, n, hd)
            s["heads"] = s["heads"] + torch.einsum("tnh,nhk,tnk->n", x, gram, x)

        def neurons(module, args):
            a = args[0].detach().double().flatten(0, -2)
            s["ffn"] = s["ffn"] + (a * a).sum(0)

        def channels(which: int):
            def hook(module, args, out):
                y = out.detach().double().flatten(0, -2)
                s["norms"][which] = s["norms"][which] + (y * y).sum(0)

            return hook

        def turn(module, args, kwargs, out):
            x = (args[0] if args else kwargs["hidden_states"]).detach().double().flatten(0, -2)
            y = (out[0] if isinstance(out, tuple) else out).detach().double().flatten(0, -2)
            s["distance"] += (1 - F.cosine_similarity(x, y, dim=-1)).sum().item()
            s["tokens"] += x.shape[0]

        return [
            layer.self_attn.o_proj.register_forward_pre_hook(heads),
            layer.mlp.down_proj.register_forward_pre_hook(neurons),
            layer.input_layernorm.register_forward_hook(channels(0)),
            layer.post_attention_layernorm.register_forward_hook(channels(1)),
            layer.register_forward_hook(turn, with_kwargs=True),
        ]

    def apply(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> pipeline.StepResult:
        return pipeline.StepResult()

    def arguments(self) -> dict:
        return {}

    def importance(self) -> Importance:
        def rms(total, s):
            return (total / s["tokens"]).sqrt().float()

        return Importance(
            heads=[rms(s["heads"], s) for s in self.sums],
            ffn=[rms(s["ffn"], s) * s["down_norm"].float() for s in self.sums],
            hidden=sum(rms(total, s) for s in self.sums for total in s["norms"]),
            layers=torch.tensor([s["distance"] / s["tokens"] for s in self.sums]),
        )


def importance(model: nn.Module, windows: torch.Tensor, batch_size: int = 8, progress: bool = True) -> Importance:
    """Score every layer, head, neuron and hidden channel of `model` on the calibration `windows`."""
    observer = _Observer(model.config)
    pipeline.run(model, [observer], windows, pipeline.Passes(batch_size, report_error=False, progress=progress))
    return observer.importance()


def head_counts(config) -> list[int]:
    """Query-head counts the KV grouping allows: fewer heads in every group, or fewer whole groups."""
    shape = Shape.of(config)
    per_group = shape.heads // shape.kv_heads
    return sorted(
        {shape.kv_heads * i for i in range(1, per_group + 1)} | {per_group * i for i in range(1, shape.kv_heads + 1)}
    )


def kv_heads_for(config, heads: int) -> int:
    """The KV heads a model pruned to `heads` query heads keeps: all of them (each group keeps heads/kv query
    heads), else whole groups; a one-line error naming the counts that work when neither splits evenly."""
    shape = Shape.of(config)
    per_group = shape.heads // shape.kv_heads
    if heads % shape.kv_heads == 0 and 0 < heads // shape.kv_heads <= per_group:
        return shape.kv_heads
    if heads % per_group == 0 and 0 < heads // per_group <= shape.kv_heads:
        return heads // per_group
    valid = ", ".join(map(str, head_counts(config)))
    raise FieldError(
        "heads",
        f"{heads} breaks the grouping of {shape.heads} query heads over {shape.kv_heads} "
        f"KV heads ({per_group} per KV head); counts that work: {valid}",
    )


def _top(scores: torch.Tensor, count: int) -> list[int]:
    return sorted(torch.topk(scores, count).indices.tolist())


def select(scores: Importance, config, shape: Shape) -> Keep:
    """The most important units for `shape`: per layer for heads and neurons, across layers for channels."""
    current = Shape.of(config)
    per_group = current.heads // current.kv_heads
    layers = _top(scores.layers, shape.layers)
    heads, kv_heads, ffn = [], [], []
    for i in layers:
        score = scores.heads[i].view(current.kv_heads, per_group)
        if shape.kv_heads == current.kv_heads:  # every group keeps its best heads
            groups = list(range(current.kv_heads))
            keep = shape.heads // shape.kv_heads
            heads.append([g * per_group + j for g in groups for j in _top(score[g], keep)])
        else:  # whole groups go, with their KV head
            groups = _top(score.sum(1), shape.kv_heads)
            heads.append([g * per_group + j for g in groups for j in range(per_group)])
        kv_heads.append(groups)
        ffn.append(_top(scores.ffn[i], shape.ffn))
    return Keep(layers, _top(scores.hidden, shape.hidden), heads, kv_heads, ffn)


def _index(kept: list[int], dim: str, head_dim: int) -> torch.Tensor:
    """Rows or columns to keep: a head is head_dim consecutive ones."""
    if dim in ("heads", "kv_heads"):
        return torch.tensor([h * head_dim + j for h in kept for j in range(head_dim)])
    return torch.tensor(kept)


def pruned_config(config, shape: Shape, layers: list[int]):
    """A copy of `config` with the pruned sizes; head_dim written out, as hidden/heads no longer gives it."""
    out = copy.deepcopy(config)
    out.head_dim = arch.head_dim(config.to_dict())
    for dim, field in arch.SIZE_FIELD.items():
        setattr(out, field, getattr(shape, dim))
    if getattr(config, "layer_types", None):  # per-layer attention kinds (sliding window, ...) follow their layers
        out.layer_types = [config.layer_types[i] for i in layers]
    return out


@torch.no_grad()
def prune(model: nn.Module, keep: Keep) -> nn.Module:
    """A new model of the same class holding only the kept units' weights."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config, state = model.config, model.state_dict()
    hd = arch.head_dim(config.to_dict())
    shape = Shape(len(keep.hidden), len(keep.heads[0]), len(keep.kv_heads[0]), len(keep.ffn[0]), len(keep.layers))
    known = set(arch.MODEL_AXES) | {
        f"{arch.LAYERS}.{i}.{n}" for i in range(config.num_hidden_layers) for n in arch.LAYER_AXES
    }
    if set(state) - known:
        raise SlimlmError(
            f"cannot prune a {config.model_type} model: it has weights the pruner does not know "
            f"({', '.join(sorted(set(state) - known)[:3])})"
        )

    def take(tensor: torch.Tensor, axes: tuple, index: dict[str, list[int]]) -> torch.Tensor:
        for axis, dim in enumerate(axes):
            if dim in index:  # the vocabulary (None) and head_dim are never cut
                tensor = tensor.index_select(axis, _index(index[dim], dim, hd))
        return tensor.contiguous()

    new = {
        name: take(state[name], axes, {"hidden": keep.hidden})
        for name, axes in arch.MODEL_AXES.items()
        if name in state
    }
    for j, i in enumerate(keep.layers):
        index = {"hidden": keep.hidden, "heads": keep.heads[j], "kv_heads": keep.kv_heads[j], "ffn": keep.ffn[j]}
        for local, axes in arch.LAYER_AXES.items():
            if f"{arch.LAYERS}.{i}.{local}" in state:
                new[f"{arch.LAYERS}.{j}.{local}"] = take(state[f"{arch.LAYERS}.{i}.{local}"], axes, index)
    with init_empty_weights(include_buffers=False):
        out = AutoModelForCausalLM.from_config(pruned_config(config, shape, keep.layers), dtype=model.dtype)
    out.load_state_dict(new, strict=True, assign=True)
    if getattr(out.config, "tie_word_embeddings", False):
        out.tie_weights()
    out.generation_config = copy.deepcopy(model.generation_config)
    return out.eval()


def count_parameters(model: nn.Module, shape: Shape) -> int:
    """The parameters `model` has once pruned to `shape` (exact: from the weight axes; tied weights once)."""
    hd = arch.head_dim(model.config.to_dict())
    size = {
        None: model.config.vocab_size,
        "hidden": shape.hidden,
        "heads": shape.heads * hd,
        "kv_heads": shape.kv_heads * hd,
        "ffn": shape.ffn,
        "head_dim": hd,
    }
    names = {name for name, _ in model.named_parameters()}  # tied weights appear once

    def count(table: dict, prefix: str) -> int:
        return sum(math.prod(size[a] for a in axes) for name, axes in table.items() if prefix + name in names)

    return count(arch.MODEL_AXES, "") + shape.layers * count(arch.LAYER_AXES, f"{arch.LAYERS}.0.")


def alignment(size: int) -> int:
    """The largest quantization group size that divides a dimension (1 if none): widths the search keeps to."""
    return max([g for g in GROUP_SIZES if size % g == 0], default=1)


def hidden_step(config, heads: int) -> int:
    """What a hidden width must be a multiple of: the head count (transformers' Llama config requires
    hidden_size % num_attention_heads == 0, even with head_dim given) and the model's own group alignment."""
    return math.lcm(heads, alignment(config.hidden_size))


def _sizes(config, dim: str, heads: int) -> list[int]:
    """The sizes the search tries for one dimension (those below today's, and today's)."""
    current = Shape.of(config)
    if dim == "layers":
        return list(range(1, current.layers + 1))
    if dim == "heads":
        return head_counts(config)
    step = hidden_step(config, heads) if dim == "hidden" else alignment(current.ffn)
    return sorted({*range(step, getattr(current, dim), step), getattr(current, dim)})


def _deepest_cut(shape: Shape, current: Shape, dims: tuple[str, ...]) -> float:
    return max(1 - getattr(shape, dim) / getattr(current, dim) for dim in dims)


def candidates(model: nn.Module, target: float, tolerance: float = 0.03) -> dict[str, Shape]:
    """For each family, a shape with at most `target` of today's parameters: among those within `tolerance`
    of it, the one that shrinks its dimensions most evenly (the least-cut dimension cut least); the largest
    one when none is that close. A family that cannot reach the target, or that repeats an earlier one's
    shape (one of its dimensions could not move), is left out."""
    config = model.config
    current = Shape.of(config)
    total = count_parameters(model, current)
    out = {}
    for name, dims in FAMILIES.items():
        shapes = []
        for heads in _sizes(config, "heads", current.heads) if "heads" in dims else [current.heads]:
            grid = [[(dim, v) for v in _sizes(config, dim, heads)] for dim in dims if dim != "heads"]
            for choice in itertools.product(*grid):
                sizes = {**asdict(current), **dict(choice), "heads": heads}
                shapes.append(Shape(**{**sizes, "kv_heads": kv_heads_for(config, heads)}))
        fits = [(p, s) for s in shapes if (p := count_parameters(model, s)) <= target * total]
        if not fits:
            continue
        best = max(p for p, _ in fits)
        close = [s for p, s in fits if p >= (target - tolerance) * total] or [s for p, s in fits if p == best]
        shape = min(close, key=lambda s: (_deepest_cut(s, current, dims), -count_parameters(model, s)))
        if shape not in out.values():
            out[name] = shape
    return out


def fitting_group_sizes(config, shape: Shape) -> list[int]:
    """Standard group sizes that divide every decoder linear's input once pruned to `shape`."""
    hd = arch.head_dim(config.to_dict())
    return [g for g in GROUP_SIZES if all(d % g == 0 for d in (shape.hidden, shape.ffn, shape.heads * hd))]
