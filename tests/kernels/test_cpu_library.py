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


def test_the_python_side_takes_a_cache_as_the_header_says():
    """cpu_attention.KINDS (torch dtype -> the C enum) in the order slimlm_kernels.h declares KIND_*."""
    import re

    import torch

    from slimlm.kernels import cpu_attention

    header = next(p for p in cpu_library.HEADERS if p.name == "slimlm_kernels.h").read_text()
    names = re.search(r"enum \{ (KIND_\w+(?:, KIND_\w+)*) \};", header).group(1).split(", ")
    expected = {"KIND_F32": torch.float32, "KIND_BF16": torch.bfloat16, "KIND_INT8": torch.int8}
    expected |= {"KIND_FP8": torch.float8_e4m3fn, "KIND_INT4": torch.uint8}
    assert {expected[name]: value for value, name in enumerate(names)} == cpu_attention.KINDS


def test_no_c_file_declares_another_ones_functions_or_the_cache_kinds():
    """One interface: declarations of slimlm_* functions and the KIND_* enum live in the header only."""
    import re

    for source in cpu_library.SOURCES:
        text = source.read_text()
        assert "enum { KIND_" not in text, source.name
        declared = re.findall(r"^(?:int|void) (slimlm_\w+)\([^{;]*\);", text, re.MULTILINE)
        assert declared == [], f"{source.name} declares {declared}: put them in slimlm_kernels.h"
        assert '#include "slimlm_kernels.h"' in text, source.name
