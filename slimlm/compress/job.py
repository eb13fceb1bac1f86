"""One compression job end to end: check everything, load, calibrate layer by layer, write atomically."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from slimlm import arch, data, devices, models
from slimlm.compress import mixed_precision, offload, pipeline
from slimlm.compress.kv import KVCache
from slimlm.compress.memory import return_freed_memory
from slimlm.compress.quantize import quantize_rtn
from slimlm.errors import FieldError
from slimlm.formats import atomic, gptq_v1, kv_cache, shards, writer
from slimlm.formats.quantized import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, QuantArgs, QuantizedWeight, stored_scale


def default_group_size(model_dir: Path) -> int:
    """The largest standard group size that divides every decoder linear's input dim (-1 if none does)."""
    config = models.read_config(model_dir)
    models.check_architecture(config, model_dir)  # sizes checked without hashing the weights (the job does)
    dims = set(arch.linear_input_dims(config).values())
    return next((g for g in sorted(SUPPORTED_GROUP_SIZES, reverse=True) if g > 0 and all(d % g == 0 for d in dims)), -1)


def _check_lm_head(model: torch.nn.Module, args: QuantArgs) -> None:
    hidden = model.lm_head.in_features
    if args.group_size != -1 and hidden % args.group_size:
        raise FieldError(
            "quantize_lm_head",
            f"needs a group size that divides lm_head's input dim {hidden}: {{group_size}} {args.group_size} does not",
        )


@dataclass(frozen=True)
class CalibData:
    """The calibration data, and where and in what dtype its passes run."""

    calib: str = "owt"  # owt | wiki | c4 | PATH.txt | PATH.jsonl (data.check_source); the fields are the jobs'
    # (jobs/quantize.Calibration fills them by name, and a test checks the defaults agree)
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    batch_size: int = 8  # windows per forward
    device: str | None = None  # devices.resolve_device
    compute_dtype: str = "auto"  # what the passes run in (devices.compute_dtype)


@dataclass
class Quantization:
    """One compression run: its steps, the scheme they round the weights to, and the checkpoint it writes."""

    method: str  # recorded in slimlm.json, e.g. "awq+gptq+kv"
    steps: list[pipeline.Step]
    args: QuantArgs | None  # None: the weights stay as they are (a KV-cache step alone; packed ones bit for bit)
    model: str
    out: Path
    calibration: CalibData = field(default_factory=CalibData)
    ignore: Sequence[str] = ()  # linears kept float (fnmatch patterns)
    fmt: str = "compressed-tensors"  # or "gptq" (v1)
    lm_head_bits: int | None = None  # rounded to nearest at these bits; None: float
    overwrite: bool = False
    report_error: bool = True  # run the data through each layer to report its output error
    budget: float | None = None  # bits per decoder-layer weight, scales included: each unit's scheme is chosen
    budget_bits: tuple[int, ...] = mixed_precision.BITS  # the code widths it chooses from
    size: int | None = None  # instead of `budget`: the weight files' bytes; the linears get what the rest leaves


@dataclass
class _Source:
    """The checked source model and what the run makes of it."""

    dir: Path
    config: dict
    device: torch.device
    method_args: dict
    head_args: QuantArgs | None
    keep_weights: bool  # a KV-cache step on a quantized checkpoint: its tensors are copied as they are


def quantize_weights(job: Quantization, progress: bool = True, checks: Sequence[Callable[[], None]] = ()) -> Path:
    """Check everything, then calibrate layer by layer and write the checkpoint to job.out atomically.
    `checks`: callables run after the inputs are validated and before any work (e.g. the --ppl source)."""
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    source = check_inputs(job)
    for check in checks:
        check()
    calibration = job.calibration
    torch.manual_seed(calibration.seed)
    out = Path(job.out).expanduser().resolve()
    with atomic.atomic_dir(out, job.overwrite, sources=[source.dir]) as tmp:  # checks --out before any work
        with_data = job.report_error or any(s.needs_data for s in job.steps)  # passes through the layers
        model, tokenizer, weights = _load(source, with_data)
        start = time.time()
        passes = devices.compute_dtype(calibration.compute_dtype, next(model.parameters()).dtype, source.device)
        samples = None
        mixed = job.budget is not None or job.size is not None
        if with_data or mixed:  # a budget's Fisher reads the first windows too
            samples = data.calibration_windows(
                calibration.calib, tokenizer, calibration.num_samples, calibration.seq_len, calibration.seed
            )
            log(
                f"[{job.method}] {source.dir.name}: {len(samples)}×{calibration.seq_len} calibration tokens from "
                f"'{calibration.calib}', {source.device}, passes in {devices.dtype_name(passes)}"
            )
        else:
            log(f"[{job.method}] {source.dir.name}: no calibration data needed, on {source.device}")
        # Each finished layer goes to disk in the checkpoint's own format at once (shards.ShardWriter), so
        # the job never holds the whole model's codes: memory stays bounded by a layer and one shard.
        run = pipeline.Passes(calibration.batch_size, source.device, passes, job.report_error, progress)
        chosen = _choose_schemes(job, source, samples, log, model) if mixed else None
        layers = _LayerWriter(
            shards.ShardWriter(tmp),
            job.fmt,
            source.keep_weights,
            weights.dtypes if job.args is None and weights is not None else {},
        )
        result = pipeline.run(model, job.steps, samples, run, job.ignore, weights, on_layer=layers.write)
        seconds = time.time() - start
        meta = _manifest(job, source, passes if samples is not None else None, seconds, result.report)
        if chosen is not None:
            meta["budget"] = mixed_precision.record(chosen, job.budget, job.size)
        for step in job.steps:
            if isinstance(step, KVCache):
                meta["kv_cache"] = kv_cache.write_key_offsets(tmp, step.key_offsets)
        config_patch = {**result.config_patch, **_finish(job, source, model, weights, layers)}
        del result
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        generation_config = getattr(model, "generation_config", None)
        files = layers.sink.finish()
        if chosen is not None:
            meta["budget"]["written_bytes"] = written = sum((tmp / f).stat().st_size for f in files)
            log(f"[{job.method}] weight files: {written:,} bytes" + (f" (asked {job.size:,})" if job.size else ""))
        writer.write_metadata(tmp, files, config, tokenizer, meta, config_patch, generation_config)
    log(f"[{job.method}] compressed {source.dir.name} in {seconds:.0f}s; wrote {out}")
    return out


def _manifest(job: Quantization, source: _Source, passes: torch.dtype | None, seconds: float, report: list) -> dict:
    """slimlm.json's record of the run (formats.manifest); `passes` None when no calibration data was read."""
    c = job.calibration
    return {
        "method": job.method,
        "arguments": {
            **(asdict(job.args) if job.args else {}),
            "ignore": list(job.ignore),
            "lm_head_bits": job.lm_head_bits,
            **source.method_args,
        },
        "calibration": {
            "source": c.calib,
            "num_samples": c.num_samples,
            "seq_len": c.seq_len,
            "seed": c.seed,
            "compute_dtype": devices.dtype_name(passes),
        }
        if passes is not None
        else None,
        "source_model": {
            "spec": job.model,
            "path": str(source.dir),
            "sha256": shards.sha256(*shards.weight_files(source.dir)),
        },
        "source_size_bytes": shards.total_size(source.dir),
        "compress_seconds": round(seconds, 2),
        "device": str(source.device),
        "layers": report,
    }


def plan_schemes(job: Quantization, progress: bool = True) -> mixed_precision.Choice:
    """What `job`'s budget or size would give each decoder linear, without quantizing (`compress plan --budget`):
    the same checks, Fisher windows and knapsack as the run (the first windows of a seed do not depend on how
    many are drawn)."""
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    source = check_inputs(job)
    c = job.calibration
    windows = min(c.num_samples, mixed_precision.SENSITIVITY_WINDOWS)
    samples = data.calibration_windows(c.calib, models.load_tokenizer(source.dir), windows, c.seq_len, c.seed)
    return _choose_schemes(job, source, samples, log, models.empty_model(source.dir))


def _choose_schemes(
    job: Quantization, source: _Source, samples: torch.Tensor, log: Callable[[str], None], shapes: torch.nn.Module
) -> mixed_precision.Choice:
    """The budget's scheme for every decoder linear, from the float model's loss on the first
    SENSITIVITY_WINDOWS calibration windows (mixed_precision.fisher); given to every step that rounds weights.
    The whole model is loaded for it, then let go. With a --size the linears get the bytes the checkpoint's
    other tensors leave (counted on `shapes`, the pipeline's model as it will be written)."""
    covered = pipeline.quantizable_linears(shapes, job.ignore)
    other_bytes = mixed_precision.other_bytes(shapes, set(covered), source.head_args)
    if job.size is not None:  # refused before the Fisher's work
        least = mixed_precision.least_bytes(covered, job.args.sym, tuple(job.budget_bits))
        if job.size - other_bytes < least:
            raise FieldError(
                "size",
                f"{job.size:,} bytes is too small: the tensors besides the decoder linears take {other_bytes:,} "
                f"and the linears' smallest schemes {least:,}; raise {{size}} to at least {other_bytes + least:,}",
            )
    asked = f"{job.budget} bits per weight" if job.size is None else f"a checkpoint of {job.size:,} bytes"
    log(f"[{job.method}] budget {asked}: each linear's loss sensitivity at every scheme")
    model = models.load(str(source.dir))[0].to(source.device)
    passes = devices.compute_dtype(job.calibration.compute_dtype, torch.float32, source.device)
    fisher = mixed_precision.fisher(model, samples[: mixed_precision.SENSITIVITY_WINDOWS], job.ignore, passes)
    linears = pipeline.quantizable_linears(model, job.ignore)
    units = mixed_precision.sensitivity(linears, fisher, job.args.sym, tuple(job.budget_bits))
    del model, fisher, linears
    return_freed_memory()
    allowed = mixed_precision.budget_bytes(units, job.budget) if job.size is None else job.size - other_bytes
    choice = mixed_precision.choose(units, allowed)
    for step in job.steps:
        if hasattr(step, "schemes"):
            step.schemes = choice.schemes
    log(f"[{job.method}] {mixed_precision.summary(choice)}")
    return choice


def check_inputs(job: Quantization) -> _Source:
    """Every input checked before any work: the settings, the format, the device, the model (its shapes on the
    meta device: which group sizes fit), the data. `compress recipe --check` runs this too."""
    c = job.calibration
    for name, value in (("num_samples", c.num_samples), ("seq_len", c.seq_len), ("batch_size", c.batch_size)):
        if not (type(value) is int and value > 0):
            raise FieldError(name, f"{value!r} must be a positive integer")
    if job.fmt == "gptq" and job.args is not None:
        gptq_v1.check_exportable(job.args)
    if job.budget is not None and job.size is not None:
        raise FieldError("size", "and {budget} both set the size; give one")
    if job.budget is not None or job.size is not None:
        which = "budget" if job.size is None else "size"
        if job.args is None:
            raise FieldError(which, "needs a weight quantization method (rtn, gptq, awq, autoround)")
        if job.fmt == "gptq":
            raise FieldError(which, "mixes schemes, which {format} gptq cannot store; use compressed-tensors")
        if not job.budget_bits or not set(job.budget_bits) <= set(SUPPORTED_BITS):
            raise FieldError(
                "budget_bits", f"{list(job.budget_bits)}: choose from {', '.join(map(str, SUPPORTED_BITS))}"
            )
        if job.size is None and not mixed_precision.MIN_BITS <= job.budget <= mixed_precision.MAX_BITS:
            raise FieldError(
                "budget",
                f"{job.budget} must be between {mixed_precision.MIN_BITS} and {mixed_precision.MAX_BITS} bits a weight",
            )
        if job.size is not None and not (type(job.size) is int and job.size > 0):
            raise FieldError("size", f"{job.size!r} must be a positive number of bytes")
    if job.lm_head_bits is not None and job.args is None:
        raise FieldError("quantize_lm_head", "needs a weight quantization method (rtn, gptq, awq)")
    method_args: dict = {}
    for step in job.steps:
        method_args.update(step.arguments())
    head_args = None if job.lm_head_bits is None else replace(job.args, bits=job.lm_head_bits)
    own = {"lm_head": head_args} if head_args else {}
    writer.quantization_config(job.fmt, job.args, [], method_args, own)  # a bad --format fails here, not after
    dev = devices.resolve_device(c.device)
    devices.compute_dtype(c.compute_dtype, torch.float32, dev)  # a bad --compute-dtype fails before any work
    model_dir = models.resolve(job.model)
    source_config = models.check(model_dir)
    source_qcfg = source_config.get("quantization_config")
    keep_weights = job.args is None and source_qcfg is not None
    if keep_weights and source_qcfg.get("quant_method") != "compressed-tensors":
        raise FieldError(
            "model",
            f"{model_dir} is a {source_qcfg.get('quant_method')} checkpoint, which has no place for KV-cache "
            "scales; give compress kv a float or compressed-tensors checkpoint, or set {kv_dtype} in the weight "
            "method",
        )
    if job.args is not None:
        shapes = models.empty_model(model_dir)
        pipeline.check_group_size(shapes, job.args, job.ignore)
        if job.lm_head_bits is not None:
            _check_lm_head(shapes, job.args)
    data.check_source(c.calib)  # even when no step reads it: a mistyped --calib is worth saying
    return _Source(model_dir, source_config, dev, method_args, head_args, keep_weights)


def _load(source: _Source, with_data: bool) -> tuple[torch.nn.Module, object, offload.LazyWeights | None]:
    """A float source's decoder layers stay on disk until their turn: memory is bounded by one layer, not the
    model; the embedding is read only when calibration data must go through it. An already-quantized checkpoint
    is loaded whole, dequantized."""
    if "quantization_config" not in source.config:
        model, tokenizer = models.empty_model(source.dir), models.load_tokenizer(source.dir)
        weights = offload.LazyWeights(source.dir)
        if with_data:
            weights.materialize(model.get_submodule(arch.EMBED), arch.EMBED, torch.float32, source.device)
        return model, tokenizer, weights
    model, tokenizer, _ = models.load(str(source.dir))
    return model.to(source.device), tokenizer, None


@dataclass
class _LayerWriter:
    """Writes each finished decoder layer in the checkpoint's format (pipeline.run's on_layer)."""

    sink: shards.ShardWriter
    fmt: str
    keep_weights: bool  # only the new KV scales are kept: the source's own tensors are copied at the end
    # A KV-cache step alone leaves a float source's weights as they are: stored as the source stores them
    # (a bf16 model's layers, materialized in fp32 for the passes, are not written at twice their size).
    as_stored: dict[str, torch.dtype]
    written: dict[str, QuantArgs] = field(default_factory=dict)  # each quantized linear's scheme
    kv_scales: dict[str, torch.Tensor] = field(default_factory=dict)

    def write(self, quantized: dict[str, QuantizedWeight], tensors: dict[str, torch.Tensor]) -> None:
        if self.keep_weights:
            self.kv_scales.update({k: v for k, v in tensors.items() if k.endswith(kv_cache.SUFFIXES)})
            return
        tensors = {k: v.to(self.as_stored[k]) if k in self.as_stored else v for k, v in tensors.items()}
        self.written.update({name: q.args for name, q in quantized.items()})
        self.sink.add(writer.quantized_tensors(quantized, tensors, self.fmt))


def _finish(
    job: Quantization,
    source: _Source,
    model: torch.nn.Module,
    weights: offload.LazyWeights | None,
    layers: _LayerWriter,
) -> dict:
    """Write what lies outside the decoder layers (embeddings, final norm, lm_head, or a quantized source's own
    tensors with the new KV scales); returns the config.json fields the checkpoint changes."""
    if source.keep_weights:  # the source's own tensors and config, the new KV scales in place of any old ones
        tensors = {k: v for k, v in shards.read(source.dir).items() if not k.endswith(kv_cache.SUFFIXES)}
        layers.sink.add({**tensors, **layers.kv_scales})
        qcfg = source.config["quantization_config"]
        return {"quantization_config": {**qcfg, "kv_cache_scheme": source.method_args.get("kv_cache_scheme")}}
    if weights is None:
        in_layers = arch.LAYERS + "."
        outside = {k: v.cpu() for k, v in writer.state_tensors(model).items() if not k.startswith(in_layers)}
    else:
        outside = weights.read(weights.names_outside(arch.LAYERS + "."))
    quantized, patch = {}, {}
    if source.head_args is not None:
        # The lm_head sees the final hidden states only; it is rounded to nearest whatever the method. A tied
        # one is untied: the embeddings stay float (a lookup reads a few rows of them), and only the copy
        # every decode step reads in full is quantized.
        # The float head goes from `outside` once it is quantized, before its codes are packed.
        head = outside.pop("lm_head.weight", None)
        q = quantize_rtn(outside[arch.EMBED + ".weight"] if head is None else head, source.head_args)
        q.scale = stored_scale(q.scale, torch.float32)  # fp16 where it fits, also for a bf16 head: 8-bit codes
        # reach 128 steps from zero, where a bf16 scale's rounding (2^-9) would move a weight by a quarter step
        quantized["lm_head"] = q
        del head
        patch = {"tie_word_embeddings": False} if model.config.tie_word_embeddings else {}
    layers.sink.add(writer.quantized_tensors(quantized, outside, job.fmt))
    linear_names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    ignored = sorted(linear_names - set(layers.written) - set(quantized))
    # The head in a group of its own even at the layers' scheme: vLLM's lm_head is no "Linear", so under the
    # class target alone it looked for a float lm_head.weight in a W8 checkpoint.
    named = {name: q.args for name, q in quantized.items()}
    # A budget's mix: its most common scheme is the "Linear" group's, each other one a group of its own.
    schemes = Counter(layers.written.values())
    main = schemes.most_common(1)[0][0] if schemes else job.args
    others = {name: args for name, args in layers.written.items() if args != main}
    patch["quantization_config"] = writer.quantization_config(job.fmt, main, ignored, source.method_args, named, others)
    if layers.as_stored:  # the float weights' dtype is the source's, and config.json says so
        patch["dtype"] = models.stored_dtype_name(source.config)
    return patch
