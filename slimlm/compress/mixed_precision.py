"""Mixed precision under a size budget: each group of linears gets the scheme that buys the most quality per byte.

1. Sensitivity (`sensitivity`): for every unit of linears that read the same input (q/k/v, o, gate/up, down:
   one scheme each, so they still share GPTQ's Hessian and the runtime's fused call) and every candidate
   scheme, the error proxy

       E = Σ_linears Σ_ij F_ij (W − Ŵ)²_ij,      F = mean over calibration windows of (∂L/∂W)²

   with Ŵ the weight rounded to nearest at that scheme and F the diagonal of the empirical Fisher of the
   model's next-token loss L (`fisher`): the loss increase a second-order expansion predicts, ModelOpt's and
   HAWQ's kind of score. Layer-local proxies ranked the default model's units worse than the weight error
   alone: rounding each unit alone to W2 g64 and measuring the loss, the Spearman rank correlation was 0.64
   for this one, 0.61 for Σ (W − Ŵ)², 0.23 for the output error Σ (W − Ŵ)²·diag(H) (GPTQ's Hessian) and
   0.11 for that over the residual stream's energy (benchmarks/budget_proxy.py); the output error put 2 bits
   on the first layers and lost to uniform W4 at the same bytes.
2. Choice: the schemes that minimize Σ E with Σ bytes ≤ the budget, a multiple-choice knapsack solved exactly
   over the Pareto frontier of (bytes, error) of the units taken so far (`choose`).

Bytes are what the checkpoint stores for a linear: packed codes, scales (quantized.stored_scale), packed zero points.
F takes the whole float model with its gradients in memory for a few windows: unlike calibration, not one layer.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from slimlm import arch
from slimlm.compress import pipeline
from slimlm.compress.quantize import fake_quantize
from slimlm.errors import FieldError
from slimlm.formats.packing import packed_words
from slimlm.formats.quantized import QuantArgs, scale_bytes
from slimlm.kernels.packed import SERVED_BITS

BITS = (2, 4, 8)  # the default candidates: 3-bit codes load in vLLM and the runtime, not in transformers with
# compressed-tensors < 0.18 (docs/limits.md), and no fast kernel serves them yet; `bits` adds them
GROUP_SIZES = (32, 64, 128)
UNITS = (arch.ATTENTION[:3], arch.ATTENTION[3:], arch.MLP[:2], arch.MLP[2:])  # linears reading one input
MIN_BITS, MAX_BITS = 2.0, 16.0  # bits per weight a budget may ask: below 2-bit codes, above bf16
SENSITIVITY_WINDOWS = 16  # calibration windows the Fisher is averaged over
HEADER_BYTES_PER_TENSOR = 160  # a safetensors header entry (name, dtype, shape, offsets), generously
MAX_FRONTIER = 1 << 16  # (bytes, error) points kept per unit; past it the frontier is thinned (reported)


def linear_bytes(args: QuantArgs, out_features: int, in_features: int, scale_size: int) -> int:
    """Bytes a compressed-tensors checkpoint stores for one linear at `args` (formats.compressed_tensors)."""
    groups = args.groups(in_features)
    size = out_features * packed_words(in_features, args.bits) * 4 + out_features * groups * scale_size + 16
    if not args.sym:
        size += packed_words(out_features, args.bits) * groups * 4
    return size


def candidates(sym: bool, in_features: set[int], bits: tuple[int, ...] = BITS) -> list[QuantArgs]:
    """The schemes a unit may get: `bits`, in groups of 32, 64 or 128 that divide its input dim."""
    return [QuantArgs(b, g, sym) for b in bits for g in GROUP_SIZES if all(d % g == 0 for d in in_features)]


@dataclass
class Unit:
    """Linears that read the same input and so take one scheme, with each candidate's bytes and error."""

    names: tuple[str, ...]
    weights: int  # how many weights its linears hold
    schemes: list[QuantArgs]
    bytes: list[int]
    errors: list[float]


def fisher(
    model: nn.Module, windows: torch.Tensor, ignore: list[str] = (), dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The diagonal of the empirical Fisher of the next-token loss, mean over `windows` [n, seq] of (∂L/∂W)²,
    for every decoder linear's weight (full names), in fp32. One window at a time: the activations kept for
    the backward pass are one window's. `dtype`: the passes run on a copy of the model in it (bf16 where its
    products are fast: the Fisher only ranks schemes, and the errors it weighs stay the fp32 weights')."""
    if dtype is not None and dtype != next(model.parameters()).dtype:
        model = copy.deepcopy(model).to(dtype)
    linears = pipeline.quantizable_linears(model, ignore)
    saved = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for m in linears.values():
        m.weight.requires_grad_(True)
    sums = {n: torch.zeros(m.weight.shape, dtype=torch.float32, device=m.weight.device) for n, m in linears.items()}
    device = next(model.parameters()).device
    try:
        with torch.enable_grad():
            for ids in windows:
                ids = ids[None].to(device)
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                for n, m in linears.items():
                    sums[n] += m.weight.grad.float().square()
                    m.weight.grad = None
    finally:
        for p, flag in saved.items():
            p.requires_grad_(flag)
    return {n: t.div_(len(windows)) for n, t in sums.items()}


def sensitivity(
    linears: dict[str, nn.Linear], fisher: dict[str, torch.Tensor], sym: bool, bits: tuple[int, ...] = BITS
) -> list[Unit]:
    """Every unit's bytes and error proxy at each candidate scheme (see the module doc)."""
    units = []
    for names in _grouped(linears):
        mods = [linears[n] for n in names]
        schemes = candidates(sym, {m.in_features for m in mods}, bits)
        sizes, errors = [], []
        for args in schemes:
            sizes.append(_unit_bytes(mods, args))
            err = 0.0
            for n, m in zip(names, mods, strict=True):
                w = m.weight.detach().float()
                err += ((w - fake_quantize(w, args)).square_() * fisher[n]).sum().item()
            errors.append(err)
        units.append(Unit(tuple(names), sum(m.weight.numel() for m in mods), schemes, sizes, errors))
    return units


def least_bytes(linears: dict[str, nn.Linear], sym: bool, bits: tuple[int, ...] = BITS) -> int:
    """The fewest bytes any choice can take (every unit at its smallest scheme), from the shapes alone."""
    total = 0
    for names in _grouped(linears):
        mods = [linears[n] for n in names]
        total += min(_unit_bytes(mods, args) for args in candidates(sym, {m.in_features for m in mods}, bits))
    return total


def _grouped(linears: dict[str, nn.Linear]) -> list[list[str]]:
    """The linears' names, unit by unit."""
    by_unit: dict[tuple[str, ...], list[str]] = {}
    for name in linears:
        by_unit.setdefault(_unit_of(name), []).append(name)
    return list(by_unit.values())


def _unit_bytes(mods: list[nn.Linear], args: QuantArgs) -> int:
    """A unit's stored bytes at `args` (scales in the weights' dtype)."""
    return sum(linear_bytes(args, *m.weight.shape, scale_bytes(m.weight.dtype)) for m in mods)


def _unit_of(name: str) -> tuple[str, ...]:
    """The unit a decoder-layer linear belongs to, as full names (model.layers.3.mlp.gate_proj → gate and up)."""
    index, _, local = name.removeprefix(arch.LAYERS + ".").partition(".")
    unit = next(u for u in UNITS if local in u)
    return tuple(f"{arch.LAYERS}.{index}.{u}" for u in unit)


@dataclass
class Choice:
    """The knapsack's answer: a scheme per linear, its bytes and error, and how it was found."""

    schemes: dict[str, QuantArgs]
    bytes: int
    weights: int  # in the linears the budget covers
    error: float
    exact: bool  # False when the frontier had to be thinned (then within MAX_FRONTIER's resolution)


def thinned(c: np.ndarray) -> np.ndarray:
    """Which points of a frontier (bytes `c` ascending, error falling) to keep: the cheapest, so that the least
    budget stays reachable, and the last (least error) of each of MAX_FRONTIER equal byte ranges."""
    bucket = (c - c[0]) * MAX_FRONTIER // (int(c[-1] - c[0]) + 1)
    keep = np.r_[bucket[1:] != bucket[:-1], True]
    keep[0] = True
    return np.flatnonzero(keep)


def choose(units: list[Unit], budget_bytes: int) -> Choice:
    """The scheme of each unit that minimizes the summed error with the summed bytes ≤ budget_bytes.

    Units are taken one at a time, keeping the Pareto frontier of (bytes, error) over the choices so far: a
    point another beats in both is dropped, so the last frontier's cheapest point under the budget is the optimum.
    """
    if not units:
        raise FieldError("budget", "there are no linears to quantize")
    least = sum(min(u.bytes) for u in units)
    if least > budget_bytes:
        raise FieldError("budget", f"is too small: the smallest schemes take {least:,} bytes, over {budget_bytes:,}")
    cost, err = np.zeros(1, dtype=np.int64), np.zeros(1)
    picks: list[tuple[np.ndarray, np.ndarray]] = []  # per unit: each point's previous point and option
    exact = True
    rest = np.cumsum([min(u.bytes) for u in units][::-1])[::-1].tolist() + [0]  # cheapest of the units to come
    for k, u in enumerate(units):
        c = (cost[:, None] + np.asarray(u.bytes, dtype=np.int64)[None, :]).ravel()
        e = (err[:, None] + np.asarray(u.errors)[None, :]).ravel()
        fits = c + rest[k + 1] <= budget_bytes
        idx = np.flatnonzero(fits)
        order = idx[np.lexsort((e[idx], c[idx]))]  # by bytes, then error
        c, e = c[order], e[order]
        keep = np.ones(len(c), dtype=bool)
        keep[1:] = e[1:] < np.minimum.accumulate(e)[:-1]  # strictly better than every cheaper point
        order, c, e = order[keep], c[keep], e[keep]
        if len(c) > MAX_FRONTIER:
            exact = False
            kept = thinned(c)
            order, c, e = order[kept], c[kept], e[kept]
        picks.append((order // len(u.bytes), order % len(u.bytes)))
        cost, err = c, e
    best = int(np.argmin(err))
    chosen, point = {}, best
    for u, (parent, option) in zip(reversed(units), reversed(picks), strict=True):
        for name in u.names:
            chosen[name] = u.schemes[int(option[point])]
        point = int(parent[point])
    return Choice(chosen, int(cost[best]), sum(u.weights for u in units), float(err[best]), exact)


def scheme_name(args: QuantArgs) -> str:
    return f"w{args.bits}" + ("-channel" if args.group_size == -1 else f"g{args.group_size}")


def mix(choice: Choice) -> list[tuple[QuantArgs, int]]:
    """Each scheme the choice uses and how many linears took it, the most common first (ties by name)."""
    counts = Counter(choice.schemes.values())
    return sorted(counts.items(), key=lambda kv: (-kv[1], scheme_name(kv[0])))


def summary(choice: Choice) -> str:
    """One line: how many linears took each scheme and the bits per weight the mix came to."""
    mixed = ", ".join(f"{n} {scheme_name(args)}" for args, n in mix(choice))
    how = "the least summed error" if choice.exact else f"within 1/{MAX_FRONTIER} of the bytes of the least error"
    return f"{mixed} linears: {8 * choice.bytes / choice.weights:.3f} bits per weight, {how}"


def layout_table(choice: Choice) -> str:
    """The chosen scheme of every unit, a row per decoder layer (— : a linear kept float)."""
    labels = ["/".join(n.rpartition(".")[2].removesuffix("_proj") for n in unit) for unit in UNITS]
    rows: dict[int, list[str]] = {}
    for name, args in choice.schemes.items():
        index, _, local = name.removeprefix(arch.LAYERS + ".").partition(".")
        column = next(k for k, unit in enumerate(UNITS) if local in unit)
        rows.setdefault(int(index), ["—"] * len(UNITS))[column] = scheme_name(args)
    lines = [f"{'layer':>5} " + " ".join(f"{label:>13}" for label in labels)]
    lines += [f"{i:>5} " + " ".join(f"{c:>13}" for c in rows[i]) for i in sorted(rows)]
    return "\n".join([*lines, summary(choice)])


def served_bytes(choice: Choice, model: nn.Module) -> int:
    """The bytes of `choice`'s linears as the runtime's kernels hold them: 2- and 3-bit codes widened to 4
    (kernels.packed.SERVED_BITS); `model` gives the shapes (meta tensors will do)."""
    total = 0
    for name, args in choice.schemes.items():
        w = model.get_submodule(name).weight
        total += linear_bytes(replace(args, bits=SERVED_BITS[args.bits]), *w.shape, scale_bytes(w.dtype))
    return total


def record(choice: Choice, bits_per_weight: float | None, size: int | None = None) -> dict:
    """What slimlm.json records of the choice (asked as bits a weight or as the checkpoint's size)."""
    return {
        "bits_per_weight": bits_per_weight,
        **({} if size is None else {"size_bytes": size}),
        "bytes": choice.bytes,
        "achieved_bits_per_weight": round(8 * choice.bytes / choice.weights, 4),
        "proxy_error": choice.error,
        "exact": choice.exact,
        "schemes": {name: scheme_name(a) for name, a in sorted(choice.schemes.items())},
    }


def other_bytes(model: nn.Module, linears: set[str], head_args: QuantArgs | None) -> int:
    """Bytes a checkpoint of `model` (meta tensors will do) stores besides the weights of `linears`, the
    decoder linears the budget covers: every other parameter (biases too) as the model holds it, the lm_head at
    `head_args` when it is quantized (a tied one then also keeps the embeddings), and a safetensors header's
    worth per tensor, the linears' own four (codes, scales, zero points, shape) included."""
    total, tensors = 0, 4 * len(linears)
    # A tied lm_head is the embedding, stored once (a meta model lists it apart); a quantized one is counted below.
    drop_head = head_args is not None or bool(getattr(model.config, "tie_word_embeddings", False))
    for name, p in model.named_parameters():
        module, _, kind = name.rpartition(".")
        if kind == "weight" and (module in linears or (module == "lm_head" and drop_head)):
            continue
        total, tensors = total + p.numel() * p.element_size(), tensors + 1
    if head_args is not None:
        head = model.get_output_embeddings().weight
        total += linear_bytes(head_args, head.shape[0], head.shape[1], scale_bytes(torch.float32))  # job.py
        tensors += 3
    return total + HEADER_BYTES_PER_TENSOR * tensors


def budget_bytes(units: list[Unit], bits_per_weight: float) -> int:
    """The bytes `bits_per_weight` (scales and zero points included) allows the units' weights."""
    return int(bits_per_weight * sum(u.weights for u in units) / 8)
