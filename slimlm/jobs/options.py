"""A job's options, declared once: each field's type, default, check and help text.

The command line, recipes and the Python API are all generated from these declarations: `add_arguments`
makes a subcommand's flags, `Job.from_options` checks a recipe step's mapping, and constructing a job in
Python checks it the same way (the same parse functions, the same messages). A field's `Opt` says how it
looks on the command line; the parse functions turn text (or a YAML/Python value written as text) into the
field's value and say in one line what is wrong.
"""

from __future__ import annotations

import argparse
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from slimlm.errors import FieldError, SlimlmError
from slimlm.formats import atomic

DTYPE_CHOICE = ("auto", "float32", "bfloat16")  # devices.COMPUTE_DTYPES, without importing torch


@dataclass(frozen=True)
class Switch:
    """A flag that sets its field to a constant, exclusive with the field's own flag (--asym, --no-clip)."""

    flag: str
    value: Any
    help: str


@dataclass(frozen=True)
class Opt:
    help: str = ""
    parse: Callable[[str], Any] | None = None  # text -> value; a ValueError says what is wrong
    choices: tuple | None = None
    positional: bool = False
    flag: str | None = ""  # "" : --field-name; None: no flag of its own (only switches)
    switches: tuple[Switch, ...] = ()
    nargs: str | None = None  # "*" a list of words; "?" the flag alone means `const`
    repeat: bool = False  # the flag may be given again, each time one more item of a list
    const: Any = None
    metavar: str | None = None
    output: str | None = None  # "file" or "dir": the field names what the job writes (Job.run claims it)

    def check(self, value: Any) -> Any:
        """A recipe's or caller's value, checked as the command line checks its text."""
        if any(value == s.value and type(value) is type(s.value) for s in self.switches):
            return value  # what a switch sets (0: a float lm_head) is not one of the flag's own choices
        if self.parse is not None and value is not None and not isinstance(value, bool):
            if isinstance(value, list | tuple):
                value = ",".join(map(str, value))  # a YAML list is the flag's comma-separated text
            if isinstance(value, str | int | float):
                value = self.parse(str(value))
        if self.choices is not None and value is not None and value not in self.choices:
            raise ValueError(f"invalid choice: {value!r} (choose from {', '.join(map(repr, self.choices))})")
        return value


class OptionError(SlimlmError):
    """A job's option that is wrong: which (`field`, a dotted path) and why, for each front end to place."""

    def __init__(self, where: str, field: str, problem: str) -> None:
        super().__init__(".".join(p for p in (where, field) if p) + f": {problem}")
        self.field, self.problem = field, problem


class Job(BaseModel):
    """One command's options. Subclasses set `command` and `help`, declare fields with `Opt`s, and run()."""

    model_config = ConfigDict(
        extra="forbid", arbitrary_types_allowed=True, validate_default=False, validate_assignment=True
    )
    command: ClassVar[str]
    help: ClassVar[str]

    @classmethod
    def opts(cls) -> dict[str, Opt]:
        return {
            name: next((m for m in f.metadata if isinstance(m, Opt)), Opt()) for name, f in cls.model_fields.items()
        }

    def __init__(self, **values: Any) -> None:
        """A job from Python: the same checks as the command line's, and a wrong value is one line naming the
        field (an OptionError), as from run() or a recipe."""
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise _option_error(e, "", type(self)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        """`job.bits = 5`: checked as the constructor checks it (`job.model = None` would fail later, in run)."""
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise _option_error(e, "", type(self)) from None

    @model_validator(mode="before")
    @classmethod
    def _check_values(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        opts = cls.opts()
        checked = {}
        for name, value in values.items():
            if isinstance(value, bool) and name in cls.model_fields and not _takes_bool(cls.model_fields[name]):
                raise ValueError(f"{name}: {value} is not a value of this option (true/false only sets switches)")
            try:
                checked[name] = opts[name].check(value) if name in opts else value
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise ValueError(f"{name}: {e}") from None
        return checked

    @classmethod
    def from_options(cls, options: dict, where: str = "") -> Job:
        """A recipe step or an API call's mapping -> the job, or one line naming the field that is wrong.
        A switch may be named too (`asym: true`, `no_clip: true`), as on the command line."""
        switches = {
            s.flag.lstrip("-").replace("-", "_"): (name, s.value) for name, o in cls.opts().items() for s in o.switches
        }
        values = {}
        for key, value in options.items():
            if key in switches and key not in cls.model_fields:
                if value is True:
                    field, value = switches[key]
                    values[field] = value
                elif value is not False and value is not None:
                    raise OptionError(where, key, f"true or false, got {value!r}")
                continue
            values[key] = value
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise _option_error(e, where, cls) from None
        except OptionError as e:  # pydantic validates through __init__ when a model defines one
            raise OptionError(where, e.field, e.problem) from None
        except FieldError as e:  # a job's own check across fields (FieldError passes through pydantic)
            raise OptionError(where, e.field, e.render(lambda name: name).removeprefix(f"{e.field} ")) from None

    def inputs(self) -> list[Path]:
        """Files the job reads that its output files must never be (compress report's run files)."""
        return []

    def run(self) -> Any:
        """Do the job: first hold every output it names (atomic.claim: one writer per path, for the whole run)
        and refuse any output file that would lose data, then execute()."""
        outputs = [(name, o.output, getattr(self, name)) for name, o in self.opts().items() if o.output]
        outputs = [(name, kind, path) for name, kind, path in outputs if path is not None]
        with atomic.claim([path for _, _, path in outputs]):
            for name, kind, path in outputs:
                if kind == "file":  # a checkpoint dir is checked by its writer, against its sources
                    atomic.check_file(path, getattr(self, "overwrite", False), name, self.inputs())
            return self.execute()

    def check(self) -> None:
        """What execute() checks before its work, without the work (the model, data, device as far as they can
        be known up front): `compress recipe --check` runs it for every step. Jobs add to it."""

    def execute(self) -> Any:
        raise NotImplementedError


def _takes_bool(field) -> bool:
    """Whether a field's type admits True/False (pydantic would otherwise read True as 1 for an int)."""

    def admits(annotation) -> bool:
        return annotation is bool or any(admits(a) for a in typing.get_args(annotation))

    return admits(field.annotation)


def _option_error(error: ValidationError, where: str, cls: type[Job]) -> OptionError:
    first = error.errors()[0]
    field = ".".join(map(str, first["loc"]))
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = f"unknown option (`compress {cls.command}` takes {', '.join(cls.model_fields)})"
    elif first["type"] == "missing":
        message = "required"
    if not field and ": " in message:  # raised by our before-validator: "field: what is wrong"
        field, message = message.split(": ", 1)
    return OptionError(where, field, message)


def add_arguments(parser: argparse.ArgumentParser, job: type[Job]) -> None:
    """The job's fields as flags (or positional arguments), with their checks as argparse types."""
    for name, field in job.model_fields.items():
        opt = job.opts()[name]
        kwargs: dict[str, Any] = {"help": _escaped(opt.help) or None}
        if opt.parse is not None:
            kwargs["type"] = _argparse_type(opt.parse)
        if opt.choices is not None:
            kwargs["choices"] = opt.choices
        if opt.metavar:
            kwargs["metavar"] = opt.metavar
        if opt.positional:
            parser.add_argument(name, nargs=opt.nargs, **kwargs)
            continue
        target = parser.add_mutually_exclusive_group() if opt.switches else parser
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        if opt.flag is not None:
            flag = opt.flag or "--" + name.replace("_", "-")
            if field.annotation in (bool, "bool"):
                kwargs = {"help": _escaped(opt.help), "action": "store_true"}
            elif opt.nargs:
                kwargs.update(nargs=opt.nargs, const=opt.const)
            elif opt.repeat:
                kwargs["action"] = "append"
            target.add_argument(flag, dest=name, required=field.is_required(), **kwargs)
        for s in opt.switches:
            target.add_argument(s.flag, dest=name, action="store_const", const=s.value, help=_escaped(s.help))
        parser.set_defaults(**{name: default})


def _escaped(text: str) -> str:
    """Help text as argparse wants it: it formats help with %, so a plain 19% is written 19%% there only."""
    return text.replace("%", "%%")


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__  # argparse names the type in "invalid <name> value"
    return convert


def flag_of(job: type[Job] | None) -> Callable[[str], str]:
    """Field name -> the command-line flag that sets it (a positional argument, or a name the job does not
    have, stays as it is): how the CLI says the fields a FieldError names."""
    opts = job.opts() if job is not None else {}

    def flag(field: str) -> str:
        opt = opts.get(field)
        if opt is None or opt.positional:
            return field
        if opt.flag is None:  # set by switches only (--no-clip)
            return opt.switches[0].flag
        return opt.flag or "--" + field.replace("_", "-")

    return flag


def from_args(job: type[Job], args: argparse.Namespace) -> Job:
    """The parsed command line -> the job (its values already checked by the flags' types). A value equal to
    the field's default is left out, so that the job's `model_fields_set` holds what the user changed."""
    values = {}
    for name, field in job.model_fields.items():
        value = getattr(args, name)
        if field.is_required() or value != field.get_default(call_default_factory=True):
            values[name] = value
    return job.model_validate(values)


# The parse functions: text -> value, or a ValueError whose message follows the text it quotes.


def quoted(text: str) -> str:
    """User text inside a one-line message: in quotes, escaped (repr) when it holds a newline or another control."""
    return f"'{text}'" if text.isprintable() else repr(text)


def _number(cast: type, text: str, ok: Callable | None = None, requirement: str = ""):
    """int(text) or float(text), then `ok(value)`; a ValueError saying which failed."""
    try:
        value = cast(text)
    except ValueError:
        raise ValueError(f"{quoted(text)} is not {'an integer' if cast is int else 'a number'}") from None
    if ok is not None and not ok(value):
        raise ValueError(f"{quoted(text)} {requirement}")
    return value


def integer(text: str) -> int:
    return _number(int, text)


def positive_int(text: str) -> int:
    return _number(int, text, lambda v: v > 0, "must be a positive integer")


def nonnegative_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 0, "must be 0 or a positive integer")


def window_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 2, "must be at least 2: a window needs at least 2 tokens (one to predict)")


def seed_int(text: str) -> int:
    return _number(int, text, lambda v: 0 <= v < 2**63, "must be in [0, 2^63)")


def finite_float(text: str) -> float:
    return _number(float, text, math.isfinite, "must be a finite number")


def unit_float(text: str) -> float:
    return _number(float, text, lambda v: 0 <= v <= 1, "must be in [0, 1]")


def open_unit_float(text: str) -> float:
    return _number(float, text, lambda v: 0 < v < 1, "must be in (0, 1)")


def float_between(lo: float, hi: float, unit: str = "") -> Callable[[str], float]:
    """A parse function for numbers in [lo, hi]."""

    def parse(text: str) -> float:
        return _number(float, text, lambda v: lo <= v <= hi, f"must be between {lo:g} and {hi:g}{unit}")

    return parse


def positive_float(text: str) -> float:
    return _number(float, text, lambda v: v > 0, "must be positive")  # nan is not


def limit_arg(text: str) -> int | float:
    """lm-eval's --limit: a document count (>= 1) or a fraction of each task in (0, 1)."""
    value = _number(float, text)
    if 1 <= value <= 1e9 and value == int(value):  # a count past any task's size: still a count, not 1e30
        return int(value)
    if 0 < value < 1:
        return value
    raise ValueError(f"{quoted(text)} must be a document count from 1 to 1e9 or a fraction in (0, 1)")


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{quoted(text)}: give positive integers separated by commas, e.g. 1,8,32")
    return values


def span(text: str) -> tuple[int, int]:
    values = int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise ValueError(f"{quoted(text)}: give LO,HI with LO <= HI, e.g. 64,256")
    return values[0], values[1]


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GB' or a byte count -> bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = float(number) * units[unit]
        size = int(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{quoted(text)} is not a size; write e.g. 512M or 2G") from None
    if size != value:  # 1.5 bytes: a typo for 1.5G, not a pool of one byte
        raise ValueError(f"{quoted(text)} is not a whole number of bytes; write e.g. 1.5G or 512M")
    if size <= 0:
        raise ValueError(f"{quoted(text)} must be a positive size")
    return size
