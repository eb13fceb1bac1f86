"""Recipes: a tiny one runs end to end into a report, a second run skips everything, an edit redoes only
what it changed, a chain two stages share runs once; malformed recipes name the file, line and field; every
shipped recipe is valid."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slimlm import SlimlmError
from slimlm import recipe as recipes
from slimlm.cli import main

SHIPPED = sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml"))


def write_recipe(tmp_path: Path, tiny_llama: Path, calib_txt: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(f"""\
model: {tiny_llama}
runs: {tmp_path / "runs"}
report: {tmp_path / "report.html"}
eval: {{ppl: {calib_txt}, max_tokens: 2048, seq_len: 128}}
bench: {{batch: [1, 2], context: 32, prefill_len: 16, requests: 3, rate: 50, prompt_len: [8, 12],
        output_len: [2, 4], kv_cache_memory: 4M}}
stages:
  float: []
  rtn: [{{rtn: {{group_size: 32}}}}]
  rtn-kv:
    - rtn: {{group_size: 32}}
    - kv: {{kv_dtype: int8, calib: {calib_txt}, num_samples: 4, seq_len: 64}}
""")
    return path


def test_a_recipe_runs_resumes_and_redoes_only_what_changed(tiny_llama, calib_txt, tmp_path, capsys):
    path = write_recipe(tmp_path, tiny_llama, calib_txt)
    assert main(["recipe", str(path)]) == 0
    captured = capsys.readouterr()
    assert f"report: {tmp_path / 'report.html'}" in captured.out and "rtn-kv" in captured.out
    assert "rtn-kv: step 1/2 rtn: the same as" in captured.err  # the shared chain ran once
    runs = tmp_path / "runs"
    kv = json.loads((runs / "rtn-kv" / "model" / "config.json").read_text())["quantization_config"]
    assert kv["kv_cache_scheme"]["num_bits"] == 8
    assert json.loads((runs / "float" / "run.json").read_text())["model"] == str(tiny_llama)
    stamps = {p: p.stat().st_mtime_ns for p in runs.rglob("*.json")}

    assert main(["recipe", str(path)]) == 0
    err = capsys.readouterr().err
    assert err.count("done before, skipped") == 3 * 2 + 2 and "the same as" in err  # eval+bench ×3, rtn, kv
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("*.json")} == stamps

    assert main(["recipe", str(path), "--set", "stages.rtn.0.rtn.bits=8"]) == 0
    err = capsys.readouterr().err
    assert "rtn: step 1/1 rtn {'group_size': 32, 'bits': 8}" in err and "float: eval: done before" in err
    assert (
        json.loads((runs / "rtn" / "model" / "config.json").read_text())["quantization_config"]["config_groups"][
            "group_0"
        ]["weights"]["num_bits"]
        == 8
    )


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "model: m\nruns: r\nstagez: {}\n",
            "x.yaml:3: stagez: unknown field (a recipe has model, runs, eval, bench, report, notes, stages)",
        ),
        (
            "model: m\nruns: r\nstages:\n  a:\n    - quantize: {bits: 4}\n",
            "x.yaml:5: stages.a.0: unknown step 'quantize' (steps: rtn, gptq, autoround, awq, kv, gqa, prune)",
        ),
        (
            "model: m\nruns: r\nstages:\n  a:\n    - rtn: {bitz: 4}\n",
            "x.yaml:5: stages.a.0.rtn.bitz: unknown option (`compress rtn` takes model, calib, "
            "num_samples, seq_len, seed, "
            "batch_size, out, overwrite, ppl, ppl_tokens, device, compute_dtype, kv_dtype, "
            "kv_strategy, bits, group_size, "
            "sym, ignore, quantize_lm_head, budget, size, budget_bits, format, report_error)",
        ),
        (
            "model: m\nruns: r\nstages:\n  a:\n    - rtn: {out: elsewhere}\n",
            "x.yaml:5: stages.a.0.rtn.out: set by the recipe; leave it out",
        ),
        (
            "model: m\nruns: r\nstages:\n  a: [{rtn: {bits: [4}]\n",
            "x.yaml:4: not valid YAML (expected ',' or ']', but got '}')",
        ),
        ("model: m\nruns: r\n", "x.yaml: 'stages' is required: a mapping of stage names to steps"),
        (
            "model: m\nruns: r\nstages: {}\n",
            "x.yaml:3: stages: 'stages' is required: a mapping of stage names to steps",
        ),
        (
            "model: m\nruns: r\nstages: [a]\n",
            "x.yaml:3: stages: 'stages' is required: a mapping of stage names to steps",
        ),
        ("runs: r\nstages: {a: []}\n", "x.yaml: the field 'model' is required"),
        ("model: m\nstages: {a: []}\n", "x.yaml: the field 'runs' is required"),
        ("model: [m]\nruns: r\nstages: {a: []}\n", "x.yaml:1: model: required: a string"),
        ("model: m\nruns: ''\nstages: {a: []}\n", "x.yaml:2: runs: required: a string"),
        ("model: m\nruns: r\nreport: 3\nstages: {a: []}\n", "x.yaml:3: report: a file path, e.g. out/runs/report.html"),
        (
            "model: m\nruns: r\nreport: ''\nstages: {a: []}\n",
            "x.yaml:3: report: a file path, e.g. out/runs/report.html",
        ),
        ("model: m\nruns: r\neval: [ppl]\nstages: {a: []}\n", "x.yaml:3: eval: a mapping of `compress eval` options"),
        ("model: m\nruns: r\nbench: 1\nstages: {a: []}\n", "x.yaml:3: bench: a mapping of `compress bench` options"),
        (
            "model: m\nruns: r\neval: {tasks: slimlm_piqa, limitt: 2}\nstages: {a: []}\n",
            "x.yaml:3: eval.limitt: unknown option (`compress eval` takes dtype, kv_cache_memory, "
            "kv_cache_dtype, device, activations, "
            "model, tasks, limit, num_fewshot, batch_size, ppl, seq_len, max_tokens, output, overwrite)",
        ),
        (
            "model: m\nruns: r\nstages:\n  a: rtn\n",
            "x.yaml:4: stages.a: a list of steps, e.g. [{gptq: {bits: 4}}] ([] for the source itself)",
        ),
        (
            "model: m\nruns: r\nstages:\n  a: [rtn]\n",
            "x.yaml:4: stages.a.0: a step is one command with its options, e.g. {gptq: {bits: 4}}",
        ),
        (
            "model: m\nruns: r\nstages:\n  a: [{rtn: {}, gptq: {}}]\n",
            "x.yaml:4: stages.a.0: a step is one command with its options, e.g. {gptq: {bits: 4}}",
        ),
        (
            "model: m\nruns: r\nstages:\n  a: [{rtn: 4}]\n",
            "x.yaml:4: stages.a.0.rtn: options are a mapping, e.g. {bits: 4, group_size: 64}",
        ),
        (
            "model: m\nruns: r\nstages:\n  ../victim: []\n",
            "x.yaml:4: stages.../victim: a stage name is a plain name (letters, digits, '.', '_', "
            "'-'), got '../victim'",
        ),
        ("model: m\nruns: r\nstages:\n  /abs/path: []\n", "got '/abs/path'"),
        ("model: m\nruns: r\nstages:\n  .: []\n", "got '.'"),
        ("model: m\nruns: r\nstages:\n  ..: []\n", "got '..'"),
        ("model: m\nruns: r\nstages:\n  1: []\n", "got 1"),
        ("model: m\nruns: x.yaml\nstages: {a: []}\n", "x.yaml:2: runs: x.yaml exists and is not a directory"),
        (
            "- model: m\n",
            "x.yaml: a recipe is a mapping with the fields model, runs, eval, bench, report, notes, stages",
        ),
        ("", "x.yaml: a recipe is a mapping with the fields model, runs, eval, bench, report, notes, stages"),
        (
            "model: m\nruns: r\nXtra: 1\nstages: {a: []}\n",
            "x.yaml:3: Xtra: unknown field (a recipe has model, runs, eval, bench, report, notes, stages)",
        ),
    ],
)
def test_malformed_recipes_name_the_file_line_and_field(tmp_path, text, message, monkeypatch):
    """The whole message: where (file:line, the line of the offending value), the field, and what to do."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(SlimlmError) as error:
        recipes.load(path)
    whole = str(error.value)
    assert whole == message.replace("x.yaml", str(path), 1) if message.startswith("x.yaml") else whole.endswith(message)


def test_a_missing_recipe_is_named(tmp_path):
    with pytest.raises(SlimlmError, match=f"^recipe {tmp_path / 'no.yaml'} does not exist$"):
        recipes.load(tmp_path / "no.yaml")


def test_options_become_the_commands_own_jobs():
    """Each option as the command's job takes it: a switch named true sets its field, false and null leave
    the default, a list stays a list where the field is one and reads as comma-separated text where the flag
    takes text; what the recipe sets is refused."""
    job = recipes.job(
        "rtn",
        {"bits": 8, "asym": True, "sym": False, "ignore": ["*.down_proj", "*.up_proj"], "quantize_lm_head": None},
        model="m",
        out=Path("o"),
        overwrite=True,
    )
    assert (job.model, job.out, job.overwrite, job.bits) == ("m", Path("o"), True, 8)
    assert job.sym is False and job.ignore == ["*.down_proj", "*.up_proj"] and job.quantize_lm_head is None
    assert recipes.job("rtn", {"float_lm_head": True}, model="m", out=Path("o")).quantize_lm_head == 0
    job = recipes.job("bench", {"batch": [1, 2], "prompt_len": [8, 12], "kv_cache_memory": "1G"}, model="m")
    assert job.batch == [1, 2] and job.prompt_len == (8, 12) and job.kv_cache_memory == 1 << 30
    assert not job.overwrite
    with pytest.raises(SlimlmError, match="^bits: invalid choice: 5 \\(choose from 2, 3, 4, 8\\)$"):
        recipes.job("rtn", {"bits": 5}, model="m", out=Path("o"))
    with pytest.raises(SlimlmError, match="^model: set by the recipe; leave it out$"):
        recipes.job("eval", {"model": "x"}, model="m")
    with pytest.raises(SlimlmError, match="^asym: true or false, got 3$"):
        recipes.job("rtn", {"asym": 3}, model="m", out=Path("o"))


@pytest.mark.parametrize(
    "assignment,message",
    [
        ("stages", "--set 'stages': use --set FIELD=VALUE, e.g. --set eval.limit=10"),
        ("=[]", "--set '=[]': use --set FIELD=VALUE, e.g. --set eval.limit=10"),
        ("stages.a.1.rtn.bits=4", "--set stages.a.1.rtn.bits: '1' is not an item there (a list of 1, from 0)"),
        (
            "eval.limit=[1",
            "--set eval.limit: the value is not valid YAML (expected ',' or ']', but got '<stream end>')",
        ),
    ],
)
def test_set_refusals_are_whole_sentences(tmp_path, assignment, message):
    path = tmp_path / "x.yaml"
    path.write_text("model: m\nruns: r\neval: {}\nstages:\n  a: [{rtn: {bits: 4}}]\n")
    with pytest.raises(SlimlmError) as error:
        recipes.load(path, [assignment])
    assert str(error.value) == message
    assert recipes.load(path, ["notes=a=b", "eval.limit="]).notes == "a=b"  # the first '=' splits; empty is null


def test_a_loaded_recipe_holds_its_fields_and_names_the_overrides_behind_an_error(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("model: m\nruns: r\nreport: out/r.html\nstages:\n  a: [{rtn: {bits: 4}}]\n")
    recipe = recipes.load(path)
    assert (recipe.path, recipe.model, recipe.runs, recipe.report) == (path, "m", Path("r"), Path("out/r.html"))
    assert (recipe.eval, recipe.bench, recipe.notes, list(recipe.stages)) == ({}, {}, "", ["a"])
    assert recipes.load(path, ["report=", "notes=short"]).report is None
    with pytest.raises(SlimlmError) as error:
        recipes.load(path, ["stages.a.0.rtn.bits=5", "stages.a.0.rtn.group_size=32", "notes=x"])
    assert str(error.value) == (
        f"{path}:5 (with --set stages.a.0.rtn.bits=5): stages.a.0.rtn.bits: invalid choice: 5 (choose from 2, 3, 4, 8)"
    )  # the override behind it, not every one
    with pytest.raises(SlimlmError) as error:
        recipes.load(path, ["model=", "notes=x"])  # about one field, not the recipe's overrides as a whole
    assert str(error.value) == f"{path}:1 (with --set model=): model: required: a string"
    path.write_text("runs: r\nstages: {a: []}\n")
    with pytest.raises(SlimlmError) as error:
        recipes.load(path, ["notes=x"])
    assert str(error.value) == f"{path}: the field 'model' is required"


def test_overrides_are_checked_too(tiny_llama, tmp_path, capsys):
    path = tmp_path / "x.yaml"
    text = f"model: {tiny_llama}\nruns: {tmp_path / 'r'}\neval: {{seq_len: 64}}\nstages:\n  a: [{{rtn: {{bits: 4}}}}]\n"
    path.write_text(text)
    assert main(["recipe", str(path), "--check", "--set", "stages.a.0.rtn.bits=8"]) == 0
    assert "1 stages, 1 steps: valid" in capsys.readouterr().out
    assert main(["recipe", str(path), "--check", "--set", "stages.b.0.rtn.bits=8"]) == 2
    assert "--set stages.b.0.rtn.bits: the recipe has no field 'b' there" in capsys.readouterr().err
    assert main(["recipe", str(path), "--check", "--set", "stages.a.0.rtn.bits=five"]) == 2
    assert (
        "x.yaml:5 (with --set stages.a.0.rtn.bits=five): stages.a.0.rtn.bits: 'five' is not an integer"
    ) in capsys.readouterr().err


@pytest.mark.parametrize(
    "assignment,fragment",
    [
        ("stages.a.5.rtn.bits=4", "--set stages.a.5.rtn.bits: '5' is not an item there (a list of 1, from 0)"),
        ("stages.a.-1.rtn.bits=3", "'-1' is not an item there"),
        ("stages.float.x=1", "--set stages.float.x: 'x' is not an item there (a list of 0, from 0)"),
        ("stages=!!python/object/apply:os.system [true]", "--set stages: the value is not valid YAML"),
        (
            "stages.a.0.rtn.bits=5",
            "x.yaml:6 (with --set stages.a.0.rtn.bits=5): stages.a.0.rtn.bits: invalid choice: 5",
        ),
        (
            "stages.a.0.rtn.group_size=0",
            "x.yaml:6 (with --set stages.a.0.rtn.group_size=0): stages.a.0.rtn.group_size: invalid choice: 0",
        ),
        ("bench.prompt_len=[8]", "x.yaml:3 (with --set bench.prompt_len=[8]): bench.prompt_len: '8': give LO,HI"),
        ("bench.batch=[0]", "bench.batch: '0': give positive integers"),
        ("eval.tasks=nosuch_task", "eval.tasks: unknown task nosuch_task"),
        ("stages.~=[]", "a stage name is a plain name"),
    ],
)
def test_check_refuses_what_the_run_would(tmp_path, capsys, assignment, fragment):
    """--check (and so every run, before its first stage) refuses each value a command would refuse later."""
    path = tmp_path / "x.yaml"
    path.write_text("model: m\nruns: r\nbench: {}\neval: {}\nstages:\n  a: [{rtn: {bits: 4}}]\n  float: []\n")
    assert main(["recipe", str(path), "--check", "--set", assignment]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


def test_check_refuses_a_stage_directory_it_did_not_write(tmp_path, capsys):
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "notes.txt").write_text("mine")
    path = tmp_path / "x.yaml"
    path.write_text(f"model: m\nruns: {tmp_path / 'runs'}\nstages:\n  a: []\n")
    assert main(["recipe", str(path), "--check"]) == 2
    assert "holds files this recipe did not write" in capsys.readouterr().err


def test_a_recipe_replaces_only_what_it_wrote(tiny_llama, tmp_path, capsys):
    """A user's checkpoint and notes where a stage's run directory would be: the recipe refuses and leaves them,
    and a report path that is not a slimlm report is not replaced either."""
    mine = tmp_path / "runs" / "rtn" / "model"
    mine.parent.mkdir(parents=True)
    (mine.parent / "eval.json").write_text("mine")
    path = tmp_path / "r.yaml"
    path.write_text(f"model: {tiny_llama}\nruns: {tmp_path / 'runs'}\nstages:\n  rtn: [{{rtn: {{bits: 8}}}}]\n")
    assert main(["recipe", str(path)]) == 2
    err = capsys.readouterr().err
    assert "holds files this recipe did not write (no run.json of stage 'rtn' by this recipe)" in err
    assert (mine.parent / "eval.json").read_text() == "mine" and not mine.exists()
    own = tmp_path / "report.html"
    own.write_text("<html>my notes</html>")
    path.write_text(
        f"model: {tiny_llama}\nruns: {tmp_path / 'runs2'}\nreport: {own}\neval: {{max_tokens: 256, "
        "seq_len: 64}\nbench: {batch: [1], context: 16, prefill_len: 8, requests: 1, prompt_len: [4, 4], "
        "output_len: [2, 2], rounds: 1}\nstages:\n  float: []\n"
    )
    assert main(["recipe", str(path), "--check"]) == 2  # refused before any stage runs
    assert f"report {own} exists and is not a slimlm result (JSON or report); name another file" in (
        capsys.readouterr().err
    )
    assert own.read_text() == "<html>my notes</html>" and not (tmp_path / "runs2").exists()
    own.unlink()
    assert main(["recipe", str(path)]) == 0  # its own report, then replaced by the next run
    assert main(["recipe", str(path)]) == 0 and "my notes" not in own.read_text()


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_recipe_is_valid(path):
    recipe = recipes.load(path)
    assert recipe.report is not None and list(recipe.stages)[0] == "float" and not recipe.stages["float"]


PARTS = st.sampled_from(
    [
        "model",
        "runs",
        "eval",
        "bench",
        "stages",
        "report",
        "notes",
        "a",
        "float",
        "0",
        "1",
        "-1",
        "5",
        "rtn",
        "gptq",
        "bits",
        "group_size",
        "limit",
        "batch",
        "prompt_len",
        "x",
        "~",
        "..",
        "",
        " ",
        "01",
        "1.5",
    ]
)
VALUES = st.one_of(
    st.sampled_from(
        [
            "",
            "null",
            "~",
            "5",
            "-1",
            "0",
            "nan",
            ".inf",
            "1e400",
            "[8]",
            "[1, 2]",
            "[0]",
            "{rtn: {bits: 4}}",
            "[{rtn: {bits: 8}}]",
            "{a: 1}",
            "x",
            "'..'",
            "/abs",
            "!!python/object/apply:os.system [true]",
            "[",
            "{",
            "true",
            "2**70",
        ]
    ),
    st.text(max_size=6),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(PARTS, min_size=1, max_size=5), VALUES)
def test_any_set_gives_a_valid_recipe_or_a_one_line_error(tmp_path, monkeypatch, parts, value):
    """`--set` with any path and value: a recipe that loads, or a SlimlmError naming the problem; never an
    internal error (IndexError, ValueError, AttributeError, TypeError were all reachable)."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "x.yaml"
    path.write_text(
        "model: m\nruns: r\neval: {limit: 5}\nbench: {batch: [1]}\nstages:\n  a: [{rtn: {bits: 4}}]\n  float: []\n"
    )
    try:
        recipes.load(path, [f"{'.'.join(parts)}={value}"])
    except SlimlmError as e:
        assert "\n" not in str(e)


def _recipe_state(runs: Path) -> dict:
    """Every stage's outputs as the recipe left them: run.json, and the eval, bench and checkpoint it names."""
    from slimlm.formats import manifest

    state = {}
    for stage in sorted(p for p in runs.iterdir() if p.is_dir()):
        record = json.loads((stage / "run.json").read_text())
        assert record["name"] == stage.name
        if Path(record["model"]).is_relative_to(stage):  # a stage with steps: its checkpoint is complete
            manifest.verify(Path(record["model"]))
        evaluated = json.loads((stage / "eval.json").read_text())
        assert json.loads((stage / "bench.json").read_text())["systems"]
        state[stage.name] = (record["hashes"], round(evaluated["perplexity"], 6))
    return state


# Points inside a recipe's run, each marked by a file it writes there: the kill waits for one (an event, not a
# share of the wall time a busy machine would stretch), so the run is always cut before its end.
KILL_POINTS = ("runs/float/eval.json", "runs/rtn/run.json", "runs/rtn/model", "runs/rtn-kv/run.json")


@pytest.mark.parametrize("seed", [0])
def test_a_recipe_killed_at_a_random_point_finishes_on_the_rerun(tiny_llama, calib_txt, tmp_path, seed):
    """Fault injection: kill -9 somewhere in a three-stage recipe. The rerun finishes, and every stage's
    checkpoint, eval, bench and run.json are complete and the same as an uninterrupted run's."""
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    for name in ("clean", "killed"):
        (tmp_path / name).mkdir()
    clean, killed = (write_recipe(tmp_path / name, tiny_llama, calib_txt) for name in ("clean", "killed"))
    run = [sys.executable, "-m", "slimlm.cli", "recipe"]
    assert subprocess.run([*run, str(clean)], env=env, capture_output=True).returncode == 0
    point = tmp_path / "killed" / random.Random(seed).choice(KILL_POINTS)
    proc = subprocess.Popen([*run, str(killed)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not point.exists() and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, point  # killed mid-way, not finished
    rerun = subprocess.run([*run, str(killed)], env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert _recipe_state(tmp_path / "killed" / "runs") == _recipe_state(tmp_path / "clean" / "runs")


def fake_commands(monkeypatch) -> list[tuple]:
    """Every command a recipe calls, replaced by one that records its call and writes what the real one would
    leave behind (a step's slimlm.json, eval.json, bench.json): the run's bookkeeping in milliseconds. Each
    checks that its stage directory was claimed (run.json naming the stage) before any work."""
    from slimlm.jobs import JOBS

    calls: list[tuple] = []

    def claimed(run_dir: Path) -> None:
        assert json.loads((run_dir / "run.json").read_text())["name"] == run_dir.name

    def step(command: str):
        def run(args) -> None:
            assert args.overwrite
            claimed(args.out.parent)
            calls.append((command, args.model, str(args.out)))
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "slimlm.json").write_text("{}")

        return run

    def measure(part: str):
        def run(args) -> None:
            assert args.overwrite
            target = Path(args.output if part == "eval" else args.json_path)
            claimed(target.parent)
            calls.append((part, args.model, str(target), *([args.baseline] if part == "bench" else [])))
            target.write_text("{}")

        return run

    for command in ("rtn", "gptq", "kv"):
        monkeypatch.setattr(JOBS[command], "execute", step(command))
    for part in ("eval", "bench"):
        monkeypatch.setattr(JOBS[part], "execute", measure(part))
    return calls


RECIPE = """\
model: {src}
runs: {runs}
eval: {{max_tokens: 256}}
stages:
  float: []
  rtn: [{{rtn: {{bits: 8, group_size: 32}}}}]
  rtn-kv: [{{rtn: {{group_size: 32, bits: 8}}}}, {{kv: {{kv_dtype: int8}}}}]
  rtn2: [{{rtn: {{bits: 8, group_size: 32}}}}]
  gptq-kv: [{{gptq: {{bits: 8, group_size: 32}}}}, {{kv: {{kv_dtype: int8}}}}]  # rtn's options: not rtn's step
"""


def test_a_run_does_each_step_once_reuses_shared_chains_and_redoes_what_changed(tmp_path, monkeypatch, capsys):
    src, runs = tmp_path / "src", tmp_path / "runs"
    src.mkdir()
    for name, text in (("model.safetensors", "weights"), ("config.json", "{}"), ("notes.md", "not weights")):
        (src / name).write_text(text)
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.format(src=src, runs=runs))
    calls = fake_commands(monkeypatch)
    stages = ["float", "rtn", "rtn-kv", "rtn2", "gptq-kv"]

    def run(*overrides: str) -> list[tuple]:
        calls.clear()
        assert recipes.run(recipes.load(path, list(overrides))) == [runs / name for name in stages]
        return list(calls)

    def measured(name: str, model: str) -> list[tuple]:
        baseline = "none" if name == "float" else str(src)
        return [
            ("eval", model, str(runs / name / "eval.json")),
            ("bench", model, str(runs / name / "bench.json"), baseline),
        ]

    def final(name: str) -> str:
        return str(runs / name / "model")

    gptq = str(runs / "gptq-kv" / "step0-gptq")
    float_, rtn = measured("float", str(src)), [("rtn", str(src), final("rtn")), *measured("rtn", final("rtn"))]
    rtn_kv = [("kv", final("rtn"), final("rtn-kv")), *measured("rtn-kv", final("rtn-kv"))]  # rtn's step, reused
    rtn2 = [("rtn", str(src), final("rtn2")), *measured("rtn2", final("rtn2"))]  # a stage's last step is its own
    gptq_kv = [("gptq", str(src), gptq), ("kv", gptq, final("gptq-kv")), *measured("gptq-kv", final("gptq-kv"))]
    everything = float_ + rtn + rtn_kv + rtn2 + gptq_kv
    assert run() == everything
    err = capsys.readouterr().err
    assert f"[recipe] rtn-kv: step 1/2 rtn: the same as {final('rtn')}, reused\n" in err
    assert "[recipe] rtn: step 1/1 rtn {'bits': 8, 'group_size': 32}\n" in err and "[recipe] float: eval\n" in err
    state = json.loads((runs / "rtn-kv" / "run.json").read_text())
    assert state["name"] == "rtn-kv" and state["model"] == final("rtn-kv")
    assert set(state["hashes"]) == {"step1", "model", "eval", "bench"}  # step0 was rtn's
    assert json.loads((runs / "float" / "run.json").read_text())["model"] == str(src)
    stamps = {p: p.stat().st_mtime_ns for p in runs.rglob("*.json")}

    # the same recipe, its options in another order: all done, nothing runs or is rewritten
    path.write_text(RECIPE.format(src=src, runs=runs).replace("bits: 8, group_size: 32", "group_size: 32, bits: 8"))
    assert run() == []
    err = capsys.readouterr().err
    assert err.count("done before, skipped") == 5 * 2 + 5  # eval and bench of every stage, each stage's own steps
    assert "[recipe] rtn: step 1/1 rtn: done before, skipped\n" in err
    assert "[recipe] gptq-kv: step 2/2 kv: done before, skipped\n" in err
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("*.json")} == stamps

    assert run("stages.rtn-kv.1.kv.kv_dtype=fp8") == rtn_kv  # only what follows the edit
    edits = ("stages.rtn-kv.1.kv.kv_dtype=fp8", "eval.max_tokens=128")
    assert run(*edits) == [c for c in everything if c[0] == "eval"]
    (runs / "rtn" / "model" / "notes.txt").write_text("mine")  # an output changed: refused, left as it is
    with pytest.raises(SlimlmError, match=f"{runs / 'rtn' / 'model'} changed since this recipe wrote it; move it"):
        run(*edits)
    assert (runs / "rtn" / "model" / "notes.txt").read_text() == "mine"
    shutil.rmtree(runs / "rtn" / "model")  # an output gone: its step runs again
    assert run(*edits) == [rtn[0]]
    (src / "notes.md").write_text("edited")  # not the model
    assert run(*edits) == []
    for name, text in (("config.json", '{"edited": 1}'), ("model.safetensors", "new weights")):
        (src / name).write_text(text)  # a new source: everything again
        assert run(*edits) == everything


def test_a_stage_directory_is_refused_unless_its_run_json_names_the_stage(tmp_path, monkeypatch):
    fake_commands(monkeypatch)
    path = tmp_path / "r.yaml"
    path.write_text(f"model: m\nruns: {tmp_path / 'runs'}\nstages:\n  a: []\n")
    stage = tmp_path / "runs" / "a"
    stage.mkdir(parents=True)
    recipes.run(recipes.load(path))  # an empty directory is taken
    assert json.loads((stage / "run.json").read_text())["name"] == "a"
    for text in (json.dumps({"name": "b"}), "{not json", json.dumps(["a"]), json.dumps({"name": "a"})):
        (stage / "run.json").write_text(text)
        with pytest.raises(
            SlimlmError,
            match=re.escape(
                f"{stage} holds files this recipe did not write (no run.json "
                "of stage 'a' by this recipe); point runs: at a new directory or move them "
                "away"
            ),
        ):
            recipes.load(path)
    (stage / "run.json").unlink()
    (stage / "eval.json").unlink()
    (stage / "bench.json").unlink()
    stage.rmdir()
    stage.write_text("a file")
    with pytest.raises(SlimlmError, match=f"{stage} exists and is not a directory; point runs: elsewhere"):
        recipes.load(path)


def test_an_override_with_a_newline_is_quoted_so_the_error_stays_one_line(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("model: m\nruns: r\nstages: {a: []}\n")
    with pytest.raises(SlimlmError) as error:
        recipes.load(path, ["model=\n"])
    assert str(error.value) == f"{path}:1 (with --set 'model=\\n'): model: required: a string"
    with pytest.raises(SlimlmError) as error:
        recipes.load(path, ["no\nsuch.x=1"])
    assert str(error.value) == "--set 'no\\nsuch.x': the recipe has no field 'no\\nsuch' there"


def test_a_second_recipe_is_refused_the_first_ones_stages(tmp_path, monkeypatch):
    """Two recipe files with the same runs: (another model, the same stage names): the second stops before any
    work and names the first; the first's outputs stay, and it still resumes."""
    calls = fake_commands(monkeypatch)
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text(f"model: m1\nruns: {tmp_path / 'runs'}\nstages:\n  a: [{{rtn: {{bits: 8}}}}]\n")
    second.write_text(first.read_text().replace("m1", "m2"))
    recipes.run(recipes.load(first))
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").rglob("*")}
    with pytest.raises(SlimlmError, match=f"{tmp_path / 'runs' / 'a'} was written by the recipe {first}; point"):
        recipes.load(second)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").rglob("*")} == stamps
    state = json.loads((tmp_path / "runs" / "a" / "run.json").read_text())
    recipe_hash = hashlib.sha256(first.read_bytes()).hexdigest()
    assert state["recipe"] == str(first) and state["outputs"]["model"]["recipe_sha256"] == recipe_hash
    calls.clear()
    recipes.run(recipes.load(first))
    assert calls == []


def test_an_alias_bomb_and_a_recursive_alias_are_refused_in_one_line_at_once(tmp_path):
    bomb = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    bomb += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10^9 values expanded
    for text, message in (
        ("\n".join(bomb), "its aliases expand to more than 100,000 values; write them out"),
        ("model: m\nruns: r\nnotes: &n [*n]\nstages: {a: []}\n", ":3: an alias refers to the value that holds it"),
    ):
        path = tmp_path / "x.yaml"
        path.write_text(text)
        start = time.perf_counter()
        with pytest.raises(SlimlmError) as refused:
            recipes.load(path)
        assert time.perf_counter() - start < 5 and message in str(refused.value) and "\n" not in str(refused.value)


def test_set_changes_the_one_path_it_names_even_where_an_alias_shared_it(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("model: m\nruns: r\nstages:\n  a: [{rtn: &o {bits: 4}}]\n  b: [{rtn: *o}]\n")
    recipe = recipes.load(path, ["stages.a.0.rtn.bits=8"])
    assert recipe.stages["a"][0].options == {"bits": 8} and recipe.stages["b"][0].options == {"bits": 4}


@pytest.mark.parametrize(
    "assignment,fragment",
    [
        ("model=no/such-model-here", ": model: "),
        ("eval.ppl=missing.txt", ": eval: text file missing.txt does not exist"),
        ("eval.ppl=ｗｉｋｉ", ": eval: unknown text source 'ｗｉｋｉ'"),  # fullwidth letters
        ("eval.seq_len=600", ": eval: seq_len 600 exceeds the model's context (512 tokens)"),
        ("stages.a.0.rtn.calib=missing.txt", ": stages.a.0.rtn: text file missing.txt does not exist"),
        ("stages.a.0.rtn.device=cuda:7", ": stages.a.0.rtn: device cuda:7"),
        ("stages.a.0.rtn.group_size=128", "does not divide the input dim"),
        ("runs=/proc/slimlm-x", ": runs: /proc/slimlm-x cannot be written"),
        ("stages.a.0={awq: {grid: 0}}", ": stages.a.0.awq: grid 0 must be a positive integer"),
        ("stages.a.0={gptq: {damp: -1}}", "stages.a.0.gptq.damp: '-1' must be in (0, 1)"),
        ("stages.a.0={gptq: {float_target: 2}}", "stages.a.0.gptq.float_target: '2' must be in [0, 1]"),
        ("stages.a.0={prune: {target_params: 5}}", ": stages.a.0.prune: target_params 5.0 must be a fraction"),
        ("stages.a.0={gqa: {lr: -1, kv_heads: 1}}", ": stages.a.0.gqa: lr must be in (0, 1], got -1.0"),
        ("stages.a.0={gqa: {kv_heads: 3}}", ": stages.a.0.gqa: kv_heads 3 does not divide the 4 query heads"),
    ],
)
def test_check_runs_the_checks_the_run_makes_before_its_work(tiny_llama, tmp_path, capsys, assignment, fragment):
    """What the run would refuse before (or after) its first stage, --check refuses: the model, the data, the
    device, the source's shapes, the eval window, where runs: goes (tiny_llama: 4 heads, context 512)."""
    path = tmp_path / "x.yaml"
    path.write_text(
        f"model: {tiny_llama}\nruns: {tmp_path / 'runs'}\neval: {{max_tokens: 256, seq_len: 64}}\nbench: {{}}\n"
        "stages:\n  a: [{rtn: {bits: 4, group_size: 32}}]\n  float: []\n"
    )
    assert main(["recipe", str(path), "--check"]) == 0
    capsys.readouterr()
    assert main(["recipe", str(path), "--check", "--set", assignment]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()


def test_a_stage_name_with_a_newline_is_quoted_in_its_one_line_error(tmp_path, capsys):
    path = tmp_path / "x.yaml"
    path.write_text('model: m\nruns: r\nstages:\n  "a\\nb": []\n')
    assert main(["recipe", str(path), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stages.'a\\nb': a stage name is a plain name" in err


def test_aliases_are_counted_exactly_once_per_use(tmp_path, monkeypatch):
    """The bound counts every value an alias stands for: [&a [1, 2], *a, *a] holds 1 + 3·3 = 10 values."""
    import yaml

    path = tmp_path / "x.yaml"
    path.write_text("model: m\nruns: r\nnotes: [&a [1, 2], *a, *a]\nstages: {a: []}\n")
    root = yaml.compose(path.read_text())
    notes = root.value[2][1]
    monkeypatch.setattr(recipes, "MAX_VALUES", 10)
    recipes._expanded(notes, path)  # exactly the bound: allowed
    monkeypatch.setattr(recipes, "MAX_VALUES", 9)
    with pytest.raises(SlimlmError, match="its aliases expand to more than 9 values"):
        recipes._expanded(notes, path)
    recipes._expanded(root.value[0][1], path)  # a scalar: one value


def test_an_output_hash_covers_every_file_of_a_directory_by_name(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "a.json").write_text("{}")
    first = recipes._output_hash(out)
    (out / "a.json").rename(out / "b.json")  # same size, same time: another name
    assert recipes._output_hash(out) != first
    assert recipes._output_hash(tmp_path / "none") is None
