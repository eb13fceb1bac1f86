"""`compress gqa` and `compress prune`: change the structure of a float checkpoint (merge KV heads; remove
layers, heads, neurons, channels), distill it from the original, and write an ordinary Hugging Face
checkpoint (smaller config fields) with its training log."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from slimlm import data, models
from slimlm.errors import FieldError, SlimlmError
from slimlm.formats import atomic, shards, writer
from slimlm.train import gqa, prune
from slimlm.train.distill import TrainConfig, check, compact_teacher, mean_nll, train

GROUPINGS = ("similarity", "mean")  # similarity: heads chosen by their outputs; mean: contiguous heads
EVAL_TOKENS = 8192  # the curve's points: the first tokens of --eval-data, which training never reads
SCORE_SAMPLES = 4  # calibration windows, beyond the importance ones, that score --target-params candidates


def text_windows(source: str, tokenizer, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """Consecutive windows of `seq_len` cut from the source's passages joined in order (as calibration cuts
    them), from its first `max_tokens` tokens or all of it."""
    return data.windows(data.token_stream(data.passages(source), tokenizer, max_tokens=max_tokens), seq_len)


def _logger(progress: bool):
    return (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)


@dataclass(frozen=True)
class Run:
    """What gqa and prune share: the source, where the result goes, and its distillation (None: none)."""

    model: str  # asset name, local float directory or hub id
    out: Path
    train_config: TrainConfig | None = None
    train_data: str = "owt"
    eval_data: str = "wiki"
    overwrite: bool = False
    progress: bool = True


@dataclass
class _Job:
    """What both commands have once the source is checked and loaded."""

    model_spec: str
    model_dir: Path
    out: Path
    teacher: torch.nn.Module
    tokenizer: object
    state: object  # accelerate's PartialState: which process this is
    windows: torch.Tensor | None  # the training windows, when there is training


def check_source(command: str, run: Run) -> Path:
    """The run's model and text, checked without loading either (recipe --check runs this too)."""
    model_dir = models.resolve(run.model)
    config = models.check(model_dir)  # an architecture the runtime serves
    if "quantization_config" in config:
        raise SlimlmError(
            f"{model_dir} is quantized; {command} needs a float checkpoint ({command} first, then quantize)"
        )
    if run.train_config is not None:
        data.check_source(run.train_data)
        data.check_source(run.eval_data)
    return model_dir


def check_gqa(run: Run, kv_heads: int, expand: bool, grouping: str, calib: str) -> Path:
    """Every check convert_gqa makes before its work, on the model's config alone."""
    if grouping not in GROUPINGS:
        raise FieldError("grouping", f"{grouping} is not one of {', '.join(GROUPINGS)}")
    if expand and run.train_config is not None:
        raise FieldError("expand", "is exact (the same function): it needs no {uptrain_tokens}")
    model_dir = check_source("GQA conversion", run)
    gqa.check_kv_heads(models.empty_model(model_dir).config, kv_heads, expand)
    if not expand and grouping == "similarity":
        data.check_source(calib)
    return model_dir


def check_prune(run: Run, target: float | None, sizes: dict, candidate: str | None, calib: str) -> Path:
    """Every check prune_model makes before its work, on the model's shapes alone (the meta device)."""
    if candidate is not None and (target is None or candidate not in prune.FAMILIES):
        raise FieldError("candidate", f"needs {{target_params}} and one of {', '.join(prune.FAMILIES)}")
    model_dir = check_source("pruning", run)
    _shapes(models.empty_model(model_dir), target, sizes, candidate, lambda message: None)
    data.check_source(calib)
    return model_dir


def _start(command: str, run: Run) -> _Job:
    """Every check that can fail before work starts, then the source model and the training text."""
    from accelerate import PartialState

    train_config = run.train_config
    model_dir = check_source(command, run)
    state = PartialState(cpu=not torch.cuda.is_available())  # on CPU, several processes mean gloo
    out = Path(run.out).expanduser().resolve()
    if state.is_main_process:  # before any work: an --out that would lose data is refused now
        atomic.check_output(out, run.overwrite, [model_dir])
    teacher, tokenizer, _ = models.load(str(model_dir))  # checks the weight files
    windows = None
    if train_config is not None:
        windows = text_windows(run.train_data, tokenizer, train_config.seq_len)
        check(train_config, len(windows), state.num_processes)
    return _Job(run.model, model_dir, out, teacher, tokenizer, state, windows)


def _finish(job: _Job, student: torch.nn.Module, meta: dict, run: Run, tag: str) -> Path:
    """Distill `student` from the source (with a train_config), then write it with its manifest and curve."""
    log, state, out, progress = _logger(run.progress), job.state, job.out, run.progress
    train_config, train_data, eval_data = run.train_config, run.train_data, run.eval_data
    meta["source_model"] = {
        "spec": job.model_spec,
        "path": str(job.model_dir),
        "sha256": shards.sha256(*shards.weight_files(job.model_dir)),
    }
    run_dir = out.with_name(f".{out.name}.train")
    if train_config is not None:
        evaluation = text_windows(eval_data, job.tokenizer, train_config.seq_len, EVAL_TOKENS)

        def evaluate(model) -> dict:
            return {"eval_ppl": math.exp(mean_nll(model, evaluation))}

        log(
            f"[{tag}] distillation: {train_config.steps} steps of {train_config.global_batch}×"
            f"{train_config.seq_len} tokens from '{train_data}' on {state.num_processes} process(es); "
            f"checkpoints in {run_dir}"
        )
        # what a checkpoint must share with this run to be resumed: the source's weights, the conversion or
        # pruning and its options, the text — its tokens, not the file's name, which may now hold other text
        # (json-normal, as the checkpoint stores it)
        identity = json.loads(
            json.dumps(
                {
                    "source": meta["source_model"]["sha256"],
                    "method": meta["method"],
                    "arguments": meta["arguments"],
                    "train_data": [train_data, _tokens_hash(job.windows)],
                    "eval_data": [eval_data, _tokens_hash(evaluation)],
                },
                default=str,
            )
        )
        compact_teacher(job.teacher, train_config)  # the last use of the teacher
        busy = f"another run is training in {run_dir} now (the same --out); wait for it or name another --out"
        with atomic.hold(run_dir, busy) if state.is_main_process else contextlib.nullcontext():
            history = train(student, job.teacher, job.windows, train_config, run_dir, evaluate, progress, identity)
        meta["training"] = {
            **asdict(train_config),
            "data": train_data,
            "log": history,
            "eval": f"{eval_data}, first {EVAL_TOKENS} tokens",
        }
    if state.is_main_process:
        with atomic.atomic_dir(out, run.overwrite, sources=[job.model_dir]) as tmp:
            # in the source's dtype: a bf16 model trained in fp32 stays a bf16 checkpoint of the source's size
            stored = models.stored_dtype(models.read_config(job.model_dir))
            tensors = writer.state_tensors(student)
            files = shards.write(tmp, {k: v.to(stored) if v.is_floating_point() else v for k, v in tensors.items()})
            student.config.dtype = stored
            writer.write_metadata(
                tmp,
                files,
                student.config,
                job.tokenizer,
                meta,
                generation_config=getattr(student, "generation_config", None),
            )
            if train_config is not None:
                for name in ("log.jsonl", "curve.png"):
                    shutil.copy(run_dir / name, tmp / name)
        if train_config is not None:
            shutil.rmtree(run_dir, ignore_errors=True)  # the run is complete: its checkpoint is not needed
        log(f"[{tag}] wrote {out}")
    state.wait_for_everyone()
    return out


def _tokens_hash(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def convert_gqa(
    run: Run,
    kv_heads: int,
    expand: bool = False,
    grouping: str = "similarity",
    calib: str = "owt",
    num_samples: int = 16,
) -> Path:
    """Convert (and, with run.train_config, uptrain) run.model to `kv_heads` KV heads; returns the output dir."""
    check_gqa(run, kv_heads, expand, grouping, calib)
    job = _start("GQA conversion", run)
    student = copy.deepcopy(job.teacher)
    before = job.teacher.config.num_key_value_heads
    start = time.time()
    groups = None
    if expand:
        gqa.expand(student, kv_heads)
    else:
        if grouping == "mean":
            groups = [gqa.contiguous_groups(before, kv_heads)] * job.teacher.config.num_hidden_layers
        else:
            samples = data.calibration_windows(calib, job.tokenizer, num_samples, 512)
            groups = gqa.similarity_groups(student, samples, kv_heads)
        gqa.merge(student, groups)
    _logger(run.progress)(
        f"[gqa] {job.model_dir.name}: {before} -> {kv_heads} KV heads ({'expand' if expand else grouping})"
    )
    meta = {
        "method": "gqa",
        "arguments": {
            "kv_heads": kv_heads,
            "from_kv_heads": before,
            "expand": expand,
            "grouping": None if expand else grouping,
            "groups": groups,
        },
        "convert_seconds": round(time.time() - start, 2),
    }
    return _finish(job, student, meta, run, "gqa")


def prune_shape(config, target: float | None, sizes: dict[str, int | None]) -> prune.Shape | None:
    """The explicit shape from --hidden/--heads/--ffn/--layers (None with --target-params), checked: one
    line for a target that removes everything or nothing, or a head count the grouping cannot take."""
    given = {dim: v for dim, v in sizes.items() if v is not None}
    if (target is None) == (not given):
        raise FieldError("target_params", "give either {target_params} or some of {hidden}/{heads}/{ffn}/{layers}")
    current = prune.Shape.of(config)
    if target is not None:
        if not 0 < target < 1:
            raise FieldError("target_params", f"{target} must be a fraction of today's parameters, in (0, 1)")
        return None
    for dim, value in given.items():
        if not 0 < value <= getattr(current, dim):
            raise FieldError(dim, f"{value} must be between 1 and the model's {getattr(current, dim)}")
    shape = prune.Shape(**{**asdict(current), **given})
    if "heads" in given:
        shape = prune.Shape(**{**asdict(shape), "kv_heads": prune.kv_heads_for(config, shape.heads)})
    if shape.hidden % shape.heads:
        below = shape.hidden // shape.heads * shape.heads
        raise FieldError(
            "hidden",
            f"{shape.hidden} is not a multiple of the {shape.heads} attention heads "
            f"(transformers requires it); nearest: {below}, {below + shape.heads}",
        )
    if shape == current:
        raise SlimlmError(f"the sizes given are the model's own ({asdict(current)}): nothing would be removed")
    return shape


def _removed(keep: prune.Keep, config, scores: prune.Importance) -> dict:
    """What went, by original index, and the importance it carried: the manifest's 'what and why'."""
    current = prune.Shape.of(config)
    layers = keep.layers

    def gone(kept: list[int], total: int) -> list[int]:
        return sorted(set(range(total)) - set(kept))

    def share(scores: torch.Tensor, kept: list[int]) -> float:
        return round(1 - scores[kept].sum().item() / scores.sum().item(), 4)

    return {
        "layers": gone(layers, current.layers),
        "hidden": gone(keep.hidden, current.hidden),
        "heads": {i: gone(h, current.heads) for i, h in zip(layers, keep.heads, strict=True)},
        "kv_heads": {i: gone(k, current.kv_heads) for i, k in zip(layers, keep.kv_heads, strict=True)},
        "ffn": {i: gone(f, current.ffn) for i, f in zip(layers, keep.ffn, strict=True)},
        "importance": {
            "criteria": {
                "layers": "mean cosine distance between the layer's input and output",
                "heads": "RMS of the head's contribution to the attention output",
                "ffn": "RMS of the neuron's activation × its down_proj column norm",
                "hidden": "sum over the layers' RMSNorms of the channel's output RMS",
            },
            "layers": [round(v, 5) for v in scores.layers.tolist()],
            "heads": [[round(v, 5) for v in h.tolist()] for h in scores.heads],
            "removed_share": {
                "hidden": share(scores.hidden, keep.hidden),
                "ffn": [share(scores.ffn[i], f) for i, f in zip(layers, keep.ffn, strict=True)],
            },
        },
    }


def _shapes(teacher: torch.nn.Module, target: float | None, sizes: dict, candidate: str | None, log):
    """The explicit shape (or None) and the candidates for `target` (name -> shape), checked; with the source's
    shape and parameter count."""
    shape = prune_shape(teacher.config, target, sizes)
    current = prune.Shape.of(teacher.config)
    fits = prune.fitting_group_sizes(teacher.config, current)
    if shape is not None and (left := prune.fitting_group_sizes(teacher.config, shape)) != fits:
        named = lambda sizes: ", ".join(map(str, sizes)) or "none of " + ", ".join(map(str, prune.GROUP_SIZES))  # noqa: E731
        log(
            f"warning: pruned to {shape.hidden} hidden and {shape.ffn} MLP channels, quantization group sizes "
            f"{named(left)} still fit (the model took {named(fits)}); later quantization needs a group size "
            "that divides every width, or --group-size -1"
        )
    total = prune.count_parameters(teacher, current)
    found = prune.candidates(teacher, target) if shape is None else {}
    if shape is None and not found:
        embeddings = teacher.config.vocab_size * current.hidden / total
        raise FieldError(
            "target_params",
            f"{{target_params}} {target}: no candidate reaches {target:.0%} of the parameters (the embeddings "
            f"alone are {embeddings:.0%}); raise {{target_params}}",
        )
    if candidate is not None and candidate not in found:
        raise FieldError("candidate", f"{candidate} cannot reach {target:.0%}; candidates: {', '.join(found)}")
    return shape, found, current, total


def _candidate(
    job: _Job,
    name: str,
    shape: prune.Shape,
    scores: prune.Importance,
    held_out: torch.Tensor,
    search: TrainConfig | None,
    windows: torch.Tensor | None,
) -> dict:
    """One candidate cut from the source: its shape, size and held-out perplexity; with `search`, also after
    that short distillation on `windows` (Minitron's retraining of each candidate)."""
    teacher = job.teacher
    student = prune.prune(teacher, prune.select(scores, teacher.config, shape))
    figures = {
        **asdict(shape),
        "parameters": prune.count_parameters(teacher, shape),
        "ppl": math.exp(mean_nll(student, held_out)),
    }
    if search is not None:
        run_dir = job.out.with_name(f".{job.out.name}.search-{name}")
        shutil.rmtree(run_dir, ignore_errors=True)
        train(student, teacher, windows, search, run_dir, progress=False)
        shutil.rmtree(run_dir, ignore_errors=True)
        figures["ppl_after_search"] = math.exp(mean_nll(student, held_out))
    return figures


def prune_model(
    run: Run,
    target: float | None = None,
    sizes: dict[str, int | None] | None = None,
    candidate: str | None = None,
    calib: str = "owt",
    num_samples: int = 32,
    search: TrainConfig | None = None,
) -> Path:
    """Prune run.model to `target` of its parameters (searching the candidate shapes: the best by perplexity
    right after pruning, or with `search`, after that short distillation of each) or to the explicit `sizes`
    (hidden, heads, ffn, layers), distill it with run.train_config, write it; returns the output dir."""
    log, progress = _logger(run.progress), run.progress
    check_prune(run, target, sizes or {}, candidate, calib)
    job = _start("pruning", run)
    teacher = job.teacher
    shape, found, current, total = _shapes(teacher, target, sizes or {}, candidate, log)
    searching = search is not None and len(found) > 1 and candidate is None
    windows = None
    if searching:
        windows = text_windows(run.train_data, job.tokenizer, search.seq_len)
        check(search, len(windows), job.state.num_processes)
    start = time.time()
    samples = data.calibration_windows(calib, job.tokenizer, num_samples + SCORE_SAMPLES, 512)
    log(f"[prune] importance of layers, heads, neurons and channels on {num_samples} windows of '{calib}'")
    scores = prune.importance(teacher, samples[:num_samples], progress=progress)
    searched = {}
    for name, s in found.items():
        searched[name] = _candidate(job, name, s, scores, samples[num_samples:], search if searching else None, windows)
        after = (
            f", {searched[name]['ppl_after_search']:.2f} after {search.train_tokens} tokens"
            if ("ppl_after_search" in searched[name])
            else ""
        )
        log(
            f"[prune] candidate {name:12s} {s}: {searched[name]['parameters'] / total:.1%} of the parameters, "
            f"perplexity {searched[name]['ppl']:.2f}{after} on {SCORE_SAMPLES} held-out '{calib}' windows"
        )
    if found:
        key = "ppl_after_search" if searching else "ppl"
        candidate = candidate or min(searched, key=lambda n: searched[n][key])
        shape = found[candidate]
    keep = prune.select(scores, teacher.config, shape)
    student = prune.prune(teacher, keep)
    params = prune.count_parameters(teacher, shape)
    log(
        f"[prune] {job.model_dir.name}: {current} -> {shape}"
        + (f" ('{candidate}')" if candidate else "")
        + f", {params:,} of {total:,} parameters ({params / total:.1%})"
    )
    if run.train_config is None:
        held_out = samples[num_samples:]
        before, after = math.exp(mean_nll(teacher, held_out)), math.exp(mean_nll(student, held_out))
        log(
            f"warning: no --distill-tokens, so the pruned model is not distilled: perplexity {after:.1f} against "
            f"the source's {before:.1f} on {SCORE_SAMPLES} held-out '{calib}' windows; distillation recovers most "
            "of it (docs/measured.md)"
        )
    meta = {
        "method": "prune",
        "arguments": {
            "target_params": target,
            "candidate": candidate,
            "from": asdict(current),
            "to": asdict(shape),
            "calib": calib,
            "num_samples": num_samples,
            "search_tokens": search.train_tokens if search else 0,
        },
        "parameters": {"before": total, "after": params},
        "candidates": searched,
        "removed": _removed(keep, teacher.config, scores),
        "prune_seconds": round(time.time() - start, 2),
    }
    return _finish(job, student, meta, run, "prune")
