"""What `pip install slimlm` gets: a wheel with the CPU kernels' sources (without them every linear fell back to
PyTorch, 3–10× slower) and everything else the package reads at run time."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from slimlm.kernels import cpu_library

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_the_kernels_templates_and_task_pack(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "slimlm", src / "slimlm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True, cwd=src)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("slimlm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"slimlm/kernels/{p.name}" for p in cpu_library.SOURCES} <= names
    assert "slimlm/eval/report.html.j2" in names
    assert {f"slimlm/eval/tasks/{p.name}" for p in (ROOT / "slimlm/eval/tasks").glob("*.yaml")} <= names
