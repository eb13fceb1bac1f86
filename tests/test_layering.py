"""Dependencies point down (cli → compress/train/serve/eval → runtime → kernels → formats): each package imports in a
fresh interpreter where every package above it is blocked, so a reach upward (or a cycle) fails here."""

import subprocess
import sys

ALL = {"slimlm.formats", "slimlm.kernels", "slimlm.runtime", "slimlm.compress", "slimlm.eval", "slimlm.serve",
       "slimlm.train",
       "slimlm.cli", "slimlm.models", "slimlm.assets", "slimlm.data", "slimlm.arch", "slimlm.hub",
       "slimlm.devices"}  # fmt: skip
ALLOWED = {  # package: what it may import besides itself and the slimlm root
    "slimlm.formats": set(),
    "slimlm.kernels": {"slimlm.formats"},
    "slimlm.runtime": {"slimlm.formats", "slimlm.kernels", "slimlm.models", "slimlm.assets", "slimlm.hub",
                       "slimlm.devices"},  # fmt: skip
    "slimlm.compress": {"slimlm.formats", "slimlm.models", "slimlm.assets", "slimlm.hub", "slimlm.devices",
                        "slimlm.data", "slimlm.arch"},  # fmt: skip
    # train uses compress's calibration pipeline (pruning scores units on it)
    "slimlm.train": {"slimlm.formats", "slimlm.models", "slimlm.assets", "slimlm.hub", "slimlm.devices",
                     "slimlm.data", "slimlm.arch", "slimlm.compress"},  # fmt: skip
    "slimlm.serve": {"slimlm.runtime", "slimlm.formats", "slimlm.kernels", "slimlm.models", "slimlm.assets",
                     "slimlm.hub", "slimlm.devices"},  # fmt: skip
}
# One interpreter checks the packages bottom-up (torch and transformers load once); before each check every
# module of a blocked package is dropped from sys.modules, so a reach upward meets the blocker.
CHILD = """
import importlib, importlib.abc, pkgutil, sys
blocked = set()
def is_blocked(name):
    return any(name == b or name.startswith(b + ".") for b in blocked)
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if is_blocked(name):
            raise ImportError(f"{package} imports {name}, which sits above it")
sys.meta_path.insert(0, Block())
for arg in sys.argv[1:]:
    package, others = arg.split("=")
    blocked = set(others.split(","))
    for name in [m for m in sys.modules if is_blocked(m)]:
        del sys.modules[name]
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        importlib.import_module(info.name)
"""
ORDER = ["slimlm.formats", "slimlm.kernels", "slimlm.runtime", "slimlm.compress", "slimlm.train",
         "slimlm.serve"]  # bottom-up


def check(packages: list[str]) -> subprocess.CompletedProcess:
    args = [f"{p}={','.join(sorted(ALL - ALLOWED[p] - {p}))}" for p in packages]
    return subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=120)


def test_packages_import_nothing_above_them():
    proc = check(ORDER)
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1]


def test_a_reach_upward_is_caught(monkeypatch):
    monkeypatch.setitem(ALLOWED, "slimlm.runtime", ALLOWED["slimlm.runtime"] - {"slimlm.models"})
    proc = check(ORDER)
    assert proc.returncode != 0 and "slimlm.runtime imports slimlm.models" in proc.stderr
