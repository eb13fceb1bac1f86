"""Learned rounding (AutoRound; Cheng et al. 2023, "Optimize Weight Rounding via Signed Gradient Descent").

Each quantized linear of a decoder layer rounds its weights as

    ŵ = s · (clip(⌊w/s + V⌉ + z, qmin, qmax) − z)      s, z from the group's range [β·min, α·max]

with an offset V ∈ [−0.5, 0.5] per weight (which way it rounds) and multipliers α, β ∈ [0.5, 1] per group
(how much of the group's range the codes span; symmetric: α on max |w|). All of a layer's V, α, β are fitted
together by signed gradient descent, p ← p − lr·sign(∂L/∂p) with lr falling linearly to 0, on L: the mean
squared error of the whole layer's output, a few calibration windows a step; rounding passes the gradient
straight through. The step with the lowest loss is kept. With V = 0 and α = β = 1 the result is RTN's to the
bit, so 0 steps is RTN.

The target is the pipeline's float chain, as in auto-round: the quantized layer is fed the inputs the
compressed layers before it give, and fitted to the float layer's outputs on the float model's own inputs,
so each layer also undoes some of the error that reached it. `float_target` < 1 blends that target with the
float layer's outputs on the given inputs (0: fit the float layer where it is).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from slimlm.compress.pipeline import StepResult, in_dtype
from slimlm.errors import FieldError
from slimlm.formats.quantized import QuantArgs, QuantizedWeight, stored_scale

# The defaults, measured on the default model (W4 g64 asym, 128×512 calibration tokens, wiki ppl over 16K tokens,
# float 29.28; RTN +28.8%, GPTQ +12.8% in 248 s): 200 steps of 4 windows +7.5%, 100 of 4 +7.0%, 100 of 2 +8.9% in
# 533 s (2.15× GPTQ's). 4 windows a step take twice the time, over the bound of 3× GPTQ's.
ITERS = 100
WINDOWS = 2  # calibration windows in each step's loss
RANGE_MIN = 0.5  # the paper's lower bound on α, β


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """⌊x⌉ forward, identity backward."""
    return x + (torch.round(x) - x).detach()


def rounded(
    w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor | None, args: QuantArgs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes, scale and zero point of w [out, groups, group_size] under offsets v (same shape) and range
    multipliers alpha, beta [out, groups] (beta None: symmetric). Differentiable in v, alpha and beta; the
    codes are floats so that the gradient passes, integers in value."""
    if args.sym:
        scale = w.abs().amax(dim=-1) * alpha / ((args.qmax - args.qmin) / 2)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return torch.clamp(_round_ste(w / scale[..., None] + v), args.qmin, args.qmax), scale, None
    # The range always contains 0 so that zero weights stay exactly zero (quantize.compute_qparams).
    lo, hi = w.amin(dim=-1).clamp(max=0) * beta, w.amax(dim=-1).clamp(min=0) * alpha
    scale = (hi - lo) / (args.qmax - args.qmin)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.clamp(_round_ste(args.qmin - lo / scale), args.qmin, args.qmax)
    codes = torch.clamp(_round_ste(w / scale[..., None] + v) + zero[..., None], args.qmin, args.qmax)
    return codes, scale, zero


def fake_quantized(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor | None, args: QuantArgs):
    """ŵ for w [out, groups, group_size] (see rounded)."""
    codes, scale, zero = rounded(w, v, alpha, beta, args)
    return (codes if zero is None else codes - zero[..., None]) * scale[..., None]


class AutoRound:
    needs_data = True
    changes_layer = True

    def __init__(
        self,
        args: QuantArgs,
        iters: int = ITERS,
        lr: float | None = None,
        windows: int = WINDOWS,
        float_target: float = 1.0,
        seed: int = 0,
    ):
        if type(iters) is not int or iters < 0:
            raise FieldError("iters", f"{iters!r} must be a whole number ≥ 0 (0: round to nearest)")
        if lr is not None and not 0 < lr <= 1:
            raise FieldError("lr", f"{lr} must be in (0, 1] (default: 1/{{iters}}, the paper's)")
        if type(windows) is not int or windows < 1:
            raise FieldError("windows", f"{windows!r} must be a positive integer")
        if not 0 <= float_target <= 1:
            raise FieldError("float_target", f"{float_target} must be in [0, 1]")
        self.args, self.iters, self.windows, self.float_target = args, iters, windows, float_target
        self.lr = lr if lr is not None else 1 / max(iters, 1)
        self.schemes: dict[str, QuantArgs] = {}
        self.reference = False  # set by the pipeline while the float model's inputs go through the layer
        self._generator = torch.Generator().manual_seed(seed)
        self._inputs: list[tuple[torch.Tensor, dict]] = []
        self._outputs: list[torch.Tensor] = []  # the float layer's, on the inputs it is given
        self._targets: list[torch.Tensor] = []  # the float layer's, on the float model's inputs
        self.losses: list[float] = []  # the last layer's loss at each step (tests read it)

    def arguments(self) -> dict[str, Any]:
        return {"iters": self.iters, "lr": self.lr, "windows": self.windows, "float_target": self.float_target}

    def observe(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> list[Any]:
        self._inputs, self._outputs, self._targets = [], [], []

        def inputs(_m, a, kwargs):
            if not self.reference:
                self._inputs.append((a[0], kwargs))

        def outputs(_m, a, kwargs, y):
            (self._targets if self.reference else self._outputs).append(y[0] if isinstance(y, tuple) else y)

        return [
            layer.register_forward_pre_hook(inputs, with_kwargs=True),
            layer.register_forward_hook(outputs, with_kwargs=True),
        ]

    def apply(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> StepResult:
        local = {id(m): n for n, m in layer.named_modules()}
        names = {full: local[id(m)] for full, m in linears.items()}
        # The quantization source is each linear's stored weight (fp32 for an fp32 model), while the layer runs
        # in the passes' dtype, like the pipeline's own passes.
        args = {full: self.schemes.get(full, self.args) for full in linears}
        weights = {full: _grouped(m.weight.detach().float(), args[full]) for full, m in linears.items()}
        v = {n: torch.zeros_like(w) for n, w in weights.items()}
        alpha = {n: torch.ones(w.shape[:2], device=w.device) for n, w in weights.items()}
        beta = {n: None if args[n].sym else torch.ones_like(a) for n, a in alpha.items()}
        best = self._fit(in_dtype(layer, self._inputs[0][0].dtype), names, args, weights, v, alpha, beta)
        out = {}
        for full, m in linears.items():
            w, (bv, ba, bb) = weights[full], best[full]
            codes, scale, zero = rounded(w, bv, ba, bb, args[full])
            codes = codes.reshape(m.weight.shape).to(torch.int8)
            out[full] = QuantizedWeight(
                codes, stored_scale(scale, m.weight.dtype), None if zero is None else zero.to(torch.int8), args[full]
            )
        self._inputs, self._outputs, self._targets = [], [], []
        return StepResult(quantized=out)

    def _fit(self, runner: nn.Module, names: dict, args: dict, weights: dict, v: dict, alpha: dict, beta: dict):
        """Signed gradient descent on every linear's v, alpha, beta (None: symmetric) at once; returns each
        linear's best (v, alpha, beta)."""
        ranges = [*alpha.values(), *(b for b in beta.values() if b is not None)]
        params = [*v.values(), *ranges]
        snapshot = lambda: {n: tuple(None if t is None else t.clone() for t in (v[n], alpha[n], beta[n])) for n in v}  # noqa: E731
        best, best_loss = snapshot(), float("inf")
        rows = [(b, r) for b, (x, _) in enumerate(self._inputs) for r in range(x.shape[0])]
        kwargs = self._inputs[0][1]  # rotary embeddings and positions broadcast over windows of one length
        dtype = self._inputs[0][0].dtype
        self.losses = []
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            for step in range(self.iters):
                picks = torch.randperm(len(rows), generator=self._generator)[: self.windows].tolist()
                x = torch.stack([self._inputs[rows[i][0]][0][rows[i][1]] for i in picks])
                target = torch.stack([self._target(*rows[i]) for i in picks]).float()
                fake = {
                    f"{names[n]}.weight": fake_quantized(weights[n], v[n], alpha[n], beta[n], args[n])
                    .reshape(-1, weights[n].shape[1] * weights[n].shape[2])
                    .to(dtype)
                    for n in names
                }
                y = functional_call(runner, fake, (x,), kwargs)
                y = y[0] if isinstance(y, tuple) else y
                loss = (y.float() - target).pow(2).mean()
                for p in params:
                    p.grad = None
                loss.backward()
                value = loss.item()
                self.losses.append(value)
                if value < best_loss:  # the parameters this loss was measured at
                    best, best_loss = snapshot(), value
                lr = self.lr * (1 - step / self.iters)
                with torch.no_grad():
                    for p in params:
                        p.sub_(lr * torch.sign(p.grad))
                    for t in v.values():
                        t.clamp_(-0.5, 0.5)
                    for t in ranges:
                        t.clamp_(RANGE_MIN, 1.0)
        return {n: tuple(None if t is None else t.detach() for t in p) for n, p in best.items()}

    def _target(self, batch: int, row: int) -> torch.Tensor:
        y = self._outputs[batch][row]
        if self.float_target == 0:
            return y
        return y + self.float_target * (self._targets[batch][row] - y)


def _grouped(w: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """w [out, in] as [out, groups, group_size]."""
    return w.reshape(w.shape[0], args.groups(w.shape[1]), -1)
