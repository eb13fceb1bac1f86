"""One compression job end to end: check everything, load, calibrate layer by layer, write atomically."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from slimlm import arch, data, devices, models
from slimlm.compress import offload, pipeline
from slimlm.compress.quantize import quantize_rtn
from slimlm.errors import SlimlmError
from slimlm.formats import atomic, gptq_v1, kv_cache, shards, writer
from slimlm.formats.quantized import SUPPORTED_GROUP_SIZES, QuantArgs, QuantizedWeight


def default_group_size(model_dir: Path) -> int:
    """The largest standard group size that divides every decoder linear's input dim (-1 if none does)."""
    config = models.read_config(model_dir)
    models.check_architecture(config, model_dir)  # sizes checked without hashing the weights (the job does)
    dims = set(arch.linear_input_dims(config).values())
    return next((g for g in sorted(SUPPORTED_GROUP_SIZES, reverse=True) if g > 0 and all(d % g == 0 for d in dims)), -1)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_lm_head(model: torch.nn.Module, args: QuantArgs) -> None:
    hidden = model.lm_head.in_features
    if args.group_size != -1 and hidden % args.group_size:
        raise SlimlmError(
            f"--quantize-lm-head: --group-size {args.group_size} does not divide lm_head's input dim {hidden}"
        )


def quantize_weights(
    method_name: str,
    steps: pipeline.Step | list[pipeline.Step],
    args: QuantArgs | None,
    model_spec: str,
    out: Path,
    calib: str = "owt",
    num_samples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    ignore: list[str] = (),
    batch_size: int = 8,
    overwrite: bool = False,
    progress: bool = True,
    fmt: str = "compressed-tensors",
    lm_head_bits: int | None = None,
    device: str | None = None,
    report_error: bool = True,
    checks: list = (),
    compute_dtype: str = "auto",
) -> Path:
    """`args` None: the weights are left as they are (a KV-cache step alone; a quantized source keeps its
    packed weights bit for bit). `checks`: callables run after the inputs are validated and before any work
    (e.g. the --ppl source). `compute_dtype`: what the calibration passes run in (devices.compute_dtype)."""
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    steps = steps if isinstance(steps, list) else [steps]
    for name, value in (("--num-samples", num_samples), ("--seq-len", seq_len), ("--batch-size", batch_size)):
        if not (type(value) is int and value > 0):
            raise SlimlmError(f"{name} {value!r} must be a positive integer")
    if fmt == "gptq" and args is not None:
        gptq_v1.check_exportable(args)
    if lm_head_bits is not None and args is None:
        raise SlimlmError("--quantize-lm-head needs a weight quantization method (rtn, gptq, awq)")
    method_args: dict = {}
    for step in steps:
        method_args.update(step.arguments())
    head_args = None if lm_head_bits is None else replace(args, bits=lm_head_bits)
    own = {"lm_head": head_args} if head_args else {}
    writer.quantization_config(fmt, args, [], method_args, own)  # a bad --format fails here, not after calibration
    dev = devices.resolve_device(device)
    devices.compute_dtype(compute_dtype, torch.float32, dev)  # a bad --compute-dtype fails before any work
    model_dir = models.resolve(model_spec)
    source_config = models.check(model_dir)
    source_qcfg = source_config.get("quantization_config")
    keep_weights = args is None and source_qcfg is not None
    if keep_weights and source_qcfg.get("quant_method") != "compressed-tensors":
        raise SlimlmError(f"{model_dir} is a {source_qcfg.get('quant_method')} checkpoint, which has no place for "
                          "KV-cache scales; give compress kv a float or compressed-tensors checkpoint, or pass "
                          "--kv-dtype to the weight method")  # fmt: skip
    with_data = report_error or any(s.needs_data for s in steps)
    data.check_source(calib)  # even when no step reads it: a mistyped --calib is worth saying
    for check in checks:
        check()
    torch.manual_seed(seed)
    out = Path(out).expanduser().resolve()
    with atomic.atomic_dir(out, overwrite, sources=[model_dir]) as tmp:  # checks --out before any work
        if "quantization_config" not in source_config:
            # Decoder layers stay on disk until their turn: memory is bounded by one layer, not the model.
            model, tokenizer = models.empty_model(model_dir), models.load_tokenizer(model_dir)
            weights = offload.LazyWeights(model_dir)
            weights.materialize(model.get_submodule(arch.EMBED), arch.EMBED, torch.float32, dev)
        else:  # an already-quantized checkpoint is loaded whole, dequantized
            model, tokenizer, _ = models.load(str(model_dir))
            model.to(dev)
            weights = None
        if args is not None:
            pipeline.check_group_size(model, args, ignore)
        if lm_head_bits is not None:
            _check_lm_head(model, args)
        start = time.time()
        samples = None
        passes = devices.compute_dtype(compute_dtype, next(model.parameters()).dtype, dev)
        if with_data:
            samples = data.calibration_windows(calib, tokenizer, num_samples, seq_len, seed)
            log(f"[{method_name}] {model_dir.name}: {len(samples)}×{seq_len} calibration tokens from '{calib}', {dev}, "
                f"passes in {_name(passes)}")
        else:
            log(f"[{method_name}] {model_dir.name}: no calibration data needed, on {dev}")
        # Each finished layer goes to disk in the checkpoint's own format at once (shards.ShardWriter), so
        # the job never holds the whole model's codes: memory stays bounded by a layer and one shard.
        shard_writer = shards.ShardWriter(tmp)
        quantized_names: list[str] = []
        kv_scales: dict[str, torch.Tensor] = {}

        # A KV-cache step alone leaves a float source's weights as they are: stored as the source stores them
        # (a bf16 model's layers, materialized in fp32 for the passes, are not written at twice their size).
        as_stored = weights.dtypes if args is None and weights is not None else {}

        def write_layer(quantized: dict[str, QuantizedWeight], tensors: dict[str, torch.Tensor]) -> None:
            if keep_weights:  # only the new KV scales: the source's own tensors are copied at the end
                kv_scales.update({k: v for k, v in tensors.items() if k.endswith(kv_cache.SUFFIXES)})
                return
            tensors = {k: v.to(as_stored[k]) if k in as_stored else v for k, v in tensors.items()}
            quantized_names.extend(quantized)
            shard_writer.add(writer.quantized_tensors(quantized, tensors, fmt))

        result = pipeline.run(model, steps, samples, ignore, batch_size, progress, weights, dev, report_error,
                              on_layer=write_layer, compute_dtype=passes)  # fmt: skip
        seconds = time.time() - start
        if weights is None:
            in_layers = arch.LAYERS + "."
            outside = {k: v.cpu() for k, v in writer.state_tensors(model).items() if not k.startswith(in_layers)}
        else:
            outside = weights.read(weights.names_outside(arch.LAYERS + "."))
        quantized, untie = {}, {}
        if head_args is not None:
            # The lm_head sees the final hidden states only; it is rounded to nearest whatever the method.
            # A tied one is untied: the embeddings stay float (a lookup reads a few rows of them), and only
            # the copy every decode step reads in full is quantized.
            head = outside.get("lm_head.weight", outside[arch.EMBED + ".weight"])
            quantized["lm_head"] = quantize_rtn(head.float(), head_args)
            untie = {"tie_word_embeddings": False} if model.config.tie_word_embeddings else {}
        meta = {
            "method": method_name,
            "arguments": {**(asdict(args) if args else {}), "ignore": list(ignore),
                          "lm_head_bits": lm_head_bits, **method_args},
            "calibration": {"source": calib, "num_samples": num_samples, "seq_len": seq_len, "seed": seed,
                            "compute_dtype": _name(passes)} if with_data else None,
            "source_model": {"spec": model_spec, "path": str(model_dir),
                             "sha256": shards.sha256(*shards.weight_files(model_dir))},
            "source_size_bytes": shards.total_size(model_dir),
            "compress_seconds": round(seconds, 2),
            "device": str(dev),
            "layers": result.report,
        }  # fmt: skip
        if keep_weights:  # the source's own tensors and config, the new KV scales in place of any old ones
            tensors = {k: v for k, v in shards.read(model_dir).items() if not k.endswith(kv_cache.SUFFIXES)}
            shard_writer.add({**tensors, **kv_scales})
            qconfig = {**source_qcfg, "kv_cache_scheme": method_args.get("kv_cache_scheme")}
        else:
            shard_writer.add(writer.quantized_tensors(quantized, outside, fmt))
            linear_names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
            ignored = sorted(linear_names - set(quantized_names) - set(quantized))
            named = {name: q.args for name, q in quantized.items() if q.args != args}
            qconfig = writer.quantization_config(fmt, args, ignored, method_args, named)
        config_patch = {**result.config_patch, **untie, "quantization_config": qconfig}
        if as_stored:  # the float weights' dtype is the source's, and config.json says so
            config_patch["dtype"] = source_config.get("dtype") or source_config.get("torch_dtype") or "float32"
        del quantized, outside, result
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        generation_config = getattr(model, "generation_config", None)
        writer.write_metadata(tmp, shard_writer.finish(), config, tokenizer, meta, config_patch, generation_config)
    log(f"[{method_name}] compressed {model_dir.name} in {seconds:.0f}s; wrote {out}")
    return out
