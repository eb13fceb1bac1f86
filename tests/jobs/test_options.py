"""The jobs are the one definition of every command's options: the CLI, recipes and Python reach every field,
with the same defaults and the same checks."""

import contextlib
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slimlm import recipe as recipes
from slimlm.cli import build_parser
from slimlm.errors import FieldError, SlimlmError
from slimlm.jobs import JOBS, STEPS, Serve, options
from slimlm.jobs.engine import EngineMemory, EngineOptions
from slimlm.jobs.options import OptionError, from_args, parse_size
from slimlm.jobs.quantize import AutoRoundOptions, GPTQOptions
from slimlm.runtime.engine import EngineConfig

REQUIRED = {
    "model": "m",
    "out": "o",
    "kv_heads": 2,
    "kv_dtype": "fp8",
    "prompt": ["p"],
    "action": "list",
    "runs": ["r"],
}


def argv(command: str, values: dict) -> list[str]:
    """The command line that gives `values` (required fields only)."""
    job, words = JOBS[command], [command]
    for name, opt in job.opts().items():
        if name not in values or not job.model_fields[name].is_required():
            continue
        items = values[name] if isinstance(values[name], list) else [values[name]]
        flag = [] if opt.positional else [opt.flag or "--" + name.replace("_", "-")]
        words += [w for item in items for w in (*flag, str(item))] if opt.repeat else [*flag, *map(str, items)]
    return words


def required(command: str) -> dict:
    return {
        k: v
        for k, v in REQUIRED.items()
        if k in JOBS[command].model_fields and JOBS[command].model_fields[k].is_required()
    }


@pytest.mark.parametrize("command", list(JOBS))
def test_the_command_line_and_python_build_the_same_job_with_the_same_defaults(command):
    """A default the parser set differently from the job's (say, read from the environment at parse time)
    would make `compress X` and `X(...).run()` two different commands."""
    values = required(command)
    parsed = from_args(JOBS[command], build_parser().parse_args(argv(command, values)))
    assert parsed == JOBS[command](**values)


@pytest.mark.parametrize("command", list(JOBS))
def test_every_field_has_a_flag_and_every_flag_a_field(command):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]  # noqa: SLF001 what --help shows
    dests = {a.dest for a in sub._actions if a.dest != "help"}  # noqa: SLF001
    assert dests == set(JOBS[command].model_fields)


@pytest.mark.parametrize("command", [*STEPS, "eval", "bench"])
def test_a_recipe_reaches_every_field_it_does_not_set_itself(command):
    """Each field, given its default (or a sample) by name in a recipe step, arrives in the job as given."""
    job = JOBS[command]
    sets = {"model": "m", **({"out": Path("o")} if command in STEPS else {})}
    own = {k: v for k, v in required(command).items() if k not in sets}
    for name, field in job.model_fields.items():
        if name in recipes.SET_BY_RECIPE:
            continue
        value = REQUIRED.get(name) if field.is_required() else field.get_default(call_default_factory=True)
        then = {}  # AWQ takes a GPTQ or learned-rounding option only with that --then
        if command == "awq" and name in GPTQOptions.model_fields:
            then = {"then": "gptq"}
        elif command == "awq" and name in AutoRoundOptions.model_fields:
            then = {"then": "autoround"}
        built = recipes.job(command, {**own, name: value, **then}, **sets)
        assert getattr(built, name) == value, name


def test_a_bad_value_reads_the_same_from_every_front_end(capsys):
    """The same check and message; each front end says where: the flag, the recipe's field, the field."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["rtn", "--out", "o", "--bits", "5"])
    assert (
        capsys.readouterr().err.splitlines()[-1].endswith("argument --bits: invalid choice: 5 (choose from 2, 3, 4, 8)")
    )
    with pytest.raises(OptionError) as error:
        JOBS["rtn"].from_options({"out": "o", "bits": 5}, "stages.a.0.rtn")
    assert (str(error.value), error.value.field) == (
        "stages.a.0.rtn.bits: invalid choice: 5 (choose from 2, 3, 4, 8)",
        "bits",
    )
    with pytest.raises(OptionError, match="^bits: invalid choice: 5 \\(choose from 2, 3, 4, 8\\)$"):
        JOBS["rtn"](out="o", bits=5)
    with pytest.raises(SlimlmError, match="^kv_cache_memory: '0' must be a positive size$"):
        JOBS["eval"].from_options({"model": "m", "kv_cache_memory": 0})
    with pytest.raises(SlimlmError, match="^out: required$"):
        JOBS["gptq"].from_options({})


@pytest.mark.parametrize(
    "flag,options,field,value",
    [
        ("--asym", {"asym": True}, "sym", False),
        ("--float-lm-head", {"float_lm_head": True}, "quantize_lm_head", 0),
        ("--no-clip", {"no_clip": True}, "clip", False),
        ("--no-act-order", {"no_act_order": True}, "act_order", None),
    ],
)
def test_a_switch_is_the_same_in_a_recipe_as_on_the_command_line(flag, options, field, value):
    then = {"then": "gptq"} if field in GPTQOptions.model_fields else {}  # AWQ takes GPTQ's only then
    argv = ["awq", "--out", "o", flag, *(["--then", "gptq"] if then else [])]
    from_cli = from_args(JOBS["awq"], build_parser().parse_args(argv))
    from_recipe = JOBS["awq"].from_options({"out": "o", **options, **then})
    assert getattr(from_cli, field) == getattr(from_recipe, field) == value
    assert JOBS["awq"].from_options({"out": "o", **{k: False for k in options}}) == JOBS["awq"](out="o")
    with pytest.raises(OptionError, match=f"^{next(iter(options))}: true or false, got 'yes'$"):
        JOBS["awq"].from_options({"out": "o", **{k: "yes" for k in options}})


def test_engine_options_are_engine_config_fields_and_reach_it():
    """Defined once: every engine option a command takes is an EngineConfig field with the same default, and
    a command's own EngineConfig fields (serve's batch limits) reach the engine too."""
    defaults = EngineConfig()
    for job in (EngineMemory, EngineOptions):
        for name, field in job.model_fields.items():
            assert getattr(defaults, name) == field.default, name
    config = Serve(model="m", max_num_seqs=3, max_num_batched_tokens=64, kv_cache_memory="1G").engine_config()
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.kv_cache_memory) == (3, 64, 1 << 30)
    off = from_args(Serve, build_parser().parse_args(["serve", "m", "--no-prefix-caching"])).engine_config()
    assert off.prefix_caching is False and Serve(model="m").engine_config().prefix_caching is True


@pytest.mark.parametrize(
    "text,size", [("512M", 512 << 20), ("2G", 2 << 30), ("1.5GB", 3 << 29), ("4096", 4096), ("1KiB", 1024)]
)
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "text,message",
    [
        ("0", "'0' must be a positive size"),
        ("lots", "'lots' is not a size; write e.g. 512M or 2G"),
        ("1e400G", "'1e400G' is not a size"),
        ("1.5", "'1.5' is not a whole number of bytes; write e.g. 1.5G or 512M"),
        ("0.3K", "'0.3K' is not a whole number of bytes"),
    ],
)
def test_bad_sizes(text, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        parse_size(text)


def test_a_fractional_pool_from_python_is_refused_not_truncated():
    from slimlm.jobs import Eval

    with pytest.raises(OptionError, match="^kv_cache_memory: '1.5' is not a whole number of bytes"):
        Eval(model="m", kv_cache_memory=1.5)


@pytest.mark.parametrize(
    "command,field,value",
    [("gptq", "num_samples", True), ("gptq", "float_target", True), ("eval", "limit", True), ("rtn", "bits", False)],
)
def test_a_bool_is_not_taken_for_a_number(command, field, value):
    values = {**{k: v for k, v in REQUIRED.items() if k in JOBS[command].model_fields}, field: value}
    with pytest.raises(OptionError) as error:
        JOBS[command](**values)
    assert str(error.value) == f"{field}: {value} is not a value of this option (true/false only sets switches)"


def test_eval_ppl_builds_its_engine_with_the_kv_pool_asked_for(tiny_llama, calib_txt, capsys):
    from slimlm.cli import main

    assert main(["eval", str(tiny_llama), "--ppl", str(calib_txt), "--seq-len", "32", "--kv-cache-memory", "1"]) == 2
    err = capsys.readouterr().err
    assert "a KV cache pool of 1 bytes holds less than one block" in err and err.count("\n") == 1


def test_a_field_error_names_flags_on_the_command_line_and_fields_elsewhere(tmp_path, capsys):
    """One message, said two ways: the library raises it with field names, the CLI maps them to its flags."""
    from slimlm.cli import main
    from slimlm.errors import FieldError
    from slimlm.jobs.options import flag_of

    error = FieldError("kv_strategy", "applies to a quantized KV cache; add {kv_dtype} fp8 or int8")
    assert str(error) == "kv_strategy applies to a quantized KV cache; add kv_dtype fp8 or int8"
    assert (
        error.render(flag_of(JOBS["gptq"]))
        == "--kv-strategy applies to a quantized KV cache; add --kv-dtype fp8 or int8"
    )
    inside = FieldError("seq_len", "'wiki' has fewer than 9 tokens; lower {seq_len}")  # named where it fits
    assert (str(inside), inside.render(flag_of(JOBS["eval"]))) == (
        "'wiki' has fewer than 9 tokens; lower seq_len",
        "'wiki' has fewer than 9 tokens; lower --seq-len",
    )
    bench = flag_of(JOBS["bench"])
    assert (bench("json_path"), bench("model"), bench("unknown_thing")) == ("--json", "model", "unknown_thing")
    assert flag_of(JOBS["awq"])("clip") == "--no-clip" and flag_of(None)("out") == "out"
    with pytest.raises(FieldError, match="^kv_strategy applies to a quantized KV cache; add kv_dtype fp8 or int8$"):
        JOBS["rtn"](out=tmp_path / "o", kv_strategy="tensor").run()
    assert main(["rtn", "--out", str(tmp_path / "o"), "--kv-strategy", "tensor"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --kv-strategy applies to a quantized KV cache; add --kv-dtype fp8 or int8"
    )


@pytest.mark.parametrize(
    "parse,text,value",
    [
        (options.integer, "-3", -3),
        (options.positive_int, "1", 1),
        (options.nonnegative_int, "0", 0),
        (options.window_int, "2", 2),
        (options.seed_int, str(2**63 - 1), 2**63 - 1),
        (options.seed_int, "0", 0),
        (options.finite_float, "-1e300", -1e300),
        (options.positive_float, "inf", float("inf")),
        (options.limit_arg, "1", 1),
        (options.limit_arg, "1e9", 10**9),
        (options.limit_arg, "0.5", 0.5),
        (options.int_list, "1,8,32", [1, 8, 32]),
        (options.span, "64,64", (64, 64)),
        (options.parse_size, "1", 1),
    ],
)
def test_each_parse_function_takes_what_it_should(parse, text, value):
    assert parse(text) == value and type(parse(text)) is type(value)


@pytest.mark.parametrize(
    "parse,text,message",
    [
        (options.integer, "x", "'x' is not an integer"),
        (options.positive_int, "0", "'0' must be a positive integer"),
        (options.nonnegative_int, "-1", "'-1' must be 0 or a positive integer"),
        (options.window_int, "1", "'1' must be at least 2: a window needs at least 2 tokens (one to predict)"),
        (options.seed_int, "-1", "'-1' must be in [0, 2^63)"),
        (options.seed_int, str(2**63), f"'{2**63}' must be in [0, 2^63)"),
        (options.finite_float, "nan", "'nan' must be a finite number"),
        (options.finite_float, "one", "'one' is not a number"),
        (options.positive_float, "0", "'0' must be positive"),
        (options.positive_float, "nan", "'nan' must be positive"),
        (options.limit_arg, "x", "'x' is not a number"),
        (options.limit_arg, "0", "'0' must be a document count from 1 to 1e9 or a fraction in (0, 1)"),
        (options.limit_arg, "2.5", "'2.5' must be a document count from 1 to 1e9 or a fraction in (0, 1)"),
        (options.limit_arg, "2e9", "'2e9' must be a document count from 1 to 1e9 or a fraction in (0, 1)"),
        (options.int_list, "a,b", "'a,b': give positive integers separated by commas, e.g. 1,8,32"),
        (options.int_list, "1,0", "'1,0': give positive integers separated by commas, e.g. 1,8,32"),
        (options.span, "256,64", "'256,64': give LO,HI with LO <= HI, e.g. 64,256"),
        (options.span, "1,2,3", "'1,2,3': give LO,HI with LO <= HI, e.g. 64,256"),
        (options.parse_size, "0", "'0' must be a positive size"),
        (options.parse_size, "lots", "'lots' is not a size; write e.g. 512M or 2G"),
    ],
)
def test_each_parse_function_says_what_is_wrong(parse, text, message):
    with pytest.raises(ValueError) as e:
        parse(text)
    assert str(e.value) == message


def test_from_options_sets_switches_keeps_going_and_names_where():
    job = JOBS["rtn"].from_options({"asym": True, "bits": 8, "out": "o"})
    assert (job.sym, job.bits) == (False, 8)  # the option after a switch is read too
    with pytest.raises(OptionError) as e:
        JOBS["rtn"].from_options({"out": "o", "asym": 1}, "stages.a.0.rtn")
    assert str(e.value) == "stages.a.0.rtn.asym: true or false, got 1"
    with pytest.raises(OptionError) as e:
        JOBS["rtn"].from_options({"out": "o", "bitz": 4}, "here")
    assert str(e.value).startswith("here.bitz: unknown option (`compress rtn` takes model, calib,")
    with pytest.raises(OptionError) as e:
        JOBS["rtn"].from_options({"out": "o", "ignore": ["*.q_proj", 3]})
    assert (e.value.field, str(e.value)) == ("ignore.1", "ignore.1: Input should be a valid string")
    with pytest.raises(OptionError, match="^quantize_lm_head: invalid choice: 5 \\(choose from 4, 8\\)$"):
        JOBS["rtn"].from_options({"out": "o", "quantize_lm_head": 5})  # a switch's 0 lets through only 0
    assert JOBS["rtn"].from_options({"out": "o", "quantize_lm_head": 0}).quantize_lm_head == 0


@pytest.mark.parametrize("command", ["gptq", "awq"])
def test_the_library_steps_default_to_what_the_commands_run(command):
    """compress.gptq.GPTQ and compress.awq.AWQ called from Python with no options run the algorithm the
    command runs with none: every keyword they share with the job has the job's default."""
    import inspect

    from slimlm.compress import awq, gptq

    steps = [gptq.GPTQ] + ([awq.AWQ] if command == "awq" else [])
    fields = JOBS[command].model_fields
    shared = 0
    for step in steps:
        for name, p in inspect.signature(step.__init__).parameters.items():
            if name in fields and p.default is not inspect.Parameter.empty:
                assert p.default == fields[name].default, f"{step.__name__}.{name}"
                shared += 1
    assert shared >= (4 if command == "gptq" else 8)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--float-target", "0.5"], "error: --float-target is a GPTQ option; AWQ runs it only with --then gptq"),
        (["--damp", "0.02"], "error: --damp is a GPTQ option; AWQ runs it only with --then gptq (default: rtn)"),
        (["--act-order", "group"], "error: --act-order is a GPTQ option"),
        (["--no-act-order"], "error: --act-order is a GPTQ option"),
        (["--iters", "5"], "error: --iters is a learned-rounding option; AWQ runs it only with --then autoround"),
        (["--then", "gptq", "--windows", "3"], "error: --windows is a learned-rounding option"),
        (["--then", "autoround", "--damp", "0.1"], "error: --damp is a GPTQ option"),
        (["--then", "gptq", "--damp", "5"], "argument --damp: '5' must be in (0, 1)"),
        (["--float-target", "2"], "argument --float-target: '2' must be in [0, 1]"),
    ],
)
def test_awq_refuses_the_gptq_options_it_would_ignore_and_checks_their_range(capsys, flags, message):
    from slimlm.cli import main

    with pytest.raises(SystemExit) if "argument" in message else contextlib.nullcontext():
        assert main(["awq", "--model", "m", "--out", "o", *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_recipe_step_is_refused_the_same_gptq_options():
    with pytest.raises(OptionError) as error:
        JOBS["awq"].from_options({"out": "o", "damp": 0.02}, "stages.a.0.awq")
    assert str(error.value) == "stages.a.0.awq.damp: is a GPTQ option; AWQ runs it only with then gptq (default: rtn)"
    with pytest.raises(OptionError, match=r"^stages.a.0.gptq.float_target: '2' must be in \[0, 1\]$"):
        JOBS["gptq"].from_options({"out": "o", "float_target": 2}, "stages.a.0.gptq")
    assert JOBS["awq"].from_options({"out": "o", "then": "gptq", "damp": 0.02}).damp == 0.02


def test_an_assignment_is_checked_as_the_constructor_checks():
    job = JOBS["rtn"](out="o")
    job.bits = 8
    assert job.bits == 8
    with pytest.raises(OptionError, match=r"^bits: invalid choice: 5 \(choose from 2, 3, 4, 8\)$"):
        job.bits = 5
    with pytest.raises(OptionError, match="^model: Input should be a valid string$"):
        job.model = None
    assert job.bits == 8 and job.model == "smollm2-135m"


@pytest.mark.parametrize("command", ["rtn", "gptq", "awq", "kv"])
def test_the_calibration_settings_are_the_jobs_fields_with_their_defaults(command):
    import dataclasses

    from slimlm.compress.job import CalibData

    fields = JOBS[command].model_fields
    for f in dataclasses.fields(CalibData):
        assert f.name in fields and f.default == fields[f.name].default, f.name


def test_the_bench_settings_are_the_bench_jobs_fields_with_their_defaults():
    import dataclasses

    from slimlm.perf.config import BenchConfig

    fields = JOBS["bench"].model_fields
    own = {"steps"}  # the library's alone: decode steps timed per batch size
    for f in dataclasses.fields(BenchConfig):
        if f.name in own:
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert f.name in fields and default == fields[f.name].get_default(call_default_factory=True), f.name


ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.one_of(st.integers(-5, 300), st.text(max_size=4)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(command=st.sampled_from(sorted(JOBS)), data=st.data())
def test_any_value_of_any_field_is_a_job_or_a_one_line_error(command, data):
    """The Python constructors, fuzzed: a value of any type for any field gives a valid job or a one-line error
    naming a field — never a pydantic ValidationError, a TypeError or a job holding a bool as a number."""
    job = JOBS[command]
    field = data.draw(st.sampled_from(sorted(job.model_fields)))
    value = data.draw(ANY_VALUE)
    values = {**{k: v for k, v in REQUIRED.items() if k in job.model_fields}, field: value}
    try:
        built = job(**values)
    except (OptionError, FieldError) as e:  # a field's own check, or a check across fields (AWQ's then)
        named = e.field.split(".")[0]  # a list's item: names.0
        assert "\n" not in str(e) and named in job.model_fields, str(e)
        return
    held = getattr(built, field)
    assert not (isinstance(value, bool) and not isinstance(held, bool) and held in (0, 1)), (field, value, held)


def test_a_value_with_a_newline_is_quoted_so_the_error_stays_one_line():
    with pytest.raises(OptionError) as error:
        JOBS["rtn"](out="o", batch_size="\n")
    assert str(error.value) == "batch_size: '\\n' is not an integer"
