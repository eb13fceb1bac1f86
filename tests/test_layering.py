"""Dependencies point down, and nothing imports in a circle. Read from the source (every `import`, including
those inside functions), not by importing it, so an import that runs late or only on one path counts too.

Each unit (a package under slimlm/, or a top-level module) sits on a layer and may import only units on lower
layers; within a unit, no module may reach itself again through its imports."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "slimlm"
LAYERS = [  # bottom-up
    {"slimlm.errors", "slimlm.cache", "slimlm.version", "slimlm.arch"},
    {"slimlm.formats", "slimlm.hub"},
    {"slimlm.kernels", "slimlm.assets"},
    {"slimlm.devices", "slimlm.models", "slimlm.data"},
    {"slimlm.runtime", "slimlm.compress"},
    {"slimlm.train", "slimlm.eval", "slimlm.serve"},  # train uses compress's calibration pipeline
    {"slimlm.perf"},  # compress bench: times the runtime, reads eval's bandwidth model
    {"slimlm.jobs"},  # every command as a typed job: what the CLI, recipes and the Python API share
    {"slimlm.recipe"},
    {"slimlm.cli"},
    {"slimlm"},  # the package's own namespace: `from slimlm import LLM` loads the runtime on first use
]


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the slimlm modules it imports anywhere in its source."""
    paths = {module_name(p, package): p for p in package.rglob("*.py")}

    def resolve(name: str) -> str | None:  # the module an import loads: `slimlm.a.b.Name` -> slimlm.a.b
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in paths.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "slimlm"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package `level - 1` above this one
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                if base.split(".")[0] == "slimlm":
                    found |= {resolve(f"{base}.{a.name}") for a in node.names}
        graph[module] = found - {module, None}
    return graph


def unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layer_of(module: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit(module) in layer)


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {t}"
        for m, targets in graph.items()
        for t in targets
        if unit(t) != unit(m) and layer_of(t) >= layer_of(m)
    )


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_every_unit_has_a_layer():
    assert [m for m in import_graph() if not any(unit(m) in layer for layer in LAYERS)] == []


def test_nothing_imports_a_unit_on_its_own_layer_or_above():
    assert upward_edges(import_graph()) == []


def test_no_module_reaches_itself_through_its_imports():
    assert cycles(import_graph()) == []


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "slimlm" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "slimlm"


@pytest.mark.parametrize("where", ["at the top", "inside a function"])
def test_a_reach_upward_and_a_cycle_are_caught(tmp_path, where):
    line = "from slimlm.runtime.engine import Engine"
    upward = line if where == "at the top" else f"def f():\n    {line}\n"
    graph = import_graph(
        write_package(
            tmp_path,
            {
                "__init__.py": "",
                "formats/__init__.py": "",
                "formats/reader.py": upward,
                "runtime/__init__.py": "",
                "runtime/engine.py": "from .draft import Draft\n",
                "runtime/draft.py": "from ..runtime import engine\nfrom slimlm.formats.reader import x\n",
            },
        )
    )
    assert graph["slimlm.runtime.draft"] == {"slimlm.runtime.engine", "slimlm.formats.reader"}
    assert upward_edges(graph) == ["slimlm.formats.reader imports slimlm.runtime.engine"]
    assert cycles(graph) == [{"slimlm.formats.reader", "slimlm.runtime.engine", "slimlm.runtime.draft"}]
