"""What `pip install slimlm` gets: a wheel with the CPU kernels' sources (without them every linear fell back to
PyTorch, 3–10× slower) and everything else the package reads at run time."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from slimlm.kernels import cpu_library

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = tmp_path / "src"
    shutil.copytree(ROOT / "slimlm", src / "slimlm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        capture_output=True,
        cwd=src,
    )
    (built,) = (tmp_path / "dist").glob("slimlm-*.whl")
    return built


def test_the_wheel_carries_the_kernels_templates_and_task_pack(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"slimlm/kernels/{p.name}" for p in cpu_library.SOURCES + cpu_library.HEADERS} <= names
    assert "slimlm/eval/report.html.j2" in names
    assert {f"slimlm/eval/tasks/{p.name}" for p in (ROOT / "slimlm/eval/tasks").glob("*.yaml")} <= names


INSTALLED_CHECK = """
import sys, torch
import slimlm
assert slimlm.__file__.startswith(sys.argv[1]), slimlm.__file__  # the installed copy, not the source tree
from slimlm.compress.quantize import quantize_rtn
from slimlm.formats.quantized import QuantArgs
from slimlm.kernels import cpu_gemm, cpu_library, reference
from slimlm.kernels.packed import pack
lib = cpu_library.load()  # built here, from the wheel's sources, into $SLIMLM_CACHE
w = pack(quantize_rtn(torch.randn(64, 256), QuantArgs(4, 64, True)))
x = torch.randn(3, 256)
# the reference of the loop this CPU runs: AVX2's 4-bit loop multiplies x quantized to int8 (x̂), by design
multiplied = reference.int8_activations(x) if cpu_gemm.path(3, x.dtype, w) == "int8" else x
error = (cpu_gemm.quant_matmul(x, w) - reference.quant_matmul(multiplied, w)).abs().max().item()
print(f"kernels built and ran: max error {error:.1e}")
"""


@pytest.mark.skipif(not cpu_library.available(), reason="needs gcc and AVX-512 or AVX2")
def test_the_installed_wheel_builds_its_kernels_and_runs_the_command(wheel, tmp_path):
    """Installed as a user installs it (not editable, outside the source tree): the C kernels build from the
    wheel's sources into a fresh cache and match the reference, and `compress --help` lists the commands."""
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": str(site), "SLIMLM_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", INSTALLED_CHECK, str(site)], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split("max error ")[1]) < 1e-4
    assert list((tmp_path / "cache" / "kernels").glob("*/libslimlm_cpu.so"))
    done = subprocess.run(
        [sys.executable, "-m", "slimlm.cli", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert done.returncode == 0 and all(command in done.stdout for command in ("gptq", "serve", "recipe"))
