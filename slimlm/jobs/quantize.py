"""The weight and KV-cache quantization jobs: rtn, gptq, autoround, awq (then rtn, gptq or autoround), kv.

Each is the shared calibration options plus its method's own; `steps()` lists the pipeline steps it runs
(a KV-cache step ends any of them when kv_dtype is set), and `execute()` quantizes and writes the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated

from pydantic import model_validator

from slimlm import assets
from slimlm.compress.autoround import ITERS, WINDOWS
from slimlm.compress.gptq import FLOAT_TARGET
from slimlm.errors import FieldError
from slimlm.formats.quantized import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, QuantArgs
from slimlm.jobs.measure import measure_perplexity
from slimlm.jobs.options import (
    DTYPE_CHOICE,
    Job,
    Opt,
    Switch,
    integer,
    open_unit_float,
    positive_int,
    seed_int,
    unit_float,
)
from slimlm.jobs.schemes import BUDGET, BUDGET_BITS, BUDGET_WIDTHS, SIZE, SYM


class Calibration(Job):
    """What every calibrated job shares: the source, the calibration text, the output and the device."""

    model: Annotated[str, Opt("asset name, local HF directory or hub id")] = assets.DEFAULT_MODEL
    calib: Annotated[str, Opt("owt | wiki | c4 | wikitext2 | PATH.txt | PATH.jsonl")] = "owt"
    num_samples: Annotated[int, Opt("calibration windows", parse=positive_int)] = 128
    seq_len: Annotated[int, Opt("tokens per calibration window", parse=positive_int)] = 512
    seed: Annotated[int, Opt(parse=seed_int)] = 0
    batch_size: Annotated[int, Opt("calibration windows per forward", parse=positive_int)] = 8
    out: Annotated[Path, Opt("output checkpoint directory", output="dir")]
    overwrite: Annotated[bool, Opt("replace --out if it exists")] = False
    ppl: Annotated[str | None, Opt("measure perplexity on SOURCE before and after (e.g. wiki)", metavar="SOURCE")] = (
        None
    )
    ppl_tokens: Annotated[int, Opt("tokens scored by --ppl", parse=positive_int)] = 16384
    device: Annotated[str | None, Opt("cpu or cuda[:N] (default: cuda when available, else cpu)")] = None
    compute_dtype: Annotated[
        str,
        Opt(
            "dtype the calibration passes run in (the weights are quantized from their stored values); auto: bf16 "
            "for an fp32 model where bf16 products are fast, else the model's",
            choices=DTYPE_CHOICE,
        ),
    ] = "auto"

    def plan(self) -> tuple[str, list, QuantArgs | None, bool]:
        """The run's name (as slimlm.json records it), its pipeline steps, the scheme the weights are rounded to
        (None: they stay as they are) and whether each layer's output error is reported."""
        raise NotImplementedError

    def quantization(self):
        from slimlm.compress.job import CalibData, Quantization

        name, steps, args, report_error = self.plan()
        weights = isinstance(self, Weights)
        return Quantization(
            name,
            steps,
            args,
            self.model,
            self.out,
            CalibData(**{f.name: getattr(self, f.name) for f in dataclasses.fields(CalibData)}),
            ignore=self.ignore if weights else (),
            fmt=self.format if weights else "compressed-tensors",
            lm_head_bits=self.lm_head_bits(args) if weights else None,
            overwrite=self.overwrite,
            report_error=report_error,
            budget=self.budget if weights else None,
            budget_bits=tuple(self.budget_bits) if weights else (),
            size=self.size if weights else None,
        )

    def check(self) -> None:
        """What the run checks before its work, without the work: options, model, device, data (recipe --check)."""
        from slimlm import data
        from slimlm.compress.job import check_inputs

        check_inputs(self.quantization())
        if self.ppl:
            data.check_source(self.ppl)

    def execute(self) -> Path:
        return quantize(self)


class KVScales(Calibration):
    kv_dtype: Annotated[
        str | None,
        Opt("quantize the KV cache too: calibrate static scales for fp8 e4m3 or int8", choices=("fp8", "int8")),
    ] = None
    kv_strategy: Annotated[
        str | None,
        Opt(
            "one KV scale per layer (tensor; vLLM reads it) or per KV head (attn_head); default: tensor for fp8, "
            "attn_head for int8",
            choices=("tensor", "attn_head"),
        ),
    ] = None

    def kv_steps(self) -> list:
        """The KV-cache step that ends a run, when kv_dtype asks for one."""
        if self.kv_dtype is None:
            if self.kv_strategy is not None:
                raise FieldError("kv_strategy", "applies to a quantized KV cache; add {kv_dtype} fp8 or int8")
            return []
        from slimlm.compress.kv import KVCache

        return [KVCache(self.kv_dtype, self.kv_strategy or ("tensor" if self.kv_dtype == "fp8" else "attn_head"))]


class Weights(KVScales):
    """The weight quantization every method shares."""

    bits: Annotated[int, Opt("2, 3, 4 or 8", parse=integer, choices=SUPPORTED_BITS)] = 4
    group_size: Annotated[
        int | None,
        Opt(
            "-1 (per channel), 32, 64 or 128 (default: the largest that divides every layer)",
            parse=integer,
            choices=SUPPORTED_GROUP_SIZES,
            metavar="{-1,32,64,128}",
        ),
    ] = None
    sym: Annotated[bool, SYM] = True
    ignore: Annotated[list[str], Opt("linears to keep float, e.g. '*.down_proj'", nargs="*", metavar="GLOB")] = []
    quantize_lm_head: Annotated[
        int | None,
        Opt(
            "lm_head rounded to nearest at BITS (default: 8, except with --format gptq at other bits; at 4 the "
            "default model's wiki perplexity rose 26% more); a tied one is untied, the embeddings stay float",
            parse=integer,
            choices=(4, 8),
            nargs="?",
            const=8,
            metavar="BITS",
            switches=(
                Switch("--float-lm-head", 0, "keep lm_head float (it is the largest matrix a decode step reads)"),
            ),
        ),
    ] = None
    budget: Annotated[float | None, BUDGET] = None
    size: Annotated[int | None, SIZE] = None
    budget_bits: Annotated[list[int], BUDGET_WIDTHS] = list(BUDGET_BITS)
    format: Annotated[
        str,
        Opt(
            "checkpoint layout: compressed-tensors (default; vLLM, transformers) or GPTQ v1 (sym 4/8-bit)",
            choices=("compressed-tensors", "gptq"),
        ),
    ] = "compressed-tensors"

    def quant_args(self):
        from slimlm import models
        from slimlm.compress.job import default_group_size
        from slimlm.formats.quantized import QuantArgs

        group = self.group_size
        if group is None:  # execute() says which it took
            group = default_group_size(models.resolve(self.model))  # the job checks the model itself
        return QuantArgs(bits=self.bits, group_size=group, sym=self.sym)

    def lm_head_bits(self, args) -> int | None:
        """8-bit by default: on Qwen2.5-1.5B the float lm_head is more than half of the bytes a W4 decode step
        reads, and 8 bits cost the default model no measurable perplexity. GPTQ v1 holds one scheme for every
        linear, so there the default is a float lm_head unless the layers are 8-bit too."""
        if self.quantize_lm_head is None:
            return None if args is None or (self.format == "gptq" and args.bits != 8) else 8
        return self.quantize_lm_head or None


class GPTQOptions(Job):
    damp: Annotated[
        float, Opt("GPTQ dampening, a fraction of the mean Hessian diagonal, in (0, 1)", parse=open_unit_float)
    ] = 0.01
    act_order: Annotated[
        str | None,
        Opt(
            "GPTQ: quantize columns by decreasing Hessian diagonal (on by default: measured better); "
            "'weight' keeps the "
            "plain format, 'group' writes g_idx (not read by compressed-tensors >= 0.12)",
            choices=("weight", "group"),
            nargs="?",
            const="weight",
            switches=(Switch("--no-act-order", None, "GPTQ: columns left to right (the paper's original order)"),),
        ),
    ] = "weight"
    observer: Annotated[
        str,
        Opt(
            "GPTQ: how each group's scale is chosen: the group's range (minmax) or the range shrunk by up to 19% "
            "where that rounds the group with less error (mse)",
            choices=("minmax", "mse"),
        ),
    ] = "minmax"
    float_target: Annotated[
        float,
        Opt(
            "GPTQ: how far each layer is fitted to the float model's outputs on the float model's inputs rather "
            "than to its float self on the inputs the compressed layers give (GPTAQ), 0 to 1 (default "
            f"{FLOAT_TARGET}, the measured best)",
            parse=unit_float,
            metavar="ALPHA",
            switches=(Switch("--no-float-target", 0.0, "GPTQ: fit each float layer on the inputs it is given"),),
        ),
    ] = FLOAT_TARGET

    def gptq(self, args):
        from slimlm.compress import gptq

        return gptq.GPTQ(
            args, damp=self.damp, act_order=self.act_order, observer=self.observer, float_target=self.float_target
        )


class AutoRoundOptions(Job):
    iters: Annotated[
        int,
        Opt(
            f"learned rounding: signed-gradient steps per decoder layer (0: round to nearest; default {ITERS})",
            parse=integer,
        ),
    ] = ITERS
    lr: Annotated[
        float | None, Opt("learned rounding: step size, falling linearly to 0 (default 1/ITERS)", parse=open_unit_float)
    ] = None
    windows: Annotated[int, Opt("learned rounding: calibration windows in each step's loss", parse=positive_int)] = (
        WINDOWS
    )

    def autoround(self, args):
        from slimlm.compress import autoround

        return autoround.AutoRound(args, iters=self.iters, lr=self.lr, windows=self.windows, seed=self.seed)


class RTN(Weights):
    command = "rtn"
    help = "round-to-nearest weight quantization"
    report_error: Annotated[
        bool, Opt("run the calibration data through each layer to report its output error (RTN needs no data)")
    ] = False

    def plan(self) -> tuple[str, list, QuantArgs | None, bool]:
        from slimlm.compress import rtn

        args = self.quant_args()
        kv = self.kv_steps()
        return "rtn" + "+kv" * bool(kv), [rtn.RTN(args), *kv], args, self.report_error or bool(kv)


class GPTQ(GPTQOptions, Weights):
    command = "gptq"
    help = "GPTQ weight quantization (Hessian-based error compensation)"

    def plan(self) -> tuple[str, list, QuantArgs | None, bool]:
        args = self.quant_args()
        kv = self.kv_steps()
        return "gptq" + "+kv" * bool(kv), [self.gptq(args), *kv], args, True


class AutoRound(AutoRoundOptions, Weights):
    command = "autoround"
    help = "learned rounding (AutoRound): each weight's rounding and each group's range fitted to the layer's output"

    def plan(self) -> tuple[str, list, QuantArgs | None, bool]:
        args = self.quant_args()
        kv = self.kv_steps()
        return "autoround" + "+kv" * bool(kv), [self.autoround(args), *kv], args, True


class AWQ(AutoRoundOptions, GPTQOptions, Weights):
    command = "awq"
    help = "AWQ: activation-aware scales folded into the previous op, clipping search"
    sym: Annotated[
        bool,
        Opt("symmetric", flag="--sym", switches=(Switch("--asym", False, "asymmetric, with zero points (default)"),)),
    ] = False
    search_batches: Annotated[int, Opt("calibration batches used by the scale search", parse=integer)] = 2
    grid: Annotated[int, Opt("scale exponents tried per group of linears (α = i/grid)", parse=integer)] = 20
    clip: Annotated[bool, Opt(flag=None, switches=(Switch("--no-clip", False, "skip the weight-clipping search"),))] = (
        True
    )
    search_dtype: Annotated[
        str,
        Opt(
            "dtype the scale search runs the blocks in; auto: bf16 for an fp32 model where bf16 products are fast "
            "(AVX-512 BF16/AMX CPUs, GPUs), else the model's",
            choices=DTYPE_CHOICE,
        ),
    ] = "auto"
    then: Annotated[
        str,
        Opt(
            "how the AWQ-scaled weights are quantized: rtn (AWQ's own, default), gptq or autoround",
            choices=("rtn", "gptq", "autoround"),
        ),
    ] = "rtn"

    @model_validator(mode="after")
    def _options_need_their_then(self) -> AWQ:
        """A GPTQ or learned-rounding option another --then would ignore is refused, so that what runs is what
        was asked."""
        for then, kind, options in (
            ("gptq", "a GPTQ", GPTQOptions),
            ("autoround", "a learned-rounding", AutoRoundOptions),
        ):
            given = [name for name in options.model_fields if name in self.model_fields_set]
            if self.then != then and given:
                raise FieldError(given[0], f"is {kind} option; AWQ runs it only with {{then}} {then} (default: rtn)")
        return self

    def plan(self) -> tuple[str, list, QuantArgs | None, bool]:
        from slimlm.compress import awq, rtn

        args = self.quant_args()
        quantizer = {"gptq": self.gptq, "autoround": self.autoround, "rtn": rtn.RTN}[self.then](args)
        name = ("awq" if self.then == "rtn" else f"awq+{self.then}") + "+kv" * (self.kv_dtype is not None)
        search = awq.AWQ(
            args, search_batches=self.search_batches, clip=self.clip, grid=self.grid, search_dtype=self.search_dtype
        )
        return name, [search, quantizer, *self.kv_steps()], args, True


class KV(KVScales):
    command = "kv"
    help = "KV-cache quantization: static fp8/int8 K and V scales calibrated on data"
    model: Annotated[str, Opt("asset name, local directory (float or compressed-tensors) or hub id", positional=True)]
    kv_dtype: Annotated[
        str, Opt("KV-cache dtype the scales are calibrated for: fp8 (e4m3) or int8", choices=("fp8", "int8"))
    ]

    def plan(self) -> tuple[str, list, QuantArgs | None, bool]:
        return "kv", self.kv_steps(), None, False  # the weights do not change


def quantize(job: Calibration) -> Path:
    """Run the job's steps into job.out; with job.ppl, measure the source and the result and print the change."""
    from slimlm import data
    from slimlm.compress.job import quantize_weights

    run = job.quantization()
    name, steps, args = run.method, run.steps, run.args
    if args is not None and job.group_size is None:
        print(
            f"--group-size not given: using {args.group_size}, the largest of 128, 64, 32 that divides every "
            "layer's input dim",
            file=sys.stderr,
        )
    out = quantize_weights(run, checks=[lambda: data.check_source(job.ppl)] if job.ppl else [])
    if not job.ppl:
        print(f"checkpoint: {out}")
        return out
    base = measure_perplexity(job.model, job.ppl, job.seq_len, job.ppl_tokens, device=job.device)
    quant = measure_perplexity(str(out), job.ppl, job.seq_len, job.ppl_tokens, device=job.device)
    (out / "eval.json").write_text(json.dumps({"baseline": base, "quantized": quant}, indent=2) + "\n")
    label = "" if args is None else f"{name} w{args.bits} g{args.group_size} {'sym' if args.sym else 'asym'} "
    if job.kv_dtype:
        label += f"kv {job.kv_dtype} {steps[-1].strategy}"
    rise = quant["perplexity"] / base["perplexity"] - 1
    shrink = base["size_bytes"] / quant["size_bytes"]
    print(f"\n{'':24}{'ppl (' + job.ppl + ')':>14}{'size':>14}")
    print(f"{'baseline':24}{base['perplexity']:>14.3f}{base['size_bytes'] / 1e6:>11.1f} MB")
    print(f"{label:24}{quant['perplexity']:>14.3f}{quant['size_bytes'] / 1e6:>11.1f} MB")
    print(f"{'change':24}{rise:>+13.1%} {1 / shrink:>10.3f}× ({shrink:.2f}× smaller)")
    print(f"({quant['tokens_scored']} tokens scored in windows of {job.seq_len})")
    print(f"checkpoint: {out}")
    return out
