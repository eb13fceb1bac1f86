"""The layer-by-layer calibration pipeline every method runs on.

1. Run the embeddings for every calibration batch and catch what the first decoder layer receives.
2. For each decoder layer: attach the method's hooks, run all batches through the float layer (the hooks
   gather statistics; the outputs are the reference), let the method compress the layer's linears, write
   the dequantized weights back, and run the batches again. Those quantized outputs feed the next layer,
   so each layer is calibrated on inputs that already carry the earlier layers' quantization error.

Only one decoder layer and the calibration activations are live on the compute device at a time.
"""

from __future__ import annotations

import fnmatch
import re
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from tqdm import tqdm

from slimlm import SlimlmError
from slimlm.compress.memory import return_freed_memory
from slimlm.compress.offload import LazyWeights
from slimlm.compress.quantize import QuantArgs, QuantizedWeight


class LayerMethod(Protocol):
    """A compression method, seen one decoder layer at a time."""

    def observe(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> list[Any]:
        """Attach hooks that gather statistics during the float pass; return their handles."""
        ...

    def apply(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> dict[str, QuantizedWeight]:
        """Quantize the layer's linears (the float pass has run); return them by full module name."""
        ...

    def arguments(self) -> dict[str, Any]:
        """Method-specific settings, recorded in slimlm.json (and `act_order` in the quantization config)."""
        ...


@dataclass
class LayerInputs:
    """What one calibration batch feeds a decoder layer: hidden states plus rotary/mask keyword args."""

    hidden: torch.Tensor
    kwargs: dict[str, Any]


class _CaughtInputs(Exception):
    pass


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def quantizable_linears(model: nn.Module, ignore: list[str] = ()) -> dict[str, nn.Linear]:
    """Decoder-layer linears not matched by an --ignore glob; embeddings and lm_head stay float."""
    out = {}
    for i, layer in enumerate(decoder_layers(model)):
        for name, mod in layer.named_modules():
            full = f"model.layers.{i}.{name}"
            if isinstance(mod, nn.Linear) and not any(fnmatch.fnmatch(full, p) for p in ignore):
                out[full] = mod
    return out


def check_group_size(model: nn.Module, args: QuantArgs, ignore: list[str] = ()) -> None:
    """Every quantized layer's input dim must split into whole groups; name the ones that do not."""
    if args.group_size == -1:
        return
    linears = quantizable_linears(model, ignore)
    bad = {re.sub(r"\.\d+\.", ".*.", n): m.in_features for n, m in linears.items() if m.in_features % args.group_size}
    if bad:
        dims = {m.in_features for m in linears.values()}
        ok = [g for g in (32, 64, 128) if all(d % g == 0 for d in dims)] + [-1]
        by_dim: dict[int, list[str]] = {}
        for n, d in bad.items():
            by_dim.setdefault(d, []).append(n)
        names = "; ".join(f"{', '.join(ns)} (in={d})" for d, ns in by_dim.items())
        raise SlimlmError(
            f"--group-size {args.group_size} does not divide the input dim of {names}; "
            f"group sizes that fit every layer: {', '.join(map(str, ok))}"
        )


@torch.no_grad()
def capture_first_layer_inputs(model: nn.Module, calib: torch.Tensor, batch_size: int) -> list[LayerInputs]:
    device = next(model.parameters()).device
    caught: list[LayerInputs] = []

    def catch(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "past_key_values", "past_key_value")}
        caught.append(LayerInputs(hidden, kwargs))
        raise _CaughtInputs

    handle = decoder_layers(model)[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for i in range(0, len(calib), batch_size):
            try:
                model(input_ids=calib[i : i + batch_size].to(device), use_cache=False)
            except _CaughtInputs:
                pass
    finally:
        handle.remove()
    return caught


def _run_layer(layer: nn.Module, inputs: list[LayerInputs]) -> list[torch.Tensor]:
    outs = []
    for x in inputs:
        y = layer(x.hidden, **x.kwargs)
        outs.append(y[0] if isinstance(y, tuple) else y)
    return outs


def _check_finite(tensors: list[torch.Tensor], what: str) -> None:
    if not all(torch.isfinite(t).all() for t in tensors):
        raise SlimlmError(f"non-finite values (NaN/Inf) in {what}; the model or calibration data is broken")


@dataclass
class Result:
    quantized: dict[str, QuantizedWeight]  # by full module name
    report: list[dict]  # per decoder layer: output error, seconds
    float_tensors: dict[str, torch.Tensor]  # the offloaded layers' unquantized tensors (norms, biases)


@torch.no_grad()
def run(
    model: nn.Module,
    method: LayerMethod,
    calib: torch.Tensor,
    ignore: list[str] = (),
    batch_size: int = 8,
    progress: bool = True,
    weights: LazyWeights | None = None,
) -> Result:
    """Compress every decoder layer of `model` in place.

    With `weights`, the decoder layers start empty (meta) and each is read from disk just before it is
    compressed and dropped right after, keeping its unquantized tensors in `Result.float_tensors`.
    """
    inputs = capture_first_layer_inputs(model, calib, batch_size)
    device = inputs[0].hidden.device
    layers = decoder_layers(model)
    all_linears = quantizable_linears(model, ignore)
    quantized: dict[str, QuantizedWeight] = {}
    float_tensors: dict[str, torch.Tensor] = {}
    report = []
    bar = tqdm(range(len(layers)), desc="layers", unit="layer", disable=not progress)
    for i in bar:
        start = time.time()
        layer = layers[i]
        if weights is not None:
            weights.materialize(layer, f"model.layers.{i}", inputs[0].hidden.dtype, device)
        linears = {n: m for n, m in all_linears.items() if n.startswith(f"model.layers.{i}.")}
        handles = method.observe(layer, linears)
        try:
            ref = _run_layer(layer, inputs)
        finally:
            for h in handles:
                h.remove()
        _check_finite(ref, f"the float outputs of decoder layer {i}")
        result = method.apply(layer, linears)
        for name, q in result.items():
            linears[name].weight.data = q.dequantize(linears[name].weight.dtype)
        quantized.update(result)
        out = _run_layer(layer, inputs)
        _check_finite(out, f"the quantized outputs of decoder layer {i}")
        err = sum(((o - r).float().pow(2).sum() for o, r in zip(out, ref, strict=True)), torch.tensor(0.0))
        ref_energy = sum((r.float().pow(2).sum() for r in ref), torch.tensor(0.0))
        numel = sum(r.numel() for r in ref)
        report.append(
            {
                "layer": i,
                "output_mse": err.item() / numel,
                "relative_error": (err / ref_energy.clamp(min=1e-30)).item(),
                "seconds": round(time.time() - start, 3),
            }
        )
        bar.set_postfix(rel_err=f"{report[-1]['relative_error']:.2e}")
        inputs = [LayerInputs(o, x.kwargs) for o, x in zip(out, inputs, strict=True)]
        if weights is not None:
            for name, t in layer.state_dict().items():
                full = f"model.layers.{i}.{name}"
                if full.removesuffix(".weight") not in result:
                    float_tensors[full] = t.detach().cpu().clone()
            layer.to("meta")
            return_freed_memory()
    return Result(quantized, report, float_tensors)
