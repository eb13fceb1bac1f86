"""The jobs that measure: eval (tasks and perplexity), bench (speed and memory), plan (the bandwidth model) and
report (one HTML page over run directories)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from slimlm.errors import FieldError, SlimlmError
from slimlm.formats import atomic
from slimlm.jobs.engine import Activations, Dtype, EngineMemory
from slimlm.jobs.options import (
    Job,
    Opt,
    int_list,
    limit_arg,
    nonnegative_int,
    parse_size,
    positive_float,
    positive_int,
    quoted,
    seed_int,
    span,
    window_int,
)
from slimlm.jobs.schemes import BUDGET, BUDGET_BITS, BUDGET_WIDTHS, SIZE, SYM


def weight_format(text: str):
    from slimlm.eval import plan

    try:
        return plan.WeightFormat.parse(text)
    except SlimlmError as e:
        raise ValueError(str(e)) from None


def task_list(text: str) -> list[str]:
    """lm-eval task names, checked against the bundled pack (and lm-eval's index when one is not in it)."""
    from slimlm.eval import harness

    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise ValueError("is empty; name tasks, e.g. --tasks slimlm_hellaswag,slimlm_piqa")
    try:
        harness.check_tasks(tasks)
    except SlimlmError as e:
        raise ValueError(str(e)) from None
    return tasks


def measure_perplexity(spec: str, source: str, seq_len: int, max_tokens: int, **engine_config) -> dict:
    """Perplexity of `spec` on `source` through an engine with `engine_config` (EngineConfig's fields)."""
    from slimlm.eval.perplexity import engine_for, perplexity
    from slimlm.formats import shards

    engine = engine_for(spec, seq_len, **engine_config)
    from slimlm.eval import records

    result = perplexity(engine, source, seq_len=seq_len, max_tokens=max_tokens)
    result["model"] = str(engine.model_dir)
    result["size_bytes"] = shards.total_size(engine.model_dir)
    records.read(records.Perplexity, result, "the perplexity result")  # the shape report.py reads
    return result


OVERWRITE = Opt("replace the output file if it exists")


class Eval(EngineMemory):
    command = "eval"
    help = "lm-eval tasks and perplexity of a model or checkpoint, through the runtime"
    model: Annotated[str, Opt("asset name, local directory or hub id", positional=True)]
    tasks: Annotated[
        list[str] | None,
        Opt(
            "comma-separated lm-eval tasks; bundled: slimlm_tasks (all), slimlm_hellaswag, slimlm_piqa, ... (default: "
            "none; --ppl wiki alone)",
            parse=task_list,
        ),
    ] = None
    limit: Annotated[
        int | float | None, Opt("documents per task: a count, or a fraction in (0, 1)", parse=limit_arg)
    ] = None
    num_fewshot: Annotated[int | None, Opt("few-shot examples (default: each task's own)", parse=nonnegative_int)] = (
        None
    )
    batch_size: Annotated[int | None, Opt("sequences per engine step (default 128)", parse=positive_int)] = None
    ppl: Annotated[str | None, Opt("perplexity text (default: wiki when no --tasks)", metavar="SOURCE")] = None
    seq_len: Annotated[int, Opt("--ppl window length", parse=window_int)] = 512
    max_tokens: Annotated[int, Opt("--ppl tokens taken from the source", parse=positive_int)] = 16384
    output: Annotated[Path | None, Opt("write the results as JSON here", output="file")] = None
    overwrite: Annotated[bool, OVERWRITE] = False

    def check(self) -> None:
        """The model, the device, the perplexity text and its window, checked without running anything."""
        from slimlm import data, devices, models
        from slimlm.eval.perplexity import check_window

        config = models.check(models.resolve(self.model))
        devices.resolve_device(self.device)
        if self.ppl or not self.tasks:
            data.check_source(self.ppl or "wiki")
            check_window(self.seq_len, models.context_length(config))

    def execute(self) -> dict:
        from slimlm import data

        tasks = self.tasks or []
        ppl_source = self.ppl or (None if tasks else "wiki")
        if ppl_source:
            data.check_source(ppl_source)
        results = None
        if tasks:
            from slimlm.eval import harness  # lm-eval and datasets load only when tasks are asked for

            results = harness.evaluate(
                self.model,
                tasks,
                limit=self.limit,
                num_fewshot=self.num_fewshot,
                batch_size=self.batch_size,
                dtype=self.dtype,
                kv_cache_memory=self.kv_cache_memory,
                device=self.device,
                kv_cache_dtype=self.kv_cache_dtype,
            )
            print(harness.table(results))
            s = results["slimlm"]
            print(
                f"[{s['tokens_computed']} tokens through the runtime in {s['seconds']:.0f}s: "
                f"{s['tokens_per_second']:.0f} tokens/s]"
            )
        ppl = None
        if ppl_source:
            engine = {name: getattr(self, name) for name in EngineMemory.model_fields}  # all of the engine's
            ppl = measure_perplexity(self.model, ppl_source, self.seq_len, self.max_tokens, **engine)
            print(
                f"perplexity on {ppl_source}: {ppl['perplexity']:.3f} ({ppl['tokens_scored']} tokens, "
                f"windows of {self.seq_len}, {ppl['seconds']:.0f}s)"
            )
        if results is not None:
            results["slimlm"]["perplexity"] = ppl
            text = harness.to_json(results)
        else:
            results = ppl
            text = json.dumps(ppl, indent=2) + "\n"
            print(json.dumps(ppl))
        if self.output:
            atomic.write_file(self.output, text, self.overwrite, "output")
        return results


class Bench(Job):
    command = "bench"
    help = (
        "speed and memory against the baseline in the same run: prefill, decode vs the bandwidth floor, a "
        "Poisson workload's throughput, TTFT, ITL, goodput"
    )
    model: Annotated[str, Opt("checkpoint directory, asset name or hub id", positional=True)]
    baseline: Annotated[
        str | None, Opt("model measured beside it (default: the source in its slimlm.json; 'none': no baseline)")
    ] = None
    batch: Annotated[list[int], Opt("decode batch sizes", parse=int_list)] = [1, 8, 32, 64]
    context: Annotated[int, Opt("KV tokens per sequence in the decode steps", parse=positive_int)] = 512
    prefill_len: Annotated[int, Opt(parse=positive_int)] = 512
    rounds: Annotated[
        int,
        Opt(
            "measurements of each model, in turn (offline: each figure's median; online: the run of median throughput)",
            parse=positive_int,
        ),
    ] = 3
    requests: Annotated[int, Opt("Poisson workload: requests", parse=positive_int)] = 24
    rate: Annotated[float, Opt("Poisson workload: arrivals per second (inf: all at once)", parse=positive_float)] = 2.0
    prompt_len: Annotated[tuple[int, int], Opt("Poisson workload: prompt lengths, uniform in LO,HI", parse=span)] = (
        64,
        256,
    )
    output_len: Annotated[tuple[int, int], Opt("Poisson workload: output lengths, uniform in LO,HI", parse=span)] = (
        16,
        64,
    )
    slo_ttft: Annotated[float, Opt("goodput: time to first token at most, seconds", parse=positive_float)] = 2.0
    slo_itl: Annotated[float, Opt("goodput: mean inter-token latency at most, seconds", parse=positive_float)] = 0.2
    dtype: Dtype = "auto"
    activations: Activations = "auto"
    kv_cache_memory: Annotated[
        int | None,
        Opt("KV block pool size (default: what the largest batch needs at --context, at least 512M)", parse=parse_size),
    ] = None
    http: Annotated[bool, Opt("also send the workload to compress serve over HTTP")] = False
    seed: Annotated[int, Opt(parse=seed_int)] = 0
    json_path: Annotated[Path | None, Opt("write the results as JSON", flag="--json", output="file")] = None
    overwrite: Annotated[bool, OVERWRITE] = False

    def check(self) -> None:
        from slimlm import models

        for spec in (self.model, self.baseline):
            if spec not in (None, "none"):
                models.check(models.resolve(spec))

    def execute(self) -> dict:
        from slimlm import models
        from slimlm.perf import bench
        from slimlm.perf.config import BenchConfig, baseline_of

        shared = [f.name for f in dataclasses.fields(BenchConfig) if f.name in type(self).model_fields]
        config = BenchConfig(**{name: getattr(self, name) for name in shared})  # by name: one field, one default
        model_dir = models.resolve(self.model)
        baseline = None if self.baseline == "none" else self.baseline
        if self.baseline is None and (model_dir / "slimlm.json").exists():
            baseline = baseline_of(model_dir)
        result = bench.bench(self.model, baseline, config)
        print(bench.table(result))
        if self.json_path:
            atomic.write_file(self.json_path, json.dumps(result, indent=1), self.overwrite, "json_path")
        return result


class Plan(Job):
    command = "plan"
    help = (
        "capacity and bandwidth model: weight and KV bytes, what fits, the bandwidth-bound decode step and "
        "throughput, arithmetic intensity vs the roofline"
    )
    model: Annotated[
        str,
        Opt(
            "asset name, local directory, hub id, or a preset: llama-3.1-8b, llama-3.1-70b, mistral-7b, qwen2.5-7b",
            positional=True,
        ),
    ]
    weights: Annotated[
        Any,
        Opt(
            "bf16 | fp16 | fp32 | wBITS[gGROUP][-asym], e.g. w4g128 (default: a quantized checkpoint's own, as its "
            "files store it, else bf16; with --budget, the float dtype of the tensors besides the linears)",
            parse=weight_format,
        ),
    ] = None
    budget: Annotated[float | None, BUDGET] = None
    size: Annotated[int | None, SIZE] = None
    budget_bits: Annotated[list[int], BUDGET_WIDTHS] = list(BUDGET_BITS)
    sym: Annotated[bool, SYM] = True
    calib: Annotated[str, Opt("--budget's calibration text: owt | wiki | c4 | wikitext2 | PATH")] = "owt"
    seq_len: Annotated[int, Opt("tokens per --budget calibration window", parse=positive_int)] = 512
    seed: Annotated[int, Opt(parse=seed_int)] = 0
    kv_dtype: Annotated[str, Opt(choices=("fp32", "bf16", "fp16", "fp8", "int8", "int4"))] = "bf16"
    context: Annotated[int, Opt("tokens per sequence", parse=positive_int)] = 2048
    kv_budget: Annotated[
        int | None,
        Opt(
            "tokens a sequence keeps under a window or snapkv KV policy (default: all of its context)",
            parse=positive_int,
        ),
    ] = None
    batch: Annotated[list[int], Opt("comma-separated batch sizes", parse=int_list)] = [1, 8, 32, 64]
    kv_heads: Annotated[
        list[int] | None, Opt("comma-separated KV-head counts to compare (default: the model's)", parse=int_list)
    ] = None
    device: Annotated[str, Opt("h100 | h200 | a100 | cpu (this machine, probed now)")] = "h100"
    memory: Annotated[int | None, Opt("memory budget (default: the device's)", parse=parse_size)] = None
    bench: Annotated[
        Path | None,
        Opt(
            "a compress bench JSON of MODEL: the model's decode steps, predicted at its "
            "measured bandwidth, against the measured ones"
        ),
    ] = None
    json_path: Annotated[Path | None, Opt("also write the plan as JSON", flag="--json", output="file")] = None
    overwrite: Annotated[bool, OVERWRITE] = False

    def inputs(self) -> list[Path]:
        return [self.bench] if self.bench else []

    def _mixed(self, weights):
        """--budget / --size: the schemes `compress gptq --budget` would choose (printed layer by layer) as
        the weight format, with the bytes the runtime's kernels read when 2- or 3-bit codes are among them."""
        from slimlm import models
        from slimlm.compress import mixed_precision
        from slimlm.compress.job import CalibData, Quantization, plan_schemes
        from slimlm.eval import plan
        from slimlm.formats.quantized import QuantArgs

        if weights.bits is not None and self.weights is not None:
            raise FieldError("weights", "with --budget names the float dtype of the other tensors, e.g. bf16")
        if self.kv_heads:
            raise FieldError("kv_heads", "changes the linears' shapes; plan a --budget at the model's own")
        calibration = CalibData(calib=self.calib, seq_len=self.seq_len, seed=self.seed)
        job = Quantization(
            "plan",
            [],
            QuantArgs(4, -1, self.sym),
            self.model,
            Path(),
            calibration,
            budget=self.budget,
            budget_bits=tuple(self.budget_bits),
            size=self.size,
        )
        choice = plan_schemes(job)
        print(mixed_precision.layout_table(choice))
        served = mixed_precision.served_bytes(choice, models.empty_model(models.resolve(self.model)))
        if served != choice.bytes:
            print(
                f"the bundled runtime reads its 2- and 3-bit linears at 4 bits (docs/limits.md): {served:,} bytes "
                f"of linears a step, not {choice.bytes:,}; the table below counts the checkpoint's"
            )
        schemes = mixed_precision.mix(choice)
        top = schemes[0][0]
        counts = tuple(f"{n} {mixed_precision.scheme_name(args)}" for args, n in schemes)
        return plan.WeightFormat(weights.dtype, top.bits, top.group_size, top.sym, choice.bytes, counts)

    def execute(self) -> dict | list:
        from slimlm import models
        from slimlm.eval import plan

        mixed = self.budget is not None or self.size is not None
        if self.model in plan.MODEL_PRESETS:
            if mixed:
                raise FieldError(
                    "budget", f"measures a model's sensitivity; give a checkpoint, not the preset {self.model}"
                )
            dims, weights = plan.MODEL_PRESETS[self.model], self.weights or plan.WeightFormat()
        else:
            model_dir = models.resolve(self.model)
            config = models.read_config(model_dir)
            models.check_architecture(config, self.model)
            dims = plan.Dims.from_config(config)
            weights = self.weights or plan.weight_format_of(config, "bfloat16", model_dir)
            if mixed:
                weights = self._mixed(weights)
        if self.device != "cpu" and self.device not in plan.PRESETS:
            raise FieldError("device", f"{self.device}: use one of {', '.join(plan.PRESETS)}, or cpu")
        device = plan.probe_cpu() if self.device == "cpu" else plan.PRESETS[self.device]
        kv_heads = self.kv_heads or [dims.kv_heads]
        if bad := [k for k in kv_heads if dims.heads % k]:
            raise FieldError("kv_heads", f"{bad[0]} does not divide the {dims.heads} query heads")
        if self.bench:
            if self.model in plan.MODEL_PRESETS:
                raise FieldError(
                    "bench",
                    f"compares a checkpoint's measured steps with its plan; give that checkpoint "
                    f"(its directory or asset name) in place of the preset {self.model}",
                )
            try:
                rows = plan.against_bench(json.loads(self.bench.read_text()), config, model_dir)
            except (OSError, json.JSONDecodeError, KeyError, TypeError, IndexError, AttributeError) as e:
                problem = f"{type(e).__name__}: {e}"
                raise FieldError("bench", f"{self.bench}: not a compress bench JSON ({problem})") from None
            print(f"{'batch':>6} {'context':>8} {'predicted ms':>13} {'measured ms':>12} {'measured/predicted':>19}")
            for r in rows:
                print(
                    f"{r['batch']:>6} {r['context']:>8} {r['predicted_ms']:>13.2f} {r['measured_ms']:>12.2f} "
                    f"{r['ratio']:>19.2f}"
                )
            return rows
        if self.memory is not None:
            device = dataclasses.replace(device, memory=self.memory)
        args = (dims, weights, self.kv_dtype, self.context, self.batch, kv_heads, device, self.kv_budget)
        result = plan.plan(*args)
        print(plan.format_plan(result))
        if self.json_path:
            atomic.write_file(self.json_path, json.dumps(result, indent=1), self.overwrite, "json_path")
        return result


class Report(Job):
    command = "report"
    help = (
        "one HTML page from run directories: quality vs speed vs memory, Pareto plots, per-method table, "
        "bandwidth model vs measured"
    )
    runs: Annotated[list[Path], Opt("run directories (eval.json, bench.json, run.json)", positional=True, nargs="+")]
    out: Annotated[Path, Opt(output="file")] = Path("report.html")
    overwrite: Annotated[bool, OVERWRITE] = False
    baseline: Annotated[str | None, Opt("the run quality is compared with (default: the first)")] = None
    title: Annotated[str, Opt()] = "slimlm tradeoff report"

    def inputs(self) -> list[Path]:
        return [run / name for run in self.runs for name in ("eval.json", "bench.json", "run.json")]

    def execute(self) -> dict:
        from slimlm.eval import report

        result = report.render(self.runs, self.out, self.baseline, self.title, overwrite=self.overwrite)
        print(report.main_table(result["runs"]))
        print(f"report: {self.out.resolve()}")
        return result


ANSWER_ROOM = 32  # tokens past the longest prompt: the longest answer (nine words) and the two more generated


def long_context_tasks(text: str) -> list[str]:
    from slimlm.eval.long_context import TASKS

    tasks = [t.strip() for t in text.split(",")]
    if bad := [t for t in tasks if t not in TASKS]:
        raise ValueError(f"{bad[0]!r} is not one of {', '.join(TASKS)}")
    return tasks


def policy_list(text: str) -> list:
    """'full,window:512,snapkv:1024' -> KVPolicy objects (a budget for each but full)."""
    from slimlm.runtime.kv_policy import KVPolicy

    policies = []
    for item in text.split(","):
        kind, colon, budget = item.strip().partition(":")
        if not kind:
            raise ValueError(f"{text!r} names no policy there; give e.g. full,window:512,snapkv:1024")
        if kind == "full" and colon:
            raise ValueError(f"{item!r}: full keeps the whole history; it takes no budget")
        if kind != "full" and not budget:
            raise ValueError(f"{item!r}: give {kind} a budget, e.g. {kind}:512")
        try:
            policy = KVPolicy(kind, positive_int(budget)) if budget else KVPolicy(kind)
        except SlimlmError as e:
            raise ValueError(f"{item!r}: {e}") from None
        if policy in policies:
            raise ValueError(f"{item!r} is given twice")
        policies.append(policy)
    return policies


def length_list(text: str) -> list[int]:
    lengths = int_list(text)
    if len(set(lengths)) < len(lengths):
        raise ValueError(f"{quoted(text)} gives a length twice")
    return lengths


class LongContext(EngineMemory):
    command = "long-context"
    help = (
        "retrieval from long prompts (pass keys, copying) under each KV policy: accuracy against the KV bytes a "
        "request keeps"
    )
    model: Annotated[str, Opt("asset name, local directory or hub id", positional=True)]
    tasks: Annotated[list[str], Opt("comma-separated: passkey, multikey, copy", parse=long_context_tasks)] = [
        "passkey",
        "multikey",
        "copy",
    ]
    lengths: Annotated[list[int], Opt("comma-separated prompt lengths in tokens", parse=length_list)] = [
        1024,
        2048,
        4096,
    ]
    samples: Annotated[int, Opt("cases per task and length (depths spread evenly)", parse=positive_int)] = 4
    policies: Annotated[
        list[Any],
        Opt("comma-separated KV policies: full, window:BUDGET, snapkv:BUDGET", parse=policy_list),
        Field(default_factory=lambda: policy_list("full,window:256,window:1024,snapkv:256,snapkv:1024")),
    ]
    source: Annotated[str, Opt("filler text: a bundled text or a .txt/.jsonl file")] = "wiki"
    seed: Annotated[int, Opt(parse=seed_int)] = 0
    output: Annotated[
        Path | None, Opt("write the results as JSON here (compress report plots them)", output="file")
    ] = None
    overwrite: Annotated[bool, OVERWRITE] = False

    def execute(self) -> dict:
        import time

        from slimlm import models
        from slimlm.eval import long_context, records
        from slimlm.runtime.engine import Engine

        config = self.engine_config(max_model_len=None)
        for policy in self.policies:
            try:
                policy.check(config.block_size)
            except FieldError as e:
                raise FieldError("policies", f"{policy}: {e}") from None
        context = models.context_length(models.check(models.resolve(self.model)))
        if max(self.lengths) + ANSWER_ROOM > context:
            raise FieldError(
                "lengths", f"{max(self.lengths)} leaves no room to answer in the model's context of {context} tokens"
            )
        try:
            engine = Engine(self.model, dataclasses.replace(config, max_model_len=max(self.lengths) + ANSWER_ROOM))
        except FieldError as e:  # the engine's max_model_len is this command's longest length
            raise FieldError(e.field, e.problem.replace("{max_model_len}", "the longest of {lengths}")) from None
        args = (engine.tokenizer, self.tasks, self.lengths, self.samples, self.seed, self.source)
        cases = long_context.make_cases(*args)
        start = time.perf_counter()
        rows = long_context.run(engine, cases, self.policies)
        summary = long_context.summarize(rows)
        print(long_context.table(summary))
        result = records.LongContext(
            model=str(engine.model_dir),
            kv_cache_dtype=self.kv_cache_dtype,
            kv_bytes_per_token=engine.runner.kv_bytes_per_token,
            tasks=self.tasks,
            lengths=self.lengths,
            samples=self.samples,
            seconds=time.perf_counter() - start,
            rows=rows,
            summary=summary,
        ).model_dump()
        if self.output:
            atomic.write_file(self.output, json.dumps(result, indent=1), self.overwrite, "output")
        return result
