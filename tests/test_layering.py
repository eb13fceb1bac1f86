"""Dependencies point down (cli → compress/eval → runtime → kernels → formats): each package imports in a
fresh interpreter where every package above it is blocked, so a reach upward (or a cycle) fails here."""

import subprocess
import sys

import pytest

ALL = {"slimlm.formats", "slimlm.kernels", "slimlm.runtime", "slimlm.compress", "slimlm.eval", "slimlm.cli",
       "slimlm.models", "slimlm.assets", "slimlm.data", "slimlm.arch", "slimlm.hub", "slimlm.devices"}  # fmt: skip
ALLOWED = {  # package: what it may import besides itself and the slimlm root
    "slimlm.formats": set(),
    "slimlm.kernels": {"slimlm.formats"},
    "slimlm.runtime": {"slimlm.formats", "slimlm.kernels", "slimlm.models", "slimlm.assets", "slimlm.hub",
                       "slimlm.devices"},  # fmt: skip
    "slimlm.compress": {"slimlm.formats", "slimlm.models", "slimlm.assets", "slimlm.hub", "slimlm.devices",
                        "slimlm.data", "slimlm.arch"},  # fmt: skip
}
CHILD = """
import importlib, importlib.abc, pkgutil, sys
blocked = set(sys.argv[2].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            raise ImportError(f"{sys.argv[1]} imports {name}, which sits above it")
sys.meta_path.insert(0, Block())
package = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(package.__path__, sys.argv[1] + "."):
    importlib.import_module(info.name)
"""


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_nothing_above_it(package):
    blocked = ALL - ALLOWED[package] - {package}
    proc = subprocess.run([sys.executable, "-c", CHILD, package, ",".join(sorted(blocked))], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1]
