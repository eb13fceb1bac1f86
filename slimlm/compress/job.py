"""One weight-quantization job end to end: load, calibrate layer by layer, write, optionally measure."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from slimlm import SlimlmError, data, models
from slimlm.compress import checkpoint, gptq_v1, offload, pipeline
from slimlm.compress.quantize import QuantArgs, quantize_rtn


def _check_lm_head(model: torch.nn.Module, args: QuantArgs) -> None:
    if model.config.tie_word_embeddings:
        raise SlimlmError(
            "--quantize-lm-head: this model ties lm_head to the input embeddings (tie_word_embeddings), so "
            "quantizing it would quantize the embeddings too; drop --quantize-lm-head"
        )
    hidden = model.lm_head.in_features
    if args.group_size != -1 and hidden % args.group_size:
        raise SlimlmError(
            f"--quantize-lm-head: --group-size {args.group_size} does not divide lm_head's input dim {hidden}"
        )


def quantize_weights(
    method_name: str,
    method: pipeline.LayerMethod,
    args: QuantArgs,
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
    quantize_lm_head: bool = False,
) -> Path:
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    out = Path(out)
    checkpoint.prepare_output(out, overwrite)  # fail now, not after calibration
    if fmt == "gptq":
        gptq_v1.check_exportable(args)
    torch.manual_seed(seed)
    model_dir = models.resolve(model_spec)
    if "quantization_config" not in models.read_config(model_dir):
        # Decoder layers stay on disk until their turn: memory is bounded by one layer, not the model.
        model, tokenizer = models.load_empty(model_dir)
        weights = offload.LazyWeights(model_dir)
        weights.materialize(model.model.embed_tokens, "model.embed_tokens", torch.float32, "cpu")
    else:  # an already-quantized checkpoint is loaded whole, dequantized
        model, tokenizer, _ = models.load(str(model_dir))
        weights = None
    pipeline.check_group_size(model, args, ignore)
    if quantize_lm_head:
        _check_lm_head(model, args)
    start = time.time()
    samples = data.calibration_windows(calib, tokenizer, num_samples, seq_len, seed)
    log(f"[{method_name}] {model_dir.name}: {len(samples)}×{seq_len} calibration tokens from '{calib}'")
    result = pipeline.run(model, method, samples, ignore, batch_size, progress, weights)
    quantized, report = result.quantized, result.report
    seconds = time.time() - start
    if weights is None:
        float_tensors = checkpoint.state_tensors(model)
    else:
        outside = weights.read(weights.names_outside("model.layers."))
        float_tensors = {**outside, **result.float_tensors}
    if quantize_lm_head:
        # The lm_head sees the final hidden states only; it is rounded to nearest whatever the method.
        quantized["lm_head"] = quantize_rtn(float_tensors["lm_head.weight"].float(), args)
    linear_names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    meta = {
        "method": method_name,
        "arguments": {
            **asdict(args),
            "ignore": list(ignore),
            "quantize_lm_head": quantize_lm_head,
            **method.arguments(),
        },
        "calibration": {"source": calib, "num_samples": num_samples, "seq_len": seq_len, "seed": seed},
        "source_model": {
            "spec": model_spec,
            "path": str(model_dir),
            "sha256": checkpoint.sha256(*checkpoint.weight_files(model_dir)),
        },
        "source_size_bytes": checkpoint.checkpoint_size(model_dir),
        "compress_seconds": round(seconds, 2),
        "layers": report,
    }
    ignored = sorted(linear_names - set(quantized))
    final = checkpoint.save(out, model, tokenizer, quantized, float_tensors, args, ignored, meta, overwrite, fmt)
    log(f"[{method_name}] quantized {len(quantized)} linears in {seconds:.0f}s; wrote {final}")
    return final
