"""The `compress` command."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from slimlm import assets
from slimlm.cache import cache_dir
from slimlm.errors import SlimlmError
from slimlm.formats import atomic
from slimlm.formats.quantized import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES


def _add_calibration(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    if positional_model:
        p.add_argument("model", help="asset name, local directory (float or compressed-tensors) or hub id")
    else:
        p.add_argument("--model", default=assets.DEFAULT_MODEL, help="asset name, local HF directory or hub id")
    p.add_argument("--calib", default="owt", help="owt | wiki | c4 | wikitext2 | PATH.txt | PATH.jsonl")
    p.add_argument("--num-samples", type=positive_int, default=128, help="calibration windows")
    p.add_argument("--seq-len", type=positive_int, default=512, help="tokens per calibration window")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--batch-size", type=positive_int, default=8, help="calibration windows per forward")
    p.add_argument("--out", required=True, type=Path, help="output checkpoint directory")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--ppl", metavar="SOURCE", help="measure perplexity on SOURCE before and after (e.g. wiki)")
    p.add_argument("--ppl-tokens", type=positive_int, default=16384, help="tokens scored by --ppl")
    _add_device(p)
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="dtype the calibration passes run in (the weights are quantized from their stored "
                   "values); auto: bf16 for an fp32 model where bf16 products are fast, else the model's")  # fmt: skip


def _add_file_overwrite(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help="replace the output file if it exists")


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available, else cpu)")


def _add_weight_args(p: argparse.ArgumentParser, sym: bool = True) -> None:
    p.add_argument("--bits", type=int, default=4, choices=SUPPORTED_BITS, help="2, 3, 4 or 8")
    p.add_argument("--group-size", type=int, choices=SUPPORTED_GROUP_SIZES, metavar="{-1,32,64,128}",
                   help="-1 (per channel), 32, 64 or 128 (default: the largest that divides every layer)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--sym", dest="sym", action="store_true", default=sym, help="symmetric" + " (default)" * sym)
    g.add_argument(
        "--asym", dest="sym", action="store_false", help="asymmetric, with zero points" + " (default)" * (not sym)
    )
    p.add_argument("--ignore", nargs="*", default=[], metavar="GLOB", help="linears to keep float, e.g. '*.down_proj'")
    head = p.add_mutually_exclusive_group()
    head.add_argument("--quantize-lm-head", nargs="?", type=int, const=8, choices=[4, 8], metavar="BITS",
                      help="lm_head rounded to nearest at BITS (default: 8, except with --format gptq at other "
                      "bits; at 4 the default model's wiki perplexity rose 26%% more); a tied one is untied, the "
                      "embeddings stay float")  # fmt: skip
    head.add_argument("--float-lm-head", dest="quantize_lm_head", action="store_const", const=0,
                      help="keep lm_head float (it is the largest matrix a decode step reads)")
    p.add_argument(
        "--format", default="compressed-tensors", choices=["compressed-tensors", "gptq"],
        help="checkpoint layout: compressed-tensors (default; vLLM, transformers) or GPTQ v1 (sym 4/8-bit)",
    )  # fmt: skip
    _add_kv_args(p, required=False)


def _add_kv_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--kv-dtype", choices=["fp8", "int8"], required=required,
                   help="quantize the KV cache too: calibrate static scales for fp8 e4m3 or int8" * (not required)
                   or "KV-cache dtype the scales are calibrated for: fp8 (e4m3) or int8")  # fmt: skip
    p.add_argument("--kv-strategy", choices=["tensor", "attn_head"],
                   help="one KV scale per layer (tensor; vLLM reads it) or per KV head (attn_head); "
                   "default: tensor for fp8, attn_head for int8")  # fmt: skip


def _add_train_args(p: argparse.ArgumentParser) -> None:
    """The distillation settings `gqa` and `prune` share, and their output."""
    p.add_argument("--train-data", default="owt", help="training text: owt | wiki | c4 | PATH.txt | PATH.jsonl")
    p.add_argument("--eval-data", default="wiki", help="text whose first 8192 tokens score the curve")
    p.add_argument("--train", default="", help="parameter-name parts to train, e.g. k_proj,v_proj (default: all)")
    p.add_argument("--lr", type=finite_float, default=1e-4)
    p.add_argument("--seq-len", type=positive_int, default=512)
    p.add_argument("--global-batch", type=positive_int, default=8, help="windows per optimizer step")
    p.add_argument("--micro-batch", type=positive_int, default=2, help="windows per forward pass")
    p.add_argument("--temperature", type=finite_float, default=1.0, help="distillation temperature")
    p.add_argument("--lm-weight", type=finite_float, default=0.0, help="weight of the language-model loss (0..1)")
    p.add_argument("--warmup", type=finite_float, default=0.05, help="warmup, a fraction of the steps")
    p.add_argument("--checkpoint-every", type=positive_int, default=25, help="steps between resumable checkpoints")
    p.add_argument("--eval-every", type=positive_int, default=25, help="steps between evaluations")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--out", required=True, type=Path, help="output checkpoint directory")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def _add_kv_cache_dtype(p: argparse.ArgumentParser) -> None:
    from slimlm.formats.kv_cache import CACHE_DTYPES

    p.add_argument("--kv-cache-dtype", default="auto", choices=CACHE_DTYPES,
                   help="KV cache storage: auto = the checkpoint's kv_cache_scheme, else --dtype")  # fmt: skip


def _add_gptq_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--damp", type=finite_float, default=0.01,
                   help="GPTQ dampening, a fraction of the mean Hessian diagonal")
    p.add_argument(
        "--act-order", nargs="?", const="weight", default="weight", choices=["weight", "group"],
        help="GPTQ: quantize columns by decreasing Hessian diagonal (on by default: measured better); 'weight' keeps "
        "the plain format, 'group' writes g_idx (not read by compressed-tensors >= 0.12)",
    )  # fmt: skip
    p.add_argument("--no-act-order", dest="act_order", action="store_const", const=None,
                   help="GPTQ: columns left to right (the paper's original order)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compress", description="Compress, measure and serve LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("assets", help="list or fetch the bundled models and texts")
    p.add_argument("action", choices=["list", "fetch"])
    p.add_argument("names", nargs="*", help="assets to fetch (default: all but the large on-demand models)")
    p.add_argument("--force", action="store_true", help="fetch and rebuild even if cached and intact")

    p = sub.add_parser("rtn", help="round-to-nearest weight quantization")
    _add_calibration(p)
    _add_weight_args(p)
    p.add_argument("--report-error", action="store_true",
                   help="run the calibration data through each layer to report its output error (RTN needs no data)")

    p = sub.add_parser("gptq", help="GPTQ weight quantization (Hessian-based error compensation)")
    _add_calibration(p)
    _add_weight_args(p)
    _add_gptq_args(p)

    p = sub.add_parser("awq", help="AWQ: activation-aware scales folded into the previous op, clipping search")
    _add_calibration(p)
    _add_weight_args(p, sym=False)
    p.add_argument("--search-batches", type=int, default=2, help="calibration batches used by the scale search")
    p.add_argument("--grid", type=int, default=20, help="scale exponents tried per group of linears (α = i/grid)")
    p.add_argument("--no-clip", dest="clip", action="store_false", help="skip the weight-clipping search")
    p.add_argument("--search-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="dtype the scale search runs the blocks in; auto: bf16 for an fp32 model where bf16 "
                   "products are fast (AVX-512 BF16/AMX CPUs, GPUs), else the model's")  # fmt: skip
    p.add_argument("--then", choices=["rtn", "gptq"], default="rtn",
                   help="how the AWQ-scaled weights are quantized: rtn (AWQ's own, default) or gptq")
    _add_gptq_args(p)

    p = sub.add_parser("kv", help="KV-cache quantization: static fp8/int8 K and V scales calibrated on data")
    _add_calibration(p, positional_model=True)
    _add_kv_args(p, required=True)

    p = sub.add_parser("gqa", help="MHA->GQA (or fewer KV heads): merge KV heads, then uptrain by distillation")
    p.add_argument("--model", default=assets.DEFAULT_MODEL, help="asset name, local float HF directory or hub id")
    p.add_argument("--kv-heads", type=positive_int, required=True, help="KV heads of the output")
    p.add_argument("--expand", action="store_true", help="repeat KV heads up to --kv-heads (exact; no training)")
    p.add_argument("--grouping", choices=["similarity", "mean"], default="similarity",
                   help="which heads merge: the most similar on --calib data (default), or contiguous ones")
    p.add_argument("--calib", default="owt", help="text for --grouping similarity")
    p.add_argument("--num-samples", type=positive_int, default=16, help="calibration windows for the grouping")
    p.add_argument("--uptrain-tokens", type=nonnegative_int, default=0, help="distillation budget (0: none)")
    _add_train_args(p)

    p = sub.add_parser("prune", help="structured pruning (layers, heads, MLP neurons, hidden channels), then "
                       "distillation from the original")  # fmt: skip
    p.add_argument("--model", default=assets.DEFAULT_MODEL, help="asset name, local float HF directory or hub id")
    p.add_argument("--target-params", type=finite_float, help="fraction of the parameters to keep, e.g. 0.6: "
                   "searches width and depth candidates and keeps the best before distillation")  # fmt: skip
    p.add_argument("--candidate", help="with --target-params: take this candidate (depth, width-mlp, width, "
                   "width-heads, width+depth) instead of the best one")  # fmt: skip
    p.add_argument("--hidden", type=positive_int, help="hidden channels to keep")
    p.add_argument("--heads", type=positive_int, help="attention heads to keep (the KV grouping must allow it)")
    p.add_argument("--ffn", type=positive_int, help="MLP neurons to keep per layer")
    p.add_argument("--layers", type=positive_int, help="decoder layers to keep")
    p.add_argument("--calib", default="owt", help="text the importance is measured on")
    p.add_argument("--num-samples", type=positive_int, default=32, help="512-token calibration windows")
    p.add_argument("--distill-tokens", type=nonnegative_int, default=0, help="distillation budget (0: none)")
    p.add_argument("--search-tokens", type=nonnegative_int, default=0, help="with --target-params: distill "
                   "every candidate this long and keep the best then (0: the best right after pruning)")  # fmt: skip
    _add_train_args(p)

    p = sub.add_parser("bench", help="speed and memory against the baseline in the same run: prefill, decode "
                       "vs the bandwidth floor, a Poisson workload's throughput, TTFT, ITL, goodput")  # fmt: skip
    p.add_argument("model", help="checkpoint directory, asset name or hub id")
    p.add_argument("--baseline", help="model measured beside it (default: the source in its slimlm.json; "
                   "'none': no baseline)")  # fmt: skip
    p.add_argument("--batch", type=int_list, default="1,8,32,64", help="decode batch sizes")
    p.add_argument("--context", type=positive_int, default=512, help="KV tokens per sequence in the decode steps")
    p.add_argument("--prefill-len", type=positive_int, default=512)
    p.add_argument("--rounds", type=positive_int, default=3, help="measurements of each model, in turn (offline: "
                   "each figure's median; online: the run of median throughput)")  # fmt: skip
    p.add_argument("--requests", type=positive_int, default=24, help="Poisson workload: requests")
    p.add_argument("--rate", type=positive_float, default=2.0,
                   help="Poisson workload: arrivals per second (inf: all at once)")
    p.add_argument("--prompt-len", type=span, default="64,256",
                   help="Poisson workload: prompt lengths, uniform in LO,HI")
    p.add_argument("--output-len", type=span, default="16,64",
                   help="Poisson workload: output lengths, uniform in LO,HI")
    p.add_argument("--slo-ttft", type=positive_float, default=2.0,
                   help="goodput: time to first token at most, seconds")
    p.add_argument("--slo-itl", type=positive_float, default=0.2,
                   help="goodput: mean inter-token latency at most, seconds")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-memory", type=parse_size, help="KV block pool size (default: what the largest batch "
                   "needs at --context, at least 512M)")  # fmt: skip
    p.add_argument("--http", action="store_true", help="also send the workload to compress serve over HTTP")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--json", type=Path, help="write the results as JSON")
    _add_file_overwrite(p)

    p = sub.add_parser("recipe", help="run a YAML recipe: compression stages, then eval, bench and the report "
                       "(stages already done are skipped)")  # fmt: skip
    p.add_argument("recipe", type=Path, help="e.g. recipes/default.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field, e.g. --set eval.limit=10 (repeatable)")  # fmt: skip
    p.add_argument("--check", action="store_true", help="validate the recipe and stop")

    p = sub.add_parser("report", help="one HTML page from run directories: quality vs speed vs memory, Pareto "
                       "plots, per-method table, bandwidth model vs measured")  # fmt: skip
    p.add_argument("runs", nargs="+", type=Path, help="run directories (eval.json, bench.json, run.json)")
    p.add_argument("--out", type=Path, default=Path("report.html"))
    _add_file_overwrite(p)
    p.add_argument("--baseline", help="the run quality is compared with (default: the first)")
    p.add_argument("--title", default="slimlm tradeoff report")

    p = sub.add_parser("plan", help="capacity and bandwidth model: weight and KV bytes, what fits, the "
                       "bandwidth-bound decode step and throughput, arithmetic intensity vs the roofline")  # fmt: skip
    p.add_argument("model", help="asset name, local directory, hub id, or a preset: llama-3.1-8b, "
                   "llama-3.1-70b, mistral-7b, qwen2.5-7b")  # fmt: skip
    p.add_argument("--weights", type=weight_format, default="bf16",
                   help="bf16 | fp16 | fp32 | wBITS[gGROUP][-asym], e.g. w4g128")
    p.add_argument("--kv-dtype", default="bf16", choices=["fp32", "bf16", "fp16", "fp8", "int8", "int4"])
    p.add_argument("--context", type=positive_int, default=2048, help="tokens per sequence")
    p.add_argument("--batch", type=int_list, default="1,8,32,64", help="comma-separated batch sizes")
    p.add_argument("--kv-heads", type=int_list, help="comma-separated KV-head counts to compare (default: the model's)")
    p.add_argument("--device", default="h100", help="h100 | h200 | a100 | cpu (this machine, probed now)")
    p.add_argument("--memory", type=parse_size, help="memory budget (default: the device's)")
    p.add_argument("--bench", type=Path, help="a compress bench JSON of MODEL: the model's decode steps, "
                   "predicted at its measured bandwidth, against the measured ones")  # fmt: skip
    p.add_argument("--json", type=Path, help="also write the plan as JSON")
    _add_file_overwrite(p)

    p = sub.add_parser("eval", help="lm-eval tasks and perplexity of a model or checkpoint, through the runtime")
    p.add_argument("model", help="asset name, local directory or hub id")
    p.add_argument("--tasks", type=task_list, help="comma-separated lm-eval tasks; bundled: slimlm_tasks (all), "
                   "slimlm_hellaswag, slimlm_piqa, ... (default: none; --ppl wiki alone)")  # fmt: skip
    p.add_argument("--limit", type=limit_arg, help="documents per task: a count, or a fraction in (0, 1)")
    p.add_argument("--num-fewshot", type=nonnegative_int, help="few-shot examples (default: each task's own)")
    p.add_argument("--batch-size", type=positive_int, help="sequences per engine step (default 128)")
    p.add_argument("--ppl", metavar="SOURCE", help="perplexity text (default: wiki when no --tasks)")
    p.add_argument("--seq-len", type=window_int, default=512, help="--ppl window length")
    p.add_argument("--max-tokens", type=positive_int, default=16384, help="--ppl tokens taken from the source")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-memory", type=parse_size, default="512M", help="KV block pool size (e.g. 512M, 2G)")
    _add_kv_cache_dtype(p)
    p.add_argument("--output", type=Path, help="write the results as JSON here")
    _add_file_overwrite(p)
    _add_device(p)

    p = sub.add_parser("lm-eval", help="lm-eval's own command line with the slimlm model and task pack registered",
                       add_help=False)  # fmt: skip
    p.add_argument("args", nargs=argparse.REMAINDER, help="lm-eval arguments, e.g. --model slimlm --model_args "
                   "pretrained=DIR --tasks slimlm_tasks")  # fmt: skip

    p = sub.add_parser("generate", help="generate text with the bundled runtime (float or quantized checkpoint)")
    p.add_argument("model", help="asset name, local directory or hub id")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=finite_float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=seed_int)
    p.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    _add_engine_args(p)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    p.add_argument("model", help="asset name, local directory or hub id")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SLIMLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SLIMLM_API_KEY, else none)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the model argument)")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences in the running batch")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=512, help="tokens per engine step")
    p.add_argument("--max-waiting", type=positive_int, default=256,
                   help="queued requests beyond which new ones get 503 with Retry-After")
    p.add_argument("--drain-timeout", type=finite_float, default=30.0,
                   help="seconds SIGTERM waits for running requests before exiting")  # fmt: skip
    _add_engine_args(p)
    return parser


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The runtime's options, the same for generate and serve."""
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-memory", type=parse_size, default="512M", help="KV block pool size (e.g. 512M, 2G)")
    p.add_argument("--max-model-len", type=positive_int,
                   help="context length (default: the model's, or what the KV cache pool holds if that is less)")
    _add_kv_cache_dtype(p)
    p.add_argument("--speculative", metavar="ngram|DRAFT", help="speculative decoding: ngram (prompt lookup) or "
                   "a draft model with the same tokenizer (asset, directory or hub id)")  # fmt: skip
    p.add_argument("--num-speculative-tokens", type=positive_int, default=4, help="drafted tokens per target pass")
    _add_device(p)


def _engine_config(a: argparse.Namespace) -> dict:
    return dict(dtype=a.dtype, kv_cache_memory=a.kv_cache_memory, device=a.device, kv_cache_dtype=a.kv_cache_dtype,
                max_model_len=a.max_model_len, speculative=a.speculative,
                num_speculative_tokens=a.num_speculative_tokens)  # fmt: skip


def _int_arg(text: str, ok, requirement: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"'{text}' {requirement}")
    return value


def positive_int(text: str) -> int:
    return _int_arg(text, lambda v: v > 0, "must be a positive integer")


def nonnegative_int(text: str) -> int:
    return _int_arg(text, lambda v: v >= 0, "must be 0 or a positive integer")


def limit_arg(text: str) -> int | float:
    """lm-eval's --limit: a document count (>= 1) or a fraction of each task in (0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if 1 <= value <= 1e9 and value == int(value):  # a count past any task's size: still a count, not 1e30
        return int(value)
    if 0 < value < 1:
        return value
    raise argparse.ArgumentTypeError(f"'{text}' must be a document count from 1 to 1e9 or a fraction in (0, 1)")


def _float_arg(text: str, ok, requirement: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"'{text}' {requirement}")
    return value


def finite_float(text: str) -> float:
    return _float_arg(text, math.isfinite, "must be a finite number")


def positive_float(text: str) -> float:
    return _float_arg(text, lambda v: v > 0, "must be positive")  # nan is not


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': give positive integers separated by commas, e.g. 1,8,32")
    return values


def span(text: str) -> tuple[int, int]:
    values = int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"'{text}': give LO,HI with LO <= HI, e.g. 64,256")
    return values[0], values[1]


def weight_format(text: str):
    from slimlm.eval import plan

    try:
        return plan.WeightFormat.parse(text)
    except SlimlmError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def task_list(text: str) -> list[str]:
    """lm-eval task names, checked against the bundled pack (and lm-eval's index when one is not in it)."""
    from slimlm.eval import harness

    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise argparse.ArgumentTypeError("is empty; name tasks, e.g. --tasks slimlm_hellaswag,slimlm_piqa")
    try:
        harness.check_tasks(tasks)
    except SlimlmError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return tasks


def window_int(text: str) -> int:
    return _int_arg(text, lambda v: v >= 2, "must be at least 2: a window needs at least 2 tokens (one to predict)")


def seed_int(text: str) -> int:
    return _int_arg(text, lambda v: 0 <= v < 2**63, "must be in [0, 2^63)")


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GB' or a byte count -> bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        size = int(float(number) * units[unit])
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"'{text}' is not a size; write e.g. 512M or 2G") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' must be a positive size")
    return size


def cmd_assets(a: argparse.Namespace) -> None:
    if a.action == "list":
        for name, asset in assets.ASSETS.items():
            package = f"{asset.package.format(i='1..' + str(asset.parts))}" if asset.parts else asset.package
            print(f"{name:18} {asset.kind:6} {assets.state(name):12} {package:34} {asset.description}")
        print(f"cache: {cache_dir()}")
        return
    for name in a.names or [n for n, asset in assets.ASSETS.items() if not asset.on_demand]:
        print(assets.fetch(name, force=a.force, verify=True))


def _measure(spec: str, source: str, seq_len: int, max_tokens: int, device: str | None,
             kv_cache_dtype: str = "auto") -> dict:  # fmt: skip
    from slimlm.eval.perplexity import engine_for, perplexity
    from slimlm.formats import shards

    engine = engine_for(spec, seq_len, device=device, kv_cache_dtype=kv_cache_dtype)
    result = perplexity(engine, source, seq_len=seq_len, max_tokens=max_tokens)
    result["model"] = str(engine.model_dir)
    result["size_bytes"] = shards.total_size(engine.model_dir)
    return result




def cmd_bench(a: argparse.Namespace) -> None:
    from slimlm import models
    from slimlm.eval import bench

    if a.json:
        atomic.check_file(a.json, a.overwrite, "--json")
    config = bench.BenchConfig(batches=a.batch, context=a.context, prefill_len=a.prefill_len,
                               rounds=a.rounds,
                               kv_cache_memory=a.kv_cache_memory, dtype=a.dtype, requests=a.requests, rate=a.rate,
                               prompt_len=a.prompt_len, output_len=a.output_len,
                               slo_ttft_s=a.slo_ttft, slo_itl_s=a.slo_itl, seed=a.seed, http=a.http)  # fmt: skip
    model_dir = models.resolve(a.model)
    baseline = None if a.baseline == "none" else a.baseline
    if a.baseline is None and (model_dir / "slimlm.json").exists():
        baseline = bench.baseline_of(model_dir)
    result = bench.bench(a.model, baseline, config)
    print(bench.table(result))
    if a.json:
        atomic.write_file(a.json, json.dumps(result, indent=1), a.overwrite, "--json")


def cmd_recipe(a: argparse.Namespace) -> None:
    from slimlm import recipe as recipes
    from slimlm.eval import report

    recipe = recipes.load(a.recipe, a.overrides)
    if recipe.report is not None:  # before any stage runs: its own earlier report, or no file there
        atomic.check_file(recipe.report, report.written_by_slimlm(recipe.report), "--out")
    if a.check:
        steps = sum(len(s) for s in recipe.stages.values())
        print(f"{a.recipe}: {len(recipe.stages)} stages, {steps} steps: valid")
        return
    run_dirs = recipes.run(recipe)
    if recipe.report is not None:
        result = report.render(run_dirs, recipe.report, title=f"slimlm: {recipe.path.name} on {recipe.model}",
                               notes=recipe.notes, overwrite=report.written_by_slimlm(recipe.report))  # fmt: skip
        print(report.main_table(result["runs"]))
        print(f"report: {recipe.report.resolve()}")


def cmd_report(a: argparse.Namespace) -> None:
    from slimlm.eval import report

    atomic.check_file(a.out, a.overwrite, "--out")
    result = report.render(a.runs, a.out, a.baseline, a.title, overwrite=a.overwrite)
    print(report.main_table(result["runs"]))
    print(f"report: {a.out.resolve()}")


def cmd_plan(a: argparse.Namespace) -> None:
    from slimlm import models
    from slimlm.eval import plan

    if a.json:
        atomic.check_file(a.json, a.overwrite, "--json")
    if a.model in plan.MODEL_PRESETS:
        dims = plan.MODEL_PRESETS[a.model]
    else:
        config = models.read_config(models.resolve(a.model))
        models.check_architecture(config, a.model)
        dims = plan.Dims.from_config(config)
    if a.device != "cpu" and a.device not in plan.PRESETS:
        raise SlimlmError(f"--device {a.device}: use one of {', '.join(plan.PRESETS)}, or cpu")
    device = plan.probe_cpu() if a.device == "cpu" else plan.PRESETS[a.device]
    kv_heads = a.kv_heads or [dims.kv_heads]
    if bad := [k for k in kv_heads if dims.heads % k]:
        raise SlimlmError(f"--kv-heads {bad[0]} does not divide the {dims.heads} query heads")
    if a.bench:
        if a.model in plan.MODEL_PRESETS:
            raise SlimlmError(f"--bench compares a checkpoint's measured steps with its plan; give that checkpoint "
                              f"(its directory or asset name) in place of the preset {a.model}")  # fmt: skip
        try:
            rows = plan.against_bench(json.loads(a.bench.read_text()), config)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise SlimlmError(f"--bench {a.bench}: not a compress bench JSON ({type(e).__name__}: {e})") from None
        print(f"{'batch':>6} {'context':>8} {'predicted ms':>13} {'measured ms':>12} {'measured/predicted':>19}")
        for r in rows:
            print(f"{r['batch']:>6} {r['context']:>8} {r['predicted_ms']:>13.2f} {r['measured_ms']:>12.2f} "
                  f"{r['ratio']:>19.2f}")  # fmt: skip
        return
    result = plan.plan(dims, a.weights, a.kv_dtype, a.context, a.batch, kv_heads, device,
                       a.memory)  # fmt: skip
    print(plan.format_plan(result))
    if a.json:
        atomic.write_file(a.json, json.dumps(result, indent=1), a.overwrite, "--json")


def cmd_eval(a: argparse.Namespace) -> None:
    from slimlm import data

    if a.output:
        atomic.check_file(a.output, a.overwrite, "--output")
    tasks = a.tasks or []
    ppl_source = a.ppl or (None if tasks else "wiki")
    if ppl_source:
        data.check_source(ppl_source)
    results = None
    if tasks:
        from slimlm.eval import harness  # lm-eval and datasets load only when tasks are asked for

        results = harness.evaluate(a.model, tasks, limit=a.limit, num_fewshot=a.num_fewshot, batch_size=a.batch_size,
                                   dtype=a.dtype, kv_cache_memory=a.kv_cache_memory, device=a.device,
                                   kv_cache_dtype=a.kv_cache_dtype)  # fmt: skip
        print(harness.table(results))
        s = results["slimlm"]
        print(f"[{s['tokens_computed']} tokens through the runtime in {s['seconds']:.0f}s: "
              f"{s['tokens_per_second']:.0f} tokens/s]")  # fmt: skip
    ppl = None
    if ppl_source:
        ppl = _measure(a.model, ppl_source, a.seq_len, a.max_tokens, a.device, a.kv_cache_dtype)
        print(f"perplexity on {ppl_source}: {ppl['perplexity']:.3f} ({ppl['tokens_scored']} tokens, "
              f"windows of {a.seq_len}, {ppl['seconds']:.0f}s)")  # fmt: skip
    if results is not None:
        results["slimlm"]["perplexity"] = ppl
        text = harness.to_json(results)
    else:
        text = json.dumps(ppl, indent=2) + "\n"
        print(json.dumps(ppl))
    if a.output:
        atomic.write_file(a.output, text, a.overwrite, "--output")


def cmd_lm_eval(a: argparse.Namespace) -> None:
    import lm_eval.__main__

    import slimlm.eval.lm_eval_model  # noqa: F401  registers --model slimlm
    from slimlm.eval import taskpack

    args = list(a.args)
    if "--include_path" not in args:
        args += ["--include_path", str(taskpack.TASKS_DIR)]
    sys.argv = ["lm-eval", *args]
    lm_eval.__main__.cli_evaluate()


def _weight_args(a: argparse.Namespace):
    from slimlm import models
    from slimlm.compress.job import default_group_size
    from slimlm.formats.quantized import QuantArgs

    group = a.group_size
    if group is None:
        group = default_group_size(models.resolve(a.model))  # the job checks the model itself
        print(f"--group-size not given: using {group}, the largest of 128, 64, 32 that divides every layer's "
              "input dim", file=sys.stderr)  # fmt: skip
    return QuantArgs(bits=a.bits, group_size=group, sym=a.sym)


def _kv_steps(a: argparse.Namespace) -> list:
    """The KV-cache step that ends a run, when --kv-dtype asks for one."""
    if a.kv_dtype is None:
        if a.kv_strategy is not None:
            raise SlimlmError("--kv-strategy applies to a quantized KV cache; add --kv-dtype fp8 or int8")
        return []
    from slimlm.compress.kv import KVCache

    return [KVCache(a.kv_dtype, a.kv_strategy or ("tensor" if a.kv_dtype == "fp8" else "attn_head"))]


def cmd_rtn(a: argparse.Namespace) -> None:
    from slimlm.compress.rtn import RTN

    args = _weight_args(a)
    kv = _kv_steps(a)
    _quantize_and_report("rtn" + "+kv" * bool(kv), [RTN(args), *kv], args, a, report_error=a.report_error or bool(kv))


def cmd_gptq(a: argparse.Namespace) -> None:
    from slimlm.compress.gptq import GPTQ

    args = _weight_args(a)
    kv = _kv_steps(a)
    _quantize_and_report("gptq" + "+kv" * bool(kv), [GPTQ(args, damp=a.damp, act_order=a.act_order), *kv], args, a)


def cmd_kv(a: argparse.Namespace) -> None:
    a.ignore, a.format, a.quantize_lm_head = [], "compressed-tensors", None
    _quantize_and_report("kv", _kv_steps(a), None, a, report_error=False)  # the weights do not change


def cmd_awq(a: argparse.Namespace) -> None:
    from slimlm.compress.awq import AWQ
    from slimlm.compress.gptq import GPTQ
    from slimlm.compress.rtn import RTN

    args = _weight_args(a)
    quantizer = GPTQ(args, damp=a.damp, act_order=a.act_order) if a.then == "gptq" else RTN(args)
    name = ("awq" if a.then == "rtn" else f"awq+{a.then}") + "+kv" * (a.kv_dtype is not None)
    awq = AWQ(args, search_batches=a.search_batches, clip=a.clip, grid=a.grid, search_dtype=a.search_dtype)
    steps = [awq, quantizer, *_kv_steps(a)]
    _quantize_and_report(name, steps, args, a)


def _lm_head_bits(a: argparse.Namespace, args) -> int | None:
    """8-bit by default: on Qwen2.5-1.5B the float lm_head is more than half of the bytes a W4 decode step
    reads, and 8 bits cost the default model no measurable perplexity. GPTQ v1 holds one scheme for every
    linear, so there the default is a float lm_head unless the layers are 8-bit too."""
    if a.quantize_lm_head is None:
        return None if args is None or (a.format == "gptq" and args.bits != 8) else 8
    return a.quantize_lm_head or None


def _quantize_and_report(name: str, steps: list, args, a: argparse.Namespace, report_error: bool = True) -> None:
    from slimlm import data
    from slimlm.compress.job import quantize_weights

    out = quantize_weights(
        name,
        steps,
        args,
        a.model,
        a.out,
        calib=a.calib,
        num_samples=a.num_samples,
        seq_len=a.seq_len,
        seed=a.seed,
        ignore=a.ignore,
        batch_size=a.batch_size,
        overwrite=a.overwrite,
        fmt=a.format,
        lm_head_bits=_lm_head_bits(a, args),
        device=a.device,
        report_error=report_error,
        checks=[lambda: data.check_source(a.ppl)] if a.ppl else [],
        compute_dtype=a.compute_dtype,
    )
    if not a.ppl:
        print(f"checkpoint: {out}")
        return
    base = _measure(a.model, a.ppl, a.seq_len, a.ppl_tokens, a.device)
    quant = _measure(str(out), a.ppl, a.seq_len, a.ppl_tokens, a.device)
    (out / "eval.json").write_text(json.dumps({"baseline": base, "quantized": quant}, indent=2) + "\n")
    label = "" if args is None else f"{name} w{args.bits} g{args.group_size} {'sym' if args.sym else 'asym'} "
    if a.kv_dtype:
        label += f"kv {a.kv_dtype} {steps[-1].strategy}"
    rise = quant["perplexity"] / base["perplexity"] - 1
    shrink = base["size_bytes"] / quant["size_bytes"]
    print(f"\n{'':24}{'ppl (' + a.ppl + ')':>14}{'size':>14}")
    print(f"{'baseline':24}{base['perplexity']:>14.3f}{base['size_bytes'] / 1e6:>11.1f} MB")
    print(f"{label:24}{quant['perplexity']:>14.3f}{quant['size_bytes'] / 1e6:>11.1f} MB")
    print(f"{'change':24}{rise:>+13.1%} {1 / shrink:>10.3f}× ({shrink:.2f}× smaller)")
    print(f"({quant['tokens_scored']} tokens scored in windows of {a.seq_len})")
    print(f"checkpoint: {out}")


def cmd_generate(a: argparse.Namespace) -> None:
    from slimlm.runtime.llm import LLM
    from slimlm.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, stop=a.stop)  # fmt: skip
    llm = LLM(a.model, **_engine_config(a))
    streaming = a.stream and len(a.prompt) == 1  # several prompts would interleave: they print when done
    if streaming:
        shown = 0
        for out in llm.stream(a.prompt, params):
            if out.outputs:
                print(out.outputs[0].text[shown:], end="", flush=True)
                shown = len(out.outputs[0].text)
            if out.finished:
                outputs = [out]
        print(flush=True)
    else:
        outputs = llm.generate(a.prompt, params)  # in prompt order
    rejected = [f"prompt {i + 1}: {out.error}" for i, out in enumerate(outputs) if out.error]
    for out in outputs:
        if out.error:
            continue
        c = out.outputs[0]
        if not streaming:
            print(c.text)
        ttft = (c.first_token_time - out.arrival) * 1e3 if c.first_token_time else float("nan")
        rate = (len(c.token_times) - 1) / (c.token_times[-1] - c.token_times[0]) if len(c.token_times) > 1 else 0
        spec = f", {c.num_accepted}/{c.num_drafted} drafts accepted" if a.speculative else ""
        print(f"[{len(c.token_ids)} tokens, finish: {c.finish_reason}, first token {ttft:.0f} ms, "
              f"{rate:.1f} tokens/s after it{spec}]", file=sys.stderr)  # fmt: skip
    if rejected:  # the others were served; all rejections on one line
        raise SlimlmError("; ".join(rejected))


def _train_config(a: argparse.Namespace, tokens: int):
    """The distillation settings, or None for a budget of 0 tokens."""
    from slimlm.train.distill import TrainConfig

    if not tokens:
        return None
    if not 0 <= a.lm_weight <= 1 or a.temperature <= 0 or not 0 <= a.warmup < 1 or a.lr <= 0:  # finite: parsed so
        raise SlimlmError("--lm-weight must be in [0, 1], --temperature and --lr > 0, --warmup in [0, 1)")
    return TrainConfig(
        train_tokens=tokens, seq_len=a.seq_len, global_batch=a.global_batch, micro_batch=a.micro_batch, lr=a.lr,
        warmup=a.warmup, temperature=a.temperature, lm_weight=a.lm_weight,
        train=tuple(t for t in a.train.split(",") if t), checkpoint_every=a.checkpoint_every,
        eval_every=a.eval_every, seed=a.seed,
    )  # fmt: skip


def _say_checkpoint(out: Path) -> None:
    if os.environ.get("RANK", "0") == "0":  # under torchrun / accelerate launch, one process says it
        print(f"checkpoint: {out}")


def cmd_gqa(a: argparse.Namespace) -> None:
    from slimlm.train.job import convert_gqa

    _say_checkpoint(convert_gqa(a.model, a.kv_heads, a.out, a.expand, a.grouping, _train_config(a, a.uptrain_tokens),
                                a.calib, a.num_samples, a.train_data, a.eval_data, a.overwrite))  # fmt: skip


def cmd_prune(a: argparse.Namespace) -> None:
    from slimlm.train.job import prune_model

    sizes = {"hidden": a.hidden, "heads": a.heads, "ffn": a.ffn, "layers": a.layers}
    search = _train_config(a, a.search_tokens)  # the candidates' short runs: the same settings, no checkpoints
    if search is not None:
        search = dataclasses.replace(search, checkpoint_every=10**9, eval_every=10**9)
    _say_checkpoint(prune_model(a.model, a.out, a.target_params, sizes, a.candidate,
                                _train_config(a, a.distill_tokens), a.calib, a.num_samples, search, a.train_data,
                                a.eval_data, a.overwrite))  # fmt: skip


def cmd_serve(a: argparse.Namespace) -> None:
    from slimlm.runtime.engine import Engine, EngineConfig
    from slimlm.serve.app import serve

    if not 0 <= a.port < 65536:
        raise SlimlmError(f"--port {a.port} is not a TCP port (0..65535)")
    config = EngineConfig(**_engine_config(a), max_num_seqs=a.max_num_seqs,
                          max_num_batched_tokens=a.max_num_batched_tokens)  # fmt: skip
    engine = Engine(a.model, config)
    serve(engine, a.served_model_name or a.model, a.host, a.port, a.api_key, a.max_waiting, a.drain_timeout)


COMMANDS = {
    "assets": cmd_assets, "rtn": cmd_rtn, "gptq": cmd_gptq, "awq": cmd_awq, "kv": cmd_kv, "eval": cmd_eval,
    "generate": cmd_generate, "serve": cmd_serve, "gqa": cmd_gqa, "prune": cmd_prune, "plan": cmd_plan,
    "bench": cmd_bench, "report": cmd_report, "recipe": cmd_recipe, "lm-eval": cmd_lm_eval,
}  # fmt: skip


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def _interrupt(owner: int, signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C: temp dirs are removed on the way out. A child forked meanwhile (lm-eval's
    bootstrap pool) inherits the handler; there SIGTERM must end the process as usual, or the parent's
    Pool.terminate() waits forever for a child that caught it (seen: a CI run that never finished)."""
    if os.getpid() != owner:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within: SIGTERM raises KeyboardInterrupt in this process (and only in it); the handler before is put back."""
    previous = signal.signal(signal.SIGTERM, functools.partial(_interrupt, os.getpid()))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lm-eval"]:  # everything after it is lm-eval's, options included
        a = argparse.Namespace(command="lm-eval", args=argv[1:])
    else:
        a = build_parser().parse_args(argv)
    warnings.formatwarning = _one_line_warning
    with sigterm_unwinds():
        return _run(a)


def _run(a: argparse.Namespace) -> int:
    """The command, its failures as one line and an exit code."""
    try:
        COMMANDS[a.command](a)
    except SlimlmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # disk full, permissions, unreadable files: the user's to fix, said in one line
        where = f" ({e.filename})" if e.filename else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug, not a user error: still one line unless asked for the traceback
        if os.environ.get("SLIMLM_DEBUG"):
            raise
        print(
            f"error: internal error ({type(e).__name__}: {e}); rerun with SLIMLM_DEBUG=1 for details", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
