"""The exception types every layer raises for a problem the user can fix."""

from __future__ import annotations

from collections.abc import Callable


class SlimlmError(Exception):
    """A problem the user can fix. The CLI prints its message as one line and exits non-zero."""


class FieldError(SlimlmError):
    """A setting that is wrong, named by its field (a job's option, e.g. "group_size"): the message is the field
    followed by `problem`, which may name fields as {field} (and then need not start with its own). Each front
    end says the names its way: the CLI as its flags (--group-size), recipes and Python as the fields."""

    def __init__(self, field: str, problem: str) -> None:
        self.field, self.problem = field, problem
        super().__init__(self.render(lambda name: name))

    def render(self, name: Callable[[str], str]) -> str:
        """The message with every field named by `name(field)`."""
        text = self.problem.format_map(_Names(name))
        return text if "{" + self.field + "}" in self.problem else f"{name(self.field)} {text}"


class _Names(dict):
    def __init__(self, name: Callable[[str], str]) -> None:
        super().__init__()
        self.name = name

    def __missing__(self, key: str) -> str:
        return self.name(key)
