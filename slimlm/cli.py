"""The `compress` command: one subcommand per job (slimlm.jobs), plus `recipe` and `lm-eval`."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import signal
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from slimlm.errors import FieldError, SlimlmError
from slimlm.jobs import JOBS
from slimlm.jobs.options import add_arguments, flag_of, from_args

NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compress", description="Compress, measure and serve LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, job in JOBS.items():
        p = sub.add_parser(name, help=job.help, description=job.help)
        # a negative number in exponent form (--float-target -1e-9) is a value, not a flag: its range check says
        # what is wrong with it, where argparse's own pattern (-1, -.5 only) answered "expected one argument"
        p._negative_number_matcher = NEGATIVE_NUMBER  # noqa: SLF001
        add_arguments(p, job)

    p = sub.add_parser(
        "recipe",
        help="run a YAML recipe: compression stages, then eval, bench and the report (stages already done are skipped)",
    )
    p.add_argument("recipe", type=Path, help="e.g. recipes/default.yaml")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a field, e.g. --set eval.limit=10 (repeatable)",
    )
    p.add_argument("--check", action="store_true", help="validate the recipe and stop")

    p = sub.add_parser(
        "lm-eval", help="lm-eval's own command line with the slimlm model and task pack registered", add_help=False
    )
    p.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="lm-eval arguments, e.g. --model slimlm --model_args pretrained=DIR --tasks slimlm_tasks",
    )
    return parser


def cmd_recipe(a: argparse.Namespace) -> None:
    from slimlm import recipe as recipes
    from slimlm.eval import report
    from slimlm.formats import atomic

    recipe = recipes.load(a.recipe, a.overrides)
    if recipe.report is not None:  # before any stage runs: its own earlier report, or no file there
        try:
            atomic.check_file(recipe.report, True, "report", recipes.inputs(recipe))
        except SlimlmError as e:
            raise SlimlmError(f"{a.recipe}: {e}") from None
    recipes.check(recipe)
    if a.check:
        steps = sum(len(s) for s in recipe.stages.values())
        print(f"{a.recipe}: {len(recipe.stages)} stages, {steps} steps: valid")
        return
    with atomic.claim([recipe.report] if recipe.report else []):
        run_dirs = recipes.run(recipe)
        if recipe.report is None:
            return
        result = report.render(
            run_dirs,
            recipe.report,
            title=f"slimlm: {recipe.path.name} on {recipe.model}",
            notes=recipe.notes,
            overwrite=True,
        )
    print(report.main_table(result["runs"]))
    print(f"report: {recipe.report.resolve()}")


def cmd_lm_eval(a: argparse.Namespace) -> None:
    import lm_eval.__main__

    import slimlm.eval.lm_eval_model  # noqa: F401  registers --model slimlm
    from slimlm.eval import taskpack

    args = list(a.args)
    if "--include_path" not in args:
        args += ["--include_path", str(taskpack.TASKS_DIR)]
    sys.argv = ["lm-eval", *args]
    lm_eval.__main__.cli_evaluate()


def run_job(a: argparse.Namespace) -> None:
    from_args(JOBS[a.command], a).run()


COMMANDS = {**{name: run_job for name in JOBS}, "recipe": cmd_recipe, "lm-eval": cmd_lm_eval}


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
    except FieldError as e:  # named by its field: said as this command's flag
        print(f"error: {e.render(flag_of(JOBS.get(a.command)))}", file=sys.stderr)
        return 2
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
