"""Functions a reader can hold in their head: at most 80 lines and 8 parameters. The kernels are the one
exception: a Triton kernel's or a C kernel's wrapper takes the tensors, strides and sizes its launch needs
(their signatures mirror the kernels' own, and splitting them would only hide the arguments)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "slimlm"
EXEMPT = PACKAGE / "kernels"
MAX_LINES, MAX_PARAMS = 80, 8


def oversized() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if EXEMPT in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
            params = [p for p in params if p.arg not in ("self", "cls")]
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES or len(params) > MAX_PARAMS:
                found.append(
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {lines} lines, "
                    f"{len(params)} parameters"
                )
    return found


def test_no_function_outside_the_kernels_is_too_long_or_takes_too_many_parameters():
    assert oversized() == []
