"""`compress gqa`: convert the KV heads of a float checkpoint, uptrain it by distillation from the original,
and write an ordinary Hugging Face checkpoint (smaller `num_key_value_heads`) with its training log."""

from __future__ import annotations

import copy
import math
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from slimlm import SlimlmError, data, models
from slimlm.formats import atomic, shards, writer
from slimlm.train import gqa
from slimlm.train.distill import TrainConfig, check, mean_nll, train

GROUPINGS = ("similarity", "mean")  # similarity: heads chosen by their outputs; mean: contiguous heads
EVAL_TOKENS = 8192  # the curve's points: the first tokens of --eval-data, which training never reads


def text_windows(source: str, tokenizer, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """Consecutive windows of `seq_len` cut from the source's passages joined in order (as calibration cuts
    them), from its first `max_tokens` tokens or all of it."""
    return data.windows(data.token_stream(data.passages(source), tokenizer, max_tokens=max_tokens), seq_len)


def convert_gqa(
    model_spec: str,
    kv_heads: int,
    out: Path,
    expand: bool = False,
    grouping: str = "similarity",
    train_config: TrainConfig | None = None,
    calib: str = "owt",
    num_samples: int = 16,
    train_data: str = "owt",
    eval_data: str = "wiki",
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert (and, with train_config, uptrain) `model_spec` to `kv_heads` KV heads; returns the output dir."""
    from accelerate import PartialState

    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    if grouping not in GROUPINGS:
        raise SlimlmError(f"--grouping {grouping} is not one of {', '.join(GROUPINGS)}")
    if expand and train_config is not None:
        raise SlimlmError("--expand is exact (the same function): it needs no --uptrain-tokens")
    model_dir = models.resolve(model_spec)
    if "quantization_config" in models.read_config(model_dir):
        raise SlimlmError(f"{model_dir} is quantized; GQA conversion needs a float checkpoint (convert first, "
                          "then quantize)")  # fmt: skip
    state = PartialState(cpu=not torch.cuda.is_available())  # on CPU, several processes mean gloo
    out = Path(out).expanduser().resolve()
    if state.is_main_process:  # before any work: an --out that would lose data is refused now
        atomic.check_output(out, overwrite, [model_dir])
    if train_config is not None:
        data.check_source(train_data)
        data.check_source(eval_data)
    teacher, tokenizer, _ = models.load(str(model_dir))  # checks the architecture and the weight files
    gqa.check_kv_heads(teacher.config, kv_heads, expand)
    windows = None
    if train_config is not None:
        windows = text_windows(train_data, tokenizer, train_config.seq_len)
        check(train_config, len(windows), state.num_processes)
    student = copy.deepcopy(teacher)
    before = teacher.config.num_key_value_heads
    start = time.time()
    groups = None
    if expand:
        gqa.expand(student, kv_heads)
    else:
        if grouping == "mean":
            groups = [gqa.contiguous_groups(before, kv_heads)] * teacher.config.num_hidden_layers
        else:
            samples = data.calibration_windows(calib, tokenizer, num_samples, 512)
            groups = gqa.similarity_groups(student, samples, kv_heads)
        gqa.merge(student, groups)
    log(f"[gqa] {model_dir.name}: {before} -> {kv_heads} KV heads ({'expand' if expand else grouping})")
    meta = {"method": "gqa", "arguments": {"kv_heads": kv_heads, "from_kv_heads": before, "expand": expand,
            "grouping": None if expand else grouping, "groups": groups},
            "source_model": {"spec": model_spec, "path": str(model_dir),
                             "sha256": shards.sha256(*shards.weight_files(model_dir))}}  # fmt: skip
    history = []
    if train_config is not None:
        evaluation = text_windows(eval_data, tokenizer, train_config.seq_len, EVAL_TOKENS)

        def evaluate(model) -> dict:
            return {"eval_ppl": math.exp(mean_nll(model, evaluation))}

        run_dir = out.with_name(f".{out.name}.train")
        log(f"[gqa] uptraining: {train_config.steps} steps of {train_config.global_batch}×{train_config.seq_len} "
            f"tokens from '{train_data}' on {state.num_processes} process(es); checkpoints in {run_dir}")  # fmt: skip
        history = train(student, teacher, windows, train_config, run_dir, evaluate, progress)
        meta["training"] = {**asdict(train_config), "data": train_data, "log": history,
                            "eval": f"{eval_data}, first {EVAL_TOKENS} tokens"}  # fmt: skip
    meta["convert_seconds"] = round(time.time() - start, 2)
    if state.is_main_process:
        with atomic.atomic_dir(out, overwrite, sources=[model_dir]) as tmp:
            writer.write(tmp, writer.state_tensors(student), student.config, tokenizer, meta,
                         generation_config=getattr(student, "generation_config", None))  # fmt: skip
            if train_config is not None:
                for name in ("log.jsonl", "curve.png"):
                    shutil.copy(run_dir / name, tmp / name)
        if train_config is not None:
            shutil.rmtree(run_dir, ignore_errors=True)  # the run is complete: its checkpoint is not needed
        log(f"[gqa] wrote {out}")
    state.wait_for_everyone()
    return out
