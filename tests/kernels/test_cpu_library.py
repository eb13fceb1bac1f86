import shutil
import subprocess

import pytest

from slimlm.kernels import cpu_library

# One CPU of each kind the kernels have code for: AVX2+FMA (the *_avx2.c twins), AVX-512 without BF16, with
# VBMI but no BF16 (Ice Lake), BF16 without VBMI (Cooper Lake), and AMX with both (Sapphire Rapids; Zen 4 has
# both without AMX). CI runs on one of them; the others' code must still build.
MARCHES = ["haswell", "skylake-avx512", "icelake-server", "cooperlake", "sapphirerapids"]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("march", MARCHES)
def test_the_library_builds_for_every_cpu_kind(tmp_path, march):
    """The library's own build command for a CPU this machine may lack (optimised, so that gcc checks every
    intrinsic against the target where it inlines it), with warnings as errors and no symbol left undefined
    (one file calling a kernel another file did not build for this target)."""
    out = tmp_path / "lib.so"
    command = ["gcc", *cpu_library.build_flags(march), "-Werror", "-Wl,--no-undefined"]
    result = subprocess.run(
        [*command, *map(str, cpu_library.SOURCES), "-o", str(out), "-lm"], capture_output=True, text=True
    )
    assert result.returncode == 0, f"-march={march}:\n{result.stderr}"
