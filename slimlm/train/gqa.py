"""MHA→GQA (or GQA→fewer KV heads) by merging groups of KV heads, and the exact reverse (expanding).

Merging a group of KV heads into one replaces their K and V projections by the group's mean (the GQA
paper's mean pooling); the query heads that read any head of the group now all read the merged one.
Which heads to group: contiguous ones (the paper), or those whose keys and values are closest on
calibration data, which is the grouping that mean pooling distorts least: for a group S the error of the
pooled head on token x is sum over h in S of |W_h x − mean_S W x|², i.e. the within-group spread of the
heads' outputs. Grouping non-adjacent heads permutes the query heads so that each group's query heads stay
contiguous (what the attention's repeat-per-group layout needs), and o_proj's input columns with them: the
layer computes exactly the same function, only the head order changes.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from slimlm import arch
from slimlm.errors import FieldError, SlimlmError

Groups = list[list[int]]  # per layer: for each new KV head, the old KV heads merged into it


def check_kv_heads(config, kv_heads: int, expand: bool) -> None:
    """A one-line error for a target that cannot work: it must divide the query heads, and go down (merge)
    or, with expand, up by a whole factor."""
    heads, current = config.num_attention_heads, config.num_key_value_heads
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    if kv_heads not in divisors:
        raise FieldError(
            "kv_heads",
            f"{kv_heads} does not divide the {heads} query heads; use one of {', '.join(map(str, divisors))}",
        )
    if expand:
        if kv_heads % current:
            raise FieldError("expand", f"needs a multiple of the current {current} KV heads, got {kv_heads}")
    elif kv_heads > current:
        raise FieldError(
            "kv_heads",
            f"{kv_heads} is more than the model's {current} KV heads: merging only removes heads (add {{expand}} to "
            "repeat them)",
        )
    elif current % kv_heads:
        raise FieldError(
            "kv_heads", f"{kv_heads} does not divide the current {current} KV heads, so the groups would be uneven"
        )


def contiguous_groups(current: int, kv_heads: int) -> Groups:
    size = current // kv_heads
    return [list(range(g * size, (g + 1) * size)) for g in range(kv_heads)]


def _attentions(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in model.get_submodule(arch.LAYERS)]


def _rows(weight: torch.Tensor, heads: list[int], head_dim: int) -> torch.Tensor:
    """The rows (output features) of the given heads, in that order."""
    return torch.cat([weight[h * head_dim : (h + 1) * head_dim] for h in heads])


def _set_kv_heads(model: nn.Module, kv_heads: int) -> None:
    model.config.num_key_value_heads = kv_heads
    for attention in _attentions(model):
        attention.num_key_value_groups = model.config.num_attention_heads // kv_heads


def _replace(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
    return new


@torch.no_grad()
def permute_kv_heads(model: nn.Module, orders: list[list[int]]) -> None:
    """Reorder each layer's KV heads (layer i's new head j is its old head orders[i][j]), and their query
    heads and o_proj's columns with them: the same function, another head order."""
    config = model.config
    hd = arch.head_dim(config.to_dict())
    per_kv = config.num_attention_heads // config.num_key_value_heads  # query heads per KV head
    for attention, order in zip(_attentions(model), orders, strict=True):
        if order == sorted(order):
            continue
        queries = [q for h in order for q in range(h * per_kv, (h + 1) * per_kv)]
        for linear, heads in ((attention.k_proj, order), (attention.v_proj, order), (attention.q_proj, queries)):
            linear.weight.copy_(_rows(linear.weight, heads, hd))
            if linear.bias is not None:
                linear.bias.copy_(_rows(linear.bias[:, None], heads, hd).flatten())
        attention.o_proj.weight.copy_(_rows(attention.o_proj.weight.T, queries, hd).T)


@torch.no_grad()
def merge(model: nn.Module, groups: list[Groups]) -> None:
    """Merge KV heads in place: layer i's new KV head g is the mean of its old heads groups[i][g]. The heads
    are first permuted so that every group is contiguous, then each contiguous block is averaged."""
    config = model.config
    hd, current = arch.head_dim(config.to_dict()), config.num_key_value_heads
    for layer_groups in groups:
        order = [h for group in layer_groups for h in group]
        if sorted(order) != list(range(current)) or len({len(g) for g in layer_groups}) != 1:
            raise SlimlmError(f"KV head groups {layer_groups} do not split the {current} heads evenly")
    permute_kv_heads(model, [[h for group in layer_groups for h in group] for layer_groups in groups])
    kv_heads = len(groups[0])
    for attention in _attentions(model):
        for name in ("k_proj", "v_proj"):
            linear = getattr(attention, name)
            weight = linear.weight.view(kv_heads, -1, hd, linear.in_features).mean(1).flatten(0, 1)
            bias = None if linear.bias is None else linear.bias.view(kv_heads, -1, hd).mean(1).flatten()
            setattr(attention, name, _replace(linear, weight, bias))
    _set_kv_heads(model, kv_heads)


@torch.no_grad()
def expand(model: nn.Module, kv_heads: int) -> None:
    """Repeat each KV head's K and V rows so that the model has `kv_heads` of them: the same function
    (a query head reads a copy of the head it read before)."""
    config = model.config
    hd = arch.head_dim(config.to_dict())
    factor = kv_heads // config.num_key_value_heads
    heads = [h for h in range(config.num_key_value_heads) for _ in range(factor)]
    for attention in _attentions(model):
        for name in ("k_proj", "v_proj"):
            linear = getattr(attention, name)
            bias = None if linear.bias is None else _rows(linear.bias[:, None], heads, hd).flatten()
            setattr(attention, name, _replace(linear, _rows(linear.weight, heads, hd), bias))
    _set_kv_heads(model, kv_heads)


def best_partition(distance: torch.Tensor, size: int) -> list[list[int]]:
    """Groups of `size` heads with the least total within-group distance (pairwise, symmetric `distance`):
    exhaustive for up to 12 heads, else greedy (each group: the first free head and its nearest free ones)."""
    n = distance.shape[0]
    cost = {}

    def group_cost(group: tuple[int, ...]) -> float:
        if group not in cost:
            cost[group] = sum(distance[i, j].item() for i, j in itertools.combinations(group, 2))
        return cost[group]

    if n <= 12:

        def partitions(free: tuple[int, ...]):
            if not free:
                yield []
                return
            first, rest = free[0], free[1:]
            for others in itertools.combinations(rest, size - 1):
                group = (first, *others)
                remaining = tuple(h for h in rest if h not in others)
                for tail in partitions(remaining):
                    yield [group, *tail]

        best = min(partitions(tuple(range(n))), key=lambda p: sum(group_cost(g) for g in p))
        return [list(g) for g in best]
    free, groups = list(range(n)), []
    while free:
        first = free.pop(0)
        nearest = sorted(free, key=lambda h: distance[first, h].item())[: size - 1]
        groups.append(sorted([first, *nearest]))
        free = [h for h in free if h not in nearest]
    return groups


@torch.no_grad()
def similarity_groups(model: nn.Module, windows: torch.Tensor, kv_heads: int, batch_size: int = 8) -> list[Groups]:
    """Per layer, the grouping of KV heads whose K and V outputs on `windows` are closest (squared distance
    between heads' outputs, K and V each normalised by its mean square so neither dominates)."""
    config = model.config
    hd, current = arch.head_dim(config.to_dict()), config.num_key_value_heads
    attentions = _attentions(model)
    sums = [torch.zeros(2, current, current, dtype=torch.float64) for _ in attentions]
    norms = [torch.zeros(2, dtype=torch.float64) for _ in attentions]

    def observe(i: int, which: int):
        def hook(module, inputs, output):
            x = output.detach().double().reshape(-1, current, hd).transpose(0, 1).flatten(1)  # [heads, tokens*hd]
            sq = (x * x).sum(1)
            sums[i][which] += sq[:, None] + sq[None, :] - 2 * x @ x.T
            norms[i][which] += sq.sum()

        return hook

    handles = []
    for i, attention in enumerate(attentions):
        handles += [
            attention.k_proj.register_forward_hook(observe(i, 0)),
            attention.v_proj.register_forward_hook(observe(i, 1)),
        ]
    try:
        for start in range(0, len(windows), batch_size):
            model(windows[start : start + batch_size])
    finally:
        for h in handles:
            h.remove()
    size = current // kv_heads
    distances = [(s / n.clamp_min(1e-30)[:, None, None]).sum(0) for s, n in zip(sums, norms, strict=True)]
    return [best_partition(d, size) for d in distances]
