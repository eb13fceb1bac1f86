"""`compress recipe R.yaml`: chain compression stages, then eval, bench and the report; resumable.

    model: smollm2-135m                 # the float source every stage starts from
    runs: out/runs/default              # one directory per stage: model/, eval.json, bench.json, run.json
    eval: {ppl: wiki, tasks: slimlm_hellaswag, limit: 20}   # `compress eval` options, for every stage
    bench: {batch: [1, 8], requests: 12}                    # `compress bench` options, for every stage
    report: out/runs/default/report.html                    # optional: `compress report` over the stages
    notes: a short eval and bench                           # optional: shown at the top of the report
    stages:
      float: []                         # no steps: the source itself (the report's baseline is the first stage)
      gptq-w4:
        - gptq: {bits: 4, group_size: 64}   # `compress gptq` options; the recipe sets --model and --out
      prune-gptq:
        - prune: {target_params: 0.6, distill_tokens: 65536}
        - gptq: {bits: 4, group_size: 64}   # each step reads the previous step's output

Options are the fields of the commands' jobs (slimlm.jobs: the flags, with underscores; a list may stand for
comma-separated text). Every step is checked as its job before anything runs; an error names the file, the
line and the field, e.g. `x.yaml:12: stages.gptq-w4.0.gptq.bits: invalid choice: 5 (choose from 2, 3, 4, 8)`.
Each part of a stage (each step, the eval, the bench) records a hash of its inputs in run.json: a part whose
output exists with the same hash is skipped, so an interrupted recipe resumes where it stopped and an edited
one redoes only what the edit changed; a chain of steps two stages share (prune, then prune + GPTQ) runs once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from slimlm.errors import FieldError, SlimlmError
from slimlm.formats import atomic
from slimlm.jobs import JOBS, STEPS, Job
from slimlm.jobs.options import OptionError

FIELDS = ("model", "runs", "eval", "bench", "report", "notes", "stages")
SET_BY_RECIPE = ("model", "out", "output", "json", "json_path", "baseline", "overwrite")
STAGE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")  # one directory under runs/, never a path


@dataclass
class Step:
    command: str
    options: dict


@dataclass
class Recipe:
    path: Path
    model: str
    runs: Path
    eval: dict
    bench: dict
    report: Path | None
    stages: dict[str, list[Step]]
    notes: str = ""  # shown at the top of the report (e.g. how short its eval and bench are)


def _lines(node, path: str = "", out: dict | None = None) -> dict[str, int]:
    """The line (1-based) of every field of a composed YAML document, by dotted path."""
    out = {} if out is None else out
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:  # a field's line is its value's (where a wrong value is)
            _lines(value, f"{path}.{key.value}".lstrip("."), out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _lines(item, f"{path}.{i}".lstrip("."), out)
    return out


MAX_VALUES = 100_000  # values a recipe may hold once its aliases are expanded (a real one holds a few hundred)


def _expanded(root, path: Path) -> None:
    """Refuse, before anything walks the document, aliases that expand past MAX_VALUES (an alias bomb: ten
    aliases of ten aliases of ... ) or that hold themselves (`&n [*n]`). Counts each shared node once per use,
    remembering the counts, so the check itself takes time in the size of the text."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise SlimlmError(f"{path}:{node.start_mark.line + 1}: an alias refers to the value that holds it")
        open_nodes.add(id(node))
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else node.value
        total = 1 + (sum(size(c) for c in children) if isinstance(node, yaml.CollectionNode) else 0)
        open_nodes.discard(id(node))
        if total > MAX_VALUES:
            raise SlimlmError(f"{path}: its aliases expand to more than {MAX_VALUES:,} values; write them out")
        sizes[id(node)] = total
        return total

    size(root)


def _unshared(value):
    """A copy in which every alias is a value of its own: `--set` on one stage must not change another that
    shared an anchor with it."""
    if isinstance(value, dict):
        return {k: _unshared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshared(v) for v in value]
    return value


def _problem(e: yaml.YAMLError) -> str:
    """What the YAML parser objects to, on one line."""
    return " ".join(str(getattr(e, "problem", None) or e).split())


def _shown(text: str) -> str:
    """User text inside a one-line message: quoted and escaped when it holds a newline or another control."""
    return text if text.isprintable() else repr(text)


def _override(data: dict, assignment: str) -> None:
    """`--set a.b=value`: the value as YAML, at a path whose parent exists (a list's items by index)."""
    key, sep, text = assignment.partition("=")
    shown = _shown(key)
    if not sep or not key:
        raise SlimlmError(f"--set {assignment!r}: use --set FIELD=VALUE, e.g. --set eval.limit=10")
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError as e:
        raise SlimlmError(f"--set {shown}: the value is not valid YAML ({_problem(e)})") from None
    parts = key.split(".")
    target = data
    for depth, part in enumerate(parts, 1):
        if isinstance(target, list) and not (part.isdigit() and int(part) < len(target)):
            raise SlimlmError(f"--set {shown}: {part!r} is not an item there (a list of {len(target)}, from 0)")
        at_leaf = depth == len(parts)
        if not isinstance(target, dict | list) or (not at_leaf and isinstance(target, dict) and part not in target):
            raise SlimlmError(f"--set {shown}: the recipe has no field {part!r} there")
        index = int(part) if isinstance(target, list) else part
        if at_leaf:
            target[index] = value
        else:
            target = target[index]


def _stages(stages: dict, fail) -> dict[str, list[Step]]:
    """The stages' steps, each a plain stage name and a list of one-command steps (`fail(field, message)`)."""
    parsed: dict[str, list[Step]] = {}
    for name, steps in stages.items():
        field = f"stages.{_shown(name) if isinstance(name, str) else name}"
        if not isinstance(name, str) or not STAGE_NAME.fullmatch(name):  # never "." or "..": a letter first
            fail(field, f"a stage name is a plain name (letters, digits, '.', '_', '-'), got {name!r}")
        if not isinstance(steps, list | type(None)):
            fail(field, "a list of steps, e.g. [{gptq: {bits: 4}}] ([] for the source itself)")
        parsed[name] = []
        for i, step in enumerate(steps or []):
            if not isinstance(step, dict) or len(step) != 1:
                fail(f"{field}.{i}", "a step is one command with its options, e.g. {gptq: {bits: 4}}")
            ((command, options),) = step.items()
            if command not in STEPS:
                fail(f"{field}.{i}", f"unknown step {command!r} (steps: {', '.join(STEPS)})")
            options = options or {}
            if not isinstance(options, dict):
                fail(f"{field}.{i}.{command}", "options are a mapping, e.g. {bits: 4, group_size: 64}")
            parsed[name].append(Step(command, options))
    return parsed


def load(path: Path, overrides: list[str] = ()) -> Recipe:
    """Read and check a recipe (every step's options as its command's job) without running it."""
    path = Path(path)
    if not path.is_file():
        raise SlimlmError(f"recipe {path} does not exist")
    text = path.read_text()
    try:
        root = yaml.compose(text)
        if root is not None:
            _expanded(root, path)
        lines = _lines(root) if root is not None else {}
        data = _unshared(yaml.safe_load(text))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise SlimlmError(f"{where}: not valid YAML ({_problem(e)})") from None
    if not isinstance(data, dict):
        raise SlimlmError(f"{path}: a recipe is a mapping with the fields {', '.join(FIELDS)}")
    for assignment in overrides:
        _override(data, assignment)

    def where(field: str) -> str:
        touched = [o for o in overrides if o.partition("=")[0].startswith(field)] if field else []
        known = field
        while known and known not in lines:  # a field the YAML does not spell out: its parent's line
            known = known.rpartition(".")[0]
        place = f"{path}:{lines[known]}" if known else str(path)
        return place + (f" (with --set {', '.join(map(_shown, touched))})" if touched else "")

    def fail(field: str, message: str):  # field "": the recipe as a whole
        raise SlimlmError(f"{where(field)}: {field + ': ' if field else ''}{message}")

    for key in data:
        if key not in FIELDS:
            fail(key, f"unknown field (a recipe has {', '.join(FIELDS)})")
    for key in ("model", "runs"):
        if not isinstance(data.get(key), str) or not data[key]:
            fail(key, "required: a string") if key in data else fail("", f"the field {key!r} is required")
    if data.get("report") is not None and not (isinstance(data["report"], str) and data["report"]):
        fail("report", "a file path, e.g. out/runs/report.html")
    for key in ("eval", "bench"):
        if not isinstance(data.get(key) or {}, dict):
            fail(key, f"a mapping of `compress {key}` options")
    stages = data.get("stages")
    if not isinstance(stages, dict) or not stages:
        fail("stages" if "stages" in data else "", "'stages' is required: a mapping of stage names to steps")
    if Path(data["runs"]).exists() and not Path(data["runs"]).is_dir():
        fail("runs", f"{data['runs']} exists and is not a directory")
    parsed = _stages(stages, fail)
    report = Path(data["report"]) if data.get("report") else None
    recipe = Recipe(
        path,
        data["model"],
        Path(data["runs"]),
        data.get("eval") or {},
        data.get("bench") or {},
        report,
        parsed,
        str(data.get("notes") or ""),
    )
    step = {"model": "model", "out": Path("out")}
    parts = [
        (f"stages.{name}.{i}.{s.command}", s.command, s.options, step)
        for name, steps in parsed.items()
        for i, s in enumerate(steps)
    ] + [("eval", "eval", recipe.eval, {}), ("bench", "bench", recipe.bench, {})]
    for field, command, options, placeholders in parts:  # every step's job, checked now, before any work
        try:
            job(command, options, **{"model": recipe.model, **placeholders})
        except OptionError as e:
            fail(f"{field}.{e.field}", e.problem)
    for name in parsed:  # a stage directory holding what the recipe did not write is refused now, not mid-run
        _state(recipe, name)
    return recipe


def check(recipe: Recipe) -> None:
    """Every check the run's jobs make before their work, now: the source model, its data, the devices, what
    the first step of each stage does to the source, the eval's text and window, and that runs: can be written.
    Later steps read an output that does not exist yet: their options were checked by load()."""
    from slimlm import models

    ancestor = recipe.runs.resolve()
    while not ancestor.exists():
        ancestor = ancestor.parent
    try:  # by trying: permission bits say nothing to root, and /proc or a read-only mount refuse anyway
        os.rmdir(tempfile.mkdtemp(dir=ancestor, prefix=".slimlm-check-"))
    except OSError as e:
        raise SlimlmError(f"{recipe.path}: runs: {recipe.runs} cannot be written ({ancestor}: {e.strerror})") from None
    try:
        models.check(models.resolve(recipe.model))
    except SlimlmError as e:
        raise SlimlmError(f"{recipe.path}: model: {_said(e)}") from None
    parts = [(f"stages.{name}.0.{steps[0].command}", steps[0]) for name, steps in recipe.stages.items() if steps]
    for field, step in parts:
        try:
            job(step.command, step.options, model=recipe.model, out=recipe.runs / "check").check()
        except SlimlmError as e:
            raise SlimlmError(f"{recipe.path}: {field}: {_said(e)}") from None
    for part, options in (("eval", recipe.eval), ("bench", recipe.bench)):
        try:
            job(part, options, model=recipe.model).check()
        except SlimlmError as e:
            raise SlimlmError(f"{recipe.path}: {part}: {_said(e)}") from None


def _said(e: SlimlmError) -> str:
    """An error as a recipe names fields: by their names (a FieldError's {field} placeholders)."""
    return e.render(lambda name: name) if isinstance(e, FieldError) else str(e)


def inputs(recipe: Recipe) -> list[Path]:
    """The files the recipe's report reads: never a place for the report itself."""
    return [recipe.runs / name / f for name in recipe.stages for f in ("eval.json", "bench.json", "run.json")]


def job(command: str, options: dict, **set_by_recipe) -> Job:
    """A step's (or eval's, bench's) job from its options and what the recipe sets; OptionError names a field."""
    for key in options:
        if key in SET_BY_RECIPE:
            raise OptionError("", key, "set by the recipe; leave it out")
    return JOBS[command].from_options({**options, **set_by_recipe})


def _hash(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _fingerprint(model: str) -> str:
    """What identifies a stage's input: the spec, and for a local directory its weight files' sizes and times."""
    path = Path(model)
    if not path.is_dir():
        return model
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json"))
    return _hash(str(path.resolve()), [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files])


def _output_hash(path: Path) -> str | None:
    """What a stage's output is now (each file's name, size and time), None when it does not exist: recorded in
    run.json when the recipe writes it, compared before the recipe replaces or reuses it."""
    if not path.exists():
        return None
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return _hash([(str(p.relative_to(path.parent)), p.stat().st_size, p.stat().st_mtime_ns) for p in files])


def run(recipe: Recipe, progress: bool = True) -> list[Path]:
    """Run every stage not already done; returns the run directories, in the recipe's order. The stage
    directories are held (atomic.claim) for the whole run: a second recipe or command writing there is refused."""

    def log(message: str) -> None:
        if progress:
            print(f"[recipe] {message}", file=sys.stderr, flush=True)

    produced: dict[str, str] = {}  # step-chain hash -> its output: a chain two stages share runs once
    with atomic.claim([recipe.runs / name for name in recipe.stages]):
        return [_run_stage(recipe, name, steps, log, produced) for name, steps in recipe.stages.items()]


def _state(recipe: Recipe, name: str) -> dict:
    """What the stage's earlier runs recorded, {} for a new stage. A directory that holds anything else is
    refused: the recipe replaces its outputs, so it must only ever find its own there — a run.json of this
    stage written by this recipe file (an edited recipe redoes what changed; another recipe is refused)."""
    run_dir = recipe.runs / name
    state_path = run_dir / "run.json"
    if state_path.is_file():
        try:
            state = json.loads(state_path.read_text())
        except (OSError, ValueError):
            state = None
        if isinstance(state, dict) and state.get("name") == name and isinstance(state.get("recipe"), str):
            writer = state["recipe"]
            if writer != str(recipe.path.resolve()):
                raise SlimlmError(
                    f"{run_dir} was written by the recipe {writer}; point runs: at another directory (or run that "
                    "recipe)"
                )
            return state
    if run_dir.is_dir() and any(run_dir.iterdir()):
        raise SlimlmError(
            f"{run_dir} holds files this recipe did not write (no run.json of stage {name!r} by this recipe); "
            "point runs: at a new directory or move them away"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise SlimlmError(f"{run_dir} exists and is not a directory; point runs: elsewhere")
    return {}


def _run_stage(recipe: Recipe, name: str, steps: list[Step], log, produced: dict[str, str]) -> Path:
    run_dir = recipe.runs / name
    state_path = run_dir / "run.json"
    state = _state(recipe, name)
    state = state or {"name": name}
    done, outputs = state.setdefault("hashes", {}), state.setdefault("outputs", {})
    model, key = recipe.model, _hash(recipe.model, _fingerprint(recipe.model))

    def save() -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic.write_file(state_path, json.dumps(state, indent=1), True, "run.json")

    if "recipe" not in state:  # claimed before any work, so a run killed later still owns the directory
        state["recipe"] = str(recipe.path.resolve())
        save()

    def own(output: Path) -> bool:
        """Whether `output` exists as this recipe left it; anything else there stops the recipe in one line."""
        now, recorded = _output_hash(output), outputs.get(output.name, {})
        if now is not None and recorded.get("hash") not in (now, "writing"):
            what = "changed since this recipe wrote it" if recorded else "was not written by this recipe"
            raise SlimlmError(f"{output} {what}; move it away, or point runs: at a new directory")
        return now is not None and recorded.get("hash") == now

    def write(output: Path, part: str, value: str, job_: Job) -> None:
        own(output)
        source = hashlib.sha256(recipe.path.read_bytes()).hexdigest()  # the recipe's text that wrote it
        outputs[output.name] = {"hash": "writing", "recipe_sha256": source}  # a killed job's output is ours
        save()
        job_.run()
        done[part], outputs[output.name]["hash"] = value, _output_hash(output)
        save()

    for i, step in enumerate(steps):
        out = run_dir / ("model" if i == len(steps) - 1 else f"step{i}-{step.command}")
        key = _hash(key, step.command, step.options)
        if key in produced and i < len(steps) - 1:
            log(f"{name}: step {i + 1}/{len(steps)} {step.command}: the same as {produced[key]}, reused")
            out = Path(produced[key])
        elif done.get(f"step{i}") == key and own(out):
            log(f"{name}: step {i + 1}/{len(steps)} {step.command}: done before, skipped")
        else:
            log(f"{name}: step {i + 1}/{len(steps)} {step.command} {step.options or ''}")
            write(out, f"step{i}", key, job(step.command, step.options, model=model, out=out, overwrite=True))
        produced.setdefault(key, str(out))
        model = str(out)
    if done.get("model") != key or state.get("model") != model:
        done["model"], state["model"] = key, model
        save()
    for part, options, target in (("eval", recipe.eval, "eval.json"), ("bench", recipe.bench, "bench.json")):
        part_key = _hash(key, part, options)
        if done.get(part) == part_key and own(run_dir / target):
            log(f"{name}: {part}: done before, skipped")
            continue
        log(f"{name}: {part}")
        destination = (
            {"output": run_dir / target}
            if part == "eval"
            else {  # the run directory is this stage's (_state)
                "json_path": run_dir / target,
                "baseline": recipe.model if steps else "none",
            }
        )
        write(run_dir / target, part, part_key, job(part, options, model=model, overwrite=True, **destination))
    return run_dir
