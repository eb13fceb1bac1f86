"""Mixed precision under a size budget: each group of linears gets the scheme that buys the most quality per byte.

1. Sensitivity (one calibration pass through the float model, the `Sensitivity` step): for every unit of
   linears that read the same input (q/k/v, o, gate/up, down: one scheme each, so they still share GPTQ's
   Hessian and the runtime's fused call) and every candidate scheme, the error proxy

       E = Σ_linears Σ_ij (W − Ŵ)²_ij · H_jj / ‖h‖²,      H_jj = 2/n Σ_tokens x_j²,  ‖h‖² = 1/n Σ_tokens ‖h_t‖²

   with Ŵ the weight rounded to nearest at that scheme: the squared output error of the rounded linears on the
   calibration tokens without the cross terms between inputs (GPTQ's Hessian, its diagonal only: E costs one
   pass over the weights per scheme, where the full form costs a product with H), divided by the mean squared
   norm of the residual stream entering the layer (what the error is added to).
2. Choice: the schemes that minimize Σ E with Σ bytes ≤ the budget, a multiple-choice knapsack solved exactly
   over the Pareto frontier of (bytes, error) of the units taken so far (`choose`).

Bytes are what the checkpoint stores for a linear: packed codes, scales in the model's dtype, packed zero points.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from slimlm import arch
from slimlm.compress.pipeline import StepResult
from slimlm.compress.quantize import fake_quantize
from slimlm.errors import FieldError
from slimlm.formats.packing import packed_words
from slimlm.formats.quantized import QuantArgs

BITS = (2, 4, 8)  # the default candidates: 3-bit codes load in vLLM and the runtime, not in transformers with
# compressed-tensors < 0.18 (docs/limits.md), and no fast kernel serves them yet; `bits` adds them
GROUP_SIZES = (32, 64, 128)
UNITS = (arch.ATTENTION[:3], arch.ATTENTION[3:], arch.MLP[:2], arch.MLP[2:])  # linears reading one input
MIN_BITS, MAX_BITS = 2.0, 16.0  # bits per weight a budget may ask: below 2-bit codes, above bf16
SENSITIVITY_WINDOWS = 32  # calibration windows in the sensitivity pass (H's diagonal only: 16K tokens is plenty)
MAX_FRONTIER = 1 << 16  # (bytes, error) points kept per unit; past it the frontier is thinned (reported)


def linear_bytes(args: QuantArgs, out_features: int, in_features: int, scale_bytes: int) -> int:
    """Bytes a compressed-tensors checkpoint stores for one linear at `args` (formats.compressed_tensors)."""
    groups = args.groups(in_features)
    size = out_features * packed_words(in_features, args.bits) * 4 + out_features * groups * scale_bytes + 16
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


class Sensitivity:
    """The pipeline step that measures every unit's error at every candidate scheme; changes nothing."""

    needs_data = True
    changes_layer = False
    float_target = 0.0

    def __init__(self, sym: bool, bits: tuple[int, ...] = BITS):
        self.sym, self.bits = sym, bits
        self.units: list[Unit] = []
        self._hessians: dict[str, _Diagonal] = {}
        self._stream = [0.0, 0]

    def arguments(self) -> dict[str, Any]:
        return {}

    def observe(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> list[Any]:
        self._hessians, self._stream = {}, [0.0, 0]

        def stream(_m, a, kwargs):  # the residual stream entering the layer: Σ ||h||² and the token count
            h = (a[0] if a else kwargs["hidden_states"]).float()
            self._stream[0] += h.square().sum().item()
            self._stream[1] += h.numel() // h.shape[-1]

        def make_hook(name: str, m: nn.Linear):
            def hook(_m, a):
                # only H's diagonal is read: the squares of the inputs, summed per column
                acc = self._hessians.setdefault(name, _Diagonal(m.in_features, m.weight.device))
                acc.add(a[0])

            return hook

        first = {_unit_of(n)[0]: n for n in linears}  # one hook per unit: its linears read the same input
        hooks = [linears[n].register_forward_pre_hook(make_hook(n, linears[n])) for n in first.values()]
        return [layer.register_forward_pre_hook(stream, with_kwargs=True), *hooks]

    def apply(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> StepResult:
        by_unit: dict[tuple[str, ...], list[str]] = {}
        for name in linears:
            by_unit.setdefault(_unit_of(name), []).append(name)
        for names in by_unit.values():
            # The output error relative to the residual stream it is added to: the norm that follows every
            # layer sees the error over the stream's size, which grows with depth (on the default model, the
            # absolute error put 2 bits on the first layers, where the stream is small, and lost to uniform W4).
            diag = next(self._hessians[n] for n in names if n in self._hessians).diagonal
            diag = diag * (self._stream[1] / max(self._stream[0], 1e-30))
            mods = [linears[n] for n in names]
            schemes = candidates(self.sym, {m.in_features for m in mods}, self.bits)
            sizes, errors = [], []
            for args in schemes:  # scales are stored in the weights' dtype
                sizes.append(sum(linear_bytes(args, *m.weight.shape, m.weight.element_size()) for m in mods))
                err = 0.0
                for m in mods:
                    w = m.weight.detach().float()
                    err += ((w - fake_quantize(w, args)).square_() * diag).sum().item()
                errors.append(err)
            weights = sum(m.weight.numel() for m in mods)
            self.units.append(Unit(tuple(names), weights, schemes, sizes, errors))
        self._hessians = {}
        return StepResult()


class _Diagonal:
    """H's diagonal, 2/n Σ x_j², summed in fp32."""

    def __init__(self, in_features: int, device: torch.device):
        self.sums = torch.zeros(in_features, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.tokens += x.shape[0]
        self.sums += x.square().sum(dim=0)

    @property
    def diagonal(self) -> torch.Tensor:
        return self.sums * (2 / max(self.tokens, 1))


def _unit_of(name: str) -> tuple[str, ...]:
    """The unit a decoder-layer linear belongs to, as full names (model.layers.3.mlp.gate_proj → gate and up)."""
    index, _, local = name.removeprefix(arch.LAYERS + ".").partition(".")
    unit = next((u for u in UNITS if local in u), (local,))
    return tuple(f"{arch.LAYERS}.{index}.{u}" for u in unit)


@dataclass
class Choice:
    """The knapsack's answer: a scheme per linear, its bytes and error, and how it was found."""

    schemes: dict[str, QuantArgs]
    bytes: int
    weights: int  # in the linears the budget covers
    error: float
    exact: bool  # False when the frontier had to be thinned (then within MAX_FRONTIER's resolution)


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
        if len(c) > MAX_FRONTIER:  # keep the best point in each of MAX_FRONTIER byte buckets
            exact = False
            bucket = (c - c[0]) * MAX_FRONTIER // max(int(c[-1] - c[0]) + 1, 1)
            last = np.flatnonzero(np.r_[bucket[1:] != bucket[:-1], True])
            order, c, e = order[last], c[last], e[last]
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


def summary(choice: Choice) -> str:
    """One line: how many linears took each scheme and the bits per weight the mix came to."""
    counts = Counter(scheme_name(a) for a in choice.schemes.values())
    mix = ", ".join(f"{n} {name}" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    how = "the least summed error" if choice.exact else f"within 1/{MAX_FRONTIER} of the bytes of the least error"
    return f"{mix} linears: {8 * choice.bytes / choice.weights:.3f} bits per weight, {how}"


def record(choice: Choice, bits_per_weight: float) -> dict:
    """What slimlm.json records of the choice."""
    return {
        "bits_per_weight": bits_per_weight,
        "bytes": choice.bytes,
        "achieved_bits_per_weight": round(8 * choice.bytes / choice.weights, 4),
        "proxy_error": choice.error,
        "exact": choice.exact,
        "schemes": {name: scheme_name(a) for name, a in sorted(choice.schemes.items())},
    }


def budget_bytes(units: list[Unit], bits_per_weight: float) -> int:
    """The bytes `bits_per_weight` (scales and zero points included) allows the units' weights."""
    return int(bits_per_weight * sum(u.weights for u in units) / 8)
