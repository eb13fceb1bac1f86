"""The jobs that change a model's shape and then distill it back: gqa (fewer KV heads) and prune."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Annotated

from slimlm import assets
from slimlm.errors import FieldError
from slimlm.jobs.options import DTYPE_CHOICE, Job, Opt, finite_float, nonnegative_int, positive_int, seed_int


class Training(Job):
    """The distillation settings `gqa` and `prune` share, and their output."""

    train_data: Annotated[str, Opt("training text: owt | wiki | c4 | PATH.txt | PATH.jsonl")] = "owt"
    eval_data: Annotated[str, Opt("text whose first 8192 tokens score the curve")] = "wiki"
    train: Annotated[str, Opt("parameter-name parts to train, e.g. k_proj,v_proj (default: all)")] = ""
    lr: Annotated[float, Opt(parse=finite_float)] = 1e-4
    seq_len: Annotated[int, Opt(parse=positive_int)] = 512
    global_batch: Annotated[int, Opt("windows per optimizer step", parse=positive_int)] = 8
    micro_batch: Annotated[int, Opt("windows per forward pass", parse=positive_int)] = 2
    temperature: Annotated[float, Opt("distillation temperature", parse=finite_float)] = 1.0
    lm_weight: Annotated[float, Opt("weight of the language-model loss (0..1)", parse=finite_float)] = 0.0
    warmup: Annotated[float, Opt("warmup, a fraction of the steps", parse=finite_float)] = 0.05
    checkpoint_every: Annotated[int, Opt("steps between resumable checkpoints", parse=positive_int)] = 25
    eval_every: Annotated[int, Opt("steps between evaluations", parse=positive_int)] = 25
    seed: Annotated[int, Opt(parse=seed_int)] = 0
    compute_dtype: Annotated[
        str,
        Opt(
            "dtype of the passes (weights and optimizer stay fp32); auto: bf16 autocast where bf16 products are "
            "fast, else fp32",
            choices=DTYPE_CHOICE,
        ),
    ] = "auto"
    out: Annotated[Path, Opt("output checkpoint directory", output="dir")]
    overwrite: Annotated[bool, Opt("replace --out if it exists")] = False

    def train_config(self, tokens: int):
        """The distillation settings, or None for a budget of 0 tokens."""
        from slimlm.train.distill import TrainConfig

        for field, ok, rule in (
            ("lm_weight", 0 <= self.lm_weight <= 1, "in [0, 1]"),
            ("temperature", self.temperature > 0, "> 0"),
            ("warmup", 0 <= self.warmup < 1, "in [0, 1)"),
            # past 1 AdamW moves each weight by ~lr a step: the model is gone, or fp32 overflows (1e39)
            ("lr", 0 < self.lr <= 1, "in (0, 1]"),
        ):
            if not ok:  # even without training: a wrong value is wrong in a recipe that adds tokens later
                raise FieldError(field, f"must be {rule}, got {getattr(self, field)}")
        if not tokens:
            return None
        return TrainConfig(
            train_tokens=tokens,
            seq_len=self.seq_len,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            lr=self.lr,
            warmup=self.warmup,
            temperature=self.temperature,
            lm_weight=self.lm_weight,
            train=tuple(t for t in self.train.split(",") if t),
            checkpoint_every=self.checkpoint_every,
            eval_every=self.eval_every,
            seed=self.seed,
            compute_dtype=self.compute_dtype,
        )

    def run_config(self, tokens: int):
        """The source, output and distillation of `tokens` (0: none) as the training job takes them."""
        from slimlm.train.job import Run

        return Run(self.model, self.out, self.train_config(tokens), self.train_data, self.eval_data, self.overwrite)


def _say_checkpoint(out: Path) -> Path:
    if os.environ.get("RANK", "0") == "0":  # under torchrun / accelerate launch, one process says it
        print(f"checkpoint: {out}")
    return out


FLOAT_MODEL = Opt("asset name, local float HF directory or hub id")


class GQA(Training):
    command = "gqa"
    help = "MHA->GQA (or fewer KV heads): merge KV heads, then uptrain by distillation"
    model: Annotated[str, FLOAT_MODEL] = assets.DEFAULT_MODEL
    kv_heads: Annotated[int, Opt("KV heads of the output", parse=positive_int)]
    expand: Annotated[bool, Opt("repeat KV heads up to --kv-heads (exact; no training)")] = False
    grouping: Annotated[
        str,
        Opt(
            "which heads merge: the most similar on --calib data (default), or contiguous ones",
            choices=("similarity", "mean"),
        ),
    ] = "similarity"
    calib: Annotated[str, Opt("text for --grouping similarity")] = "owt"
    num_samples: Annotated[int, Opt("calibration windows for the grouping", parse=positive_int)] = 16
    uptrain_tokens: Annotated[int, Opt("distillation budget (0: none)", parse=nonnegative_int)] = 0

    def check(self) -> None:
        from slimlm.train.job import check_gqa

        check_gqa(self.run_config(self.uptrain_tokens), self.kv_heads, self.expand, self.grouping, self.calib)

    def execute(self) -> Path:
        from slimlm.train.job import convert_gqa

        out = convert_gqa(
            self.run_config(self.uptrain_tokens),
            self.kv_heads,
            self.expand,
            self.grouping,
            self.calib,
            self.num_samples,
        )
        return _say_checkpoint(out)


class Prune(Training):
    command = "prune"
    help = "structured pruning (layers, heads, MLP neurons, hidden channels), then distillation from the original"
    model: Annotated[str, FLOAT_MODEL] = assets.DEFAULT_MODEL
    target_params: Annotated[
        float | None,
        Opt(
            "fraction of the parameters to keep, e.g. 0.6: searches width and depth candidates and keeps the best "
            "before distillation",
            parse=finite_float,
        ),
    ] = None
    candidate: Annotated[
        str | None,
        Opt(
            "with --target-params: take this candidate (depth, width-mlp, width, width-heads, width+depth) instead "
            "of the best one"
        ),
    ] = None
    hidden: Annotated[int | None, Opt("hidden channels to keep", parse=positive_int)] = None
    heads: Annotated[int | None, Opt("attention heads to keep (the KV grouping must allow it)", parse=positive_int)] = (
        None
    )
    ffn: Annotated[int | None, Opt("MLP neurons to keep per layer", parse=positive_int)] = None
    layers: Annotated[int | None, Opt("decoder layers to keep", parse=positive_int)] = None
    calib: Annotated[str, Opt("text the importance is measured on")] = "owt"
    num_samples: Annotated[int, Opt("512-token calibration windows", parse=positive_int)] = 32
    distill_tokens: Annotated[int, Opt("distillation budget (0: none)", parse=nonnegative_int)] = 0
    search_tokens: Annotated[
        int,
        Opt(
            "with --target-params: distill every candidate this long and keep the best then (0: the best right after "
            "pruning)",
            parse=nonnegative_int,
        ),
    ] = 0

    def sizes(self) -> dict[str, int | None]:
        return {"hidden": self.hidden, "heads": self.heads, "ffn": self.ffn, "layers": self.layers}

    def check(self) -> None:
        from slimlm.train.job import check_prune

        self.train_config(self.search_tokens)
        check_prune(self.run_config(self.distill_tokens), self.target_params, self.sizes(), self.candidate, self.calib)

    def execute(self) -> Path:
        from slimlm.train.job import prune_model

        sizes = self.sizes()
        search = self.train_config(self.search_tokens)  # the candidates' short runs: the same settings, no checkpoints
        if search is not None:
            search = dataclasses.replace(search, checkpoint_every=10**9, eval_every=10**9)
        return _say_checkpoint(
            prune_model(
                self.run_config(self.distill_tokens),
                self.target_params,
                sizes,
                self.candidate,
                self.calib,
                self.num_samples,
                search,
            )
        )
