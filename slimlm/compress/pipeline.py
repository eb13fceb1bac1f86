"""The layer-by-layer calibration pipeline every compression step runs on.

1. Run the embeddings for every calibration batch and catch what the first decoder layer receives.
2. For each decoder layer, run the steps in order (e.g. AWQ's scale search, then GPTQ). A step that needs
   data attaches hooks and the batches go through the layer as it stands (the first such pass gives the
   float reference); then the step changes the layer: it may fold scales into weights, quantize linears
   (their dequantized weights are written back), replace modules, add tensors or patch the config.
3. Run the batches through the finished layer. Those outputs feed the next layer, so each layer is
   calibrated on inputs that already carry the earlier layers' compression error. A step may also ask for
   the float model's inputs to the layer (GPTQ's float target): the pipeline then carries that second chain,
   each layer's float outputs on it.

A run where no step needs data (RTN) skips the passes unless the per-layer error report is asked for.
The passes may run in a compute dtype other than the stored one (bf16 for an fp32 model where bf16 products
are fast): they go through a copy of the layer in that dtype, while the steps change and quantize the layer's
own weights.
Only one decoder layer and the calibration activations are live on the compute device at a time.
"""

from __future__ import annotations

import copy
import fnmatch
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_map
from tqdm import tqdm

from slimlm import arch
from slimlm.compress.memory import objects_alive_now_frozen, return_freed_memory
from slimlm.compress.offload import LazyWeights
from slimlm.errors import SlimlmError
from slimlm.formats.quantized import QuantArgs, QuantizedWeight


@dataclass
class StepResult:
    """What a step did to one decoder layer, beyond changing float weights in place."""

    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)  # by full module name
    modules: dict[str, nn.Module] = field(default_factory=dict)  # replacements, by name within the layer
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # extra tensors to store, by name within the layer
    config_patch: dict[str, Any] = field(default_factory=dict)  # merged into config.json


class Step(Protocol):
    """A compression step, seen one decoder layer at a time."""

    needs_data: bool  # whether observe() needs the calibration batches run through the layer
    changes_layer: bool  # whether apply() changes what the layer computes (False: KV scales, statistics)
    # > 0 (GPTQ's): the step is also given the float model's own inputs to the layer; in its pass each batch of
    # those goes through the layer first, with `reference` set to True (the pipeline sets it), so its hooks can
    # pair the two. Steps that set 0 never see `reference`.
    float_target: float
    reference: bool
    # Steps that round weights: the scheme of each linear that does not take the step's own (full names; the
    # budget search sets them before the run).
    schemes: dict[str, QuantArgs]

    def observe(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> list[Any]:
        """Attach hooks that gather statistics during the pass that follows; return their handles."""
        ...

    def apply(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> StepResult:
        """Change the layer (the pass has run); `linears` are the ones no earlier step quantized."""
        ...

    def arguments(self) -> dict[str, Any]:
        """Settings recorded in slimlm.json (and `act_order` in the quantization config)."""
        ...


@dataclass
class LayerInputs:
    """What one calibration batch feeds a decoder layer: hidden states plus rotary/mask keyword args."""

    hidden: torch.Tensor
    kwargs: dict[str, Any]


class _CaughtInputs(Exception):
    pass


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_submodule(arch.LAYERS)


def quantizable_linears(model: nn.Module, ignore: list[str] = ()) -> dict[str, nn.Linear]:
    """Decoder-layer linears not matched by an --ignore glob; embeddings and lm_head stay float."""
    out = {}
    for i, layer in enumerate(decoder_layers(model)):
        for name, mod in layer.named_modules():
            full = f"{arch.LAYERS}.{i}.{name}"
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


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """The floating-point tensors anywhere in a nested structure cast to dtype; everything else as it is."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def in_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The module to run in `dtype`: itself, or a copy in that dtype (the original is left as it is)."""
    return module if next(module.parameters()).dtype == dtype else copy.deepcopy(module).to(dtype)


def _run_layer(layer: nn.Module, inputs: list[LayerInputs]) -> list[torch.Tensor]:
    return [_output(layer(x.hidden, **x.kwargs)) for x in inputs]


def _run_pairs(
    layer: nn.Module, inputs: list[LayerInputs], refs: list[LayerInputs], step: Step
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The layer's outputs on each batch and on the float model's inputs for that batch, which go first with
    `step.reference` set, so that the step's hooks can pair the two."""
    outs, ref_outs = [], []
    for x, r in zip(inputs, refs, strict=True):
        step.reference = True
        try:
            ref_outs.append(_output(layer(r.hidden, **r.kwargs)))
        finally:
            step.reference = False
        outs.append(_output(layer(x.hidden, **x.kwargs)))
    return outs, ref_outs


def _output(y: Any) -> torch.Tensor:
    return y[0] if isinstance(y, tuple) else y


def _wants_float_inputs(step: Step) -> bool:
    return step.float_target > 0


def _float_chain(steps: list[Step], inputs: list[LayerInputs]) -> tuple[list[LayerInputs] | None, bool]:
    """The float model's inputs to the first layer when a step wants them (the float chain starts as the
    calibration inputs), and whether each layer needs a pass of its own to carry the chain on: its outputs on
    them come out of that step's pass unless a step before it changed the layer."""
    if not inputs or not any(_wants_float_inputs(s) for s in steps):
        return None, False
    first = next(k for k, s in enumerate(steps) if _wants_float_inputs(s))
    return inputs, any(s.changes_layer for s in steps[:first])


def _all_finite(t: torch.Tensor) -> bool:
    # the extremes are NaN or infinite when any value is: one pass, ~20× faster than isfinite() on bf16
    return bool(torch.isfinite(torch.stack(torch.aminmax(t))).all())


def _check_finite(tensors: list[torch.Tensor], what: str) -> None:
    if not all(_all_finite(t) for t in tensors):
        raise SlimlmError(f"non-finite values (NaN/Inf) in {what}; the model or calibration data is broken")


@dataclass
class Result:
    quantized: dict[str, QuantizedWeight]  # by full module name, on the CPU
    report: list[dict]  # per decoder layer: output error (when measured), seconds
    float_tensors: dict[str, torch.Tensor]  # the layers' unquantized tensors, plus steps' extra tensors
    config_patch: dict[str, Any] = field(default_factory=dict)


def _output_error(out: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    err = sum(((o - r).float().pow(2).sum() for o, r in zip(out, ref, strict=True)), torch.tensor(0.0))
    energy = sum((r.float().pow(2).sum() for r in ref), torch.tensor(0.0))
    numel = sum(r.numel() for r in ref)
    return {"output_mse": err.item() / numel, "relative_error": (err / energy.clamp(min=1e-30)).item()}


def _on_cpu(q: QuantizedWeight) -> QuantizedWeight:
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    return QuantizedWeight(q.codes.cpu(), q.scale.cpu(), cpu(q.zero), q.args, cpu(q.g_idx))


@dataclass(frozen=True)
class Passes:
    """How the calibration data goes through the layers."""

    batch_size: int = 8  # windows per forward
    device: torch.device | str = "cpu"
    compute_dtype: torch.dtype | None = None  # None: the stored weights' dtype
    report_error: bool = True  # also run each compressed layer to report its output error against the float one
    progress: bool = True  # a progress bar over the layers


def _apply_steps(
    layer: nn.Module,
    i: int,
    linears: dict[str, nn.Linear],
    steps: list[Step],
    inputs: list[LayerInputs],
    refs: list[LayerInputs] | None,
    passes: Passes,
    config_patch: dict[str, Any],
) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor], list | None, list | None]:
    """Each step on decoder layer i in turn, each pass seeing the layer as the steps before left it. Returns
    the quantized linears, the steps' extra tensors, the layer's float outputs (when a step or the error
    report ran the data through it) and its outputs on the float model's inputs `refs` in the first pass that
    took them; the steps' config changes go into config_patch."""
    prefix = f"{arch.LAYERS}.{i}."
    done: dict[str, QuantizedWeight] = {}
    layer_tensors: dict[str, torch.Tensor] = {}
    ref = ref_outs = None
    for step in steps:
        if step.needs_data or (passes.report_error and ref is None):
            runner = in_dtype(layer, passes.compute_dtype)
            same = {n: runner.get_submodule(n[len(prefix) :]) for n in linears}
            handles = step.observe(runner, same) if step.needs_data else []
            try:
                if _wants_float_inputs(step):
                    outs, float_outs = _run_pairs(runner, inputs, refs, step)
                    ref_outs = ref_outs or float_outs
                    del float_outs
                else:
                    outs = _run_layer(runner, inputs)
            finally:
                for h in handles:
                    h.remove()
            del runner, same  # the copy goes: the next pass copies the layer as this step leaves it
            if ref is None:
                _check_finite(outs, f"the float outputs of decoder layer {i}")
                ref = outs
        result = step.apply(layer, {n: m for n, m in linears.items() if n not in done})
        for name, q in result.quantized.items():
            linears[name].weight.data = q.dequantize(linears[name].weight.dtype)
        for local, module in result.modules.items():
            layer.set_submodule(local, module)
        done.update(result.quantized)
        layer_tensors.update({f"{arch.LAYERS}.{i}.{k}": v.detach().cpu() for k, v in result.tensors.items()})
        config_patch.update(result.config_patch)
    return done, layer_tensors, ref, ref_outs


@torch.no_grad()
@objects_alive_now_frozen
def run(
    model: nn.Module,
    steps: list[Step],
    calib: torch.Tensor | None,
    passes: Passes = Passes(),
    ignore: list[str] = (),
    weights: LazyWeights | None = None,
    on_layer: Callable[[dict[str, QuantizedWeight], dict[str, torch.Tensor]], None] | None = None,
) -> Result:
    """Compress every decoder layer of `model` in place, running `steps` on each layer in order.

    With `weights`, the decoder layers start empty (meta) and each is read from disk onto passes.device just
    before it is compressed and dropped right after. `calib` may be None when no step needs data and no
    error report is wanted.

    Each finished layer's quantized weights and tensors to store (the layer's unquantized ones: norms,
    biases, ignored linears; and the steps' extra ones) go to `on_layer` when given, which is how a job
    writes them out at once and holds nothing across layers; otherwise they are gathered in the Result.
    """
    batch_size, device, compute_dtype = passes.batch_size, passes.device, passes.compute_dtype
    with_data = passes.report_error or any(s.needs_data for s in steps)
    inputs = capture_first_layer_inputs(model, calib, batch_size) if with_data else []
    if weights is not None:  # the embedding's work is done (the job reads it from disk again to write it)
        model.get_submodule(arch.EMBED).to("meta")
        return_freed_memory()
    dtype = inputs[0].hidden.dtype if inputs else torch.float32  # the stored weights'
    compute_dtype = compute_dtype or dtype
    passes = replace(passes, compute_dtype=compute_dtype)
    inputs = [LayerInputs(x.hidden.to(compute_dtype), cast_floats(x.kwargs, compute_dtype)) for x in inputs]
    refs, float_pass = _float_chain(steps, inputs)
    layers = decoder_layers(model)
    all_linears = quantizable_linears(model, ignore)
    quantized: dict[str, QuantizedWeight] = {}
    float_tensors: dict[str, torch.Tensor] = {}
    config_patch: dict[str, Any] = {}
    report = []
    bar = tqdm(range(len(layers)), desc="layers", unit="layer", disable=not passes.progress)
    for i in bar:
        start = time.time()
        if weights is not None:
            weights.materialize(layers[i], f"{arch.LAYERS}.{i}", dtype, device)
        layer, prefix = layers[i], f"{arch.LAYERS}.{i}."
        linears = {n: m for n, m in all_linears.items() if n.startswith(prefix)}
        next_refs = _run_layer(in_dtype(layer, compute_dtype), refs) if float_pass else None
        done, layer_tensors, ref, ref_outs = _apply_steps(layer, i, linears, steps, inputs, refs, passes, config_patch)
        if refs is not None:
            refs = [LayerInputs(o, x.kwargs) for o, x in zip(next_refs or ref_outs, inputs, strict=True)]
            del next_refs, ref_outs
        entry = {"layer": i}
        if with_data:
            # steps that change nothing leave the outputs of the float pass: a second pass would repeat it
            unchanged = ref is not None and not any(step.changes_layer for step in steps)
            out = ref if unchanged else _run_layer(in_dtype(layer, compute_dtype), inputs)
            _check_finite(out, f"the compressed outputs of decoder layer {i}")
            if passes.report_error:
                entry.update(_output_error(out, ref))
                bar.set_postfix(rel_err=f"{entry['relative_error']:.2e}")
            inputs = [LayerInputs(o, x.kwargs) for o, x in zip(out, inputs, strict=True)]
        else:
            for name, q in done.items():
                _check_finite([q.scale], f"the quantization scales of {name}")
        entry["seconds"] = round(time.time() - start, 3)
        report.append(entry)
        for name, t in layer.state_dict().items():
            full = f"{arch.LAYERS}.{i}.{name}"
            if full.removesuffix(".weight") not in done:
                layer_tensors[full] = t.detach().cpu().clone()
        done = {n: _on_cpu(q) for n, q in done.items()}
        if on_layer is not None:
            on_layer(done, layer_tensors)
        else:
            quantized.update(done)
            float_tensors.update(layer_tensors)
        del done, layer_tensors
        if weights is not None:
            layer.to("meta")
        return_freed_memory()
    return Result(quantized, report, float_tensors, config_patch)
