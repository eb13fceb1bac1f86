"""The CPU kernels (cpu_gemm.c, cpu_attention.c, and their AVX2 twins *_avx2.c; cpu_layer.c for either;
cpu_gram.c where the CPU has AVX-512 BF16) as one
shared library: built with gcc -march=native on first use, cached by source hash, called through ctypes. Each
ISA-specific source compiles to nothing on the other ISA, so the library holds the AVX-512 kernels or the AVX2 ones.

A plain shared library rather than a torch extension: it needs no torch headers, so it builds in about a
second from a clean clone, and the OpenMP runtime it links is the one torch has already loaded (same soname).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from slimlm.cache import cache_dir
from slimlm.errors import SlimlmError

SOURCES = [
    *(
        Path(__file__).with_name(f"{kernel}{isa}.c")
        for kernel in ("cpu_gemm", "cpu_attention")
        for isa in ("", "_avx2")
    ),
    Path(__file__).with_name("cpu_layer.c"),
    Path(__file__).with_name("cpu_gram.c"),
]
HEADERS = [Path(__file__).with_name("slimlm_kernels.h")]
# -mprefer-vector-width=512: gcc picks 256 otherwise. -fno-trapping-math: no code here reads the floating-point
# exception flags, and without AVX-512's masks gcc will not run both sides of a float `?:` (silu's exp, a clamp)
# in vectors while they might raise one: the AVX2 build's silu_mul ran scalar, 8× slower. Values are unchanged.
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-mprefer-vector-width=512", "-fno-trapping-math"]

i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
DEQUANTIZE = [c_int, i64, ptr, ptr, ptr, i64, i64, i64, ptr, c_int]
SIGNATURES = {  # name: (argument types, return type)
    "slimlm_vector_bits": ([], c_int),
    "slimlm_quant_matmul": ([c_int, ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, c_int], None),
    "slimlm_paged_decode": (
        [ptr, ptr, ptr, c_int, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float, c_int, ptr, c_int],
        c_int,
    ),
    "slimlm_add_rms_norm": ([ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, c_int, c_int], None),
    "slimlm_silu_mul": ([ptr, ptr, i64, i64, c_int, c_int], None),
    "slimlm_row_logprobs": ([ptr, i64, i64, c_int, ptr, ptr, ptr, ptr, c_int], None),
    "slimlm_rotary_kv_write": (
        [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, c_int, c_int, ptr, ptr, ptr, ptr, c_int],
        None,
    ),
}


def build_flags(march: str) -> list[str]:
    return [*FLAGS, f"-march={march}"]


def library_path(march: str = "native") -> Path:
    """Where the built library lives: keyed by sources and flags, so an edit rebuilds it."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(build_flags(march)).encode())
    return cache_dir() / "kernels" / digest.hexdigest()[:16] / "libslimlm_cpu.so"


def load(march: str | None = None) -> ctypes.CDLL:
    """The library built for this CPU: gcc -march=native, or $SLIMLM_CPU_MARCH. Another -march (e.g. haswell:
    the AVX2 kernels) runs the other ISAs' kernels on a CPU that also has them: the tests check them so, and
    benchmarks measure what an AVX2 machine would run."""
    return _load(march or os.environ.get("SLIMLM_CPU_MARCH", "native"))


@functools.cache
def _load(march: str) -> ctypes.CDLL:
    path = library_path(march)
    if not path.exists():
        compiler = os.environ.get("CC", "gcc")
        if shutil.which(compiler) is None:
            raise SlimlmError(f"the CPU kernels need a C compiler ({compiler} not found); install gcc or set CC")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            command = [compiler, *build_flags(march), *map(str, SOURCES), "-o", str(built), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise SlimlmError(f"building the CPU kernels failed: {result.stderr.strip().splitlines()[-1]}")
            built.replace(path)  # atomic: concurrent builders each rename a complete file
    return bind(ctypes.CDLL(str(path)))


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib with the argument and result types of its kernels set (a build of these sources, any revision)."""
    for name, (args, result) in SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
    lib.slimlm_dequantize.argtypes = DEQUANTIZE
    if hasattr(lib, "slimlm_quant_matmul_i8"):  # AVX2 builds
        lib.slimlm_quant_matmul_i8.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, c_int]
        lib.slimlm_quant_matmul_i8.restype = c_int
    if hasattr(lib, "slimlm_paged_prefill"):  # AVX-512 builds only
        lib.slimlm_paged_prefill.argtypes = [
            ptr,
            ptr,
            ptr,
            c_int,
            c_int,
            ptr,
            ptr,
            ptr,
            i64,
            ptr,
            ptr,
            i64,
            i64,
            i64,
            i64,
            i64,
            ctypes.c_float,
            c_int,
            c_int,
            ptr,
            c_int,
        ]
        lib.slimlm_paged_prefill.restype = c_int
    f32 = ctypes.c_float
    if hasattr(lib, "slimlm_decode_layers"):  # AVX-512 BF16 and AVX2 builds of revisions since it (kernels_ab.py)
        # (layers, n, x, tmp, out, eps), (cos, sin, slots), the paged cache, its shape, then scale and the flags
        step, rotary, paged, shape = [ptr, i64, ptr, ptr, ptr, f32], [ptr] * 3, [ptr, i64, ptr, i64, ptr], [i64] * 5
        lib.slimlm_decode_layers.argtypes = [*step, *rotary, *paged, *shape, f32, c_int, c_int, c_int, c_int]
        lib.slimlm_decode_layers.restype = c_int
    if hasattr(lib, "slimlm_quant_matmul_bf16"):  # built only where the CPU has AVX-512 BF16
        lib.slimlm_quant_matmul_bf16.argtypes = [
            c_int,
            ptr,
            i64,
            i64,
            ptr,
            ptr,
            ptr,
            i64,
            i64,
            ptr,
            i64,
            c_int,
            i64,
            c_int,
        ]
        lib.slimlm_quant_matmul_bf16.restype = c_int
    if hasattr(lib, "slimlm_bf16_gram"):  # built only where the CPU has AVX-512 BF16
        lib.slimlm_bf16_gram.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ctypes.c_float, c_int]
        lib.slimlm_bf16_gram.restype = c_int
    if hasattr(lib, "slimlm_bf16_gram_amx"):  # and where it has AMX
        lib.slimlm_bf16_gram_amx.argtypes = lib.slimlm_bf16_gram.argtypes
        lib.slimlm_bf16_gram_amx.restype = c_int
    if hasattr(lib, "slimlm_quant_matmul_amx"):  # built only where the CPU has AMX
        lib.slimlm_amx_ready.argtypes, lib.slimlm_amx_ready.restype = [], c_int
        lib.slimlm_quant_matmul_amx.argtypes = lib.slimlm_quant_matmul_bf16.argtypes[:-2] + [c_int]
        lib.slimlm_quant_matmul_amx.restype = c_int
    return lib


@functools.cache  # asked on every quantized matmul: one ctypes call per process, not per layer
def vector_bits() -> int:
    """512 where the AVX-512 kernels were built, 256 for the AVX2 ones. slimlm_dequantize writes bf16 on the
    first (which multiply bf16 fast) and fp32 on the second (where torch's bf16 matmul is ~1 GFLOP/s)."""
    return load().slimlm_vector_bits()


@functools.cache
def has_bf16_gemm() -> bool:
    """Whether the bf16 dot-product GEMM (slimlm_quant_matmul_bf16, AVX-512 BF16) was built here."""
    return hasattr(load(), "slimlm_quant_matmul_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags from /proc/cpuinfo, read once; empty where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


@functools.cache
def has_amx() -> bool:
    """Whether the AMX kernels (the GEMM slimlm_quant_matmul_amx, the prompt attention's tile path) were built
    here and the OS lets this process use the tiles."""
    lib = load()
    return hasattr(lib, "slimlm_quant_matmul_amx") and bool(lib.slimlm_amx_ready())


@functools.cache
def available() -> bool:
    """Whether the library builds and loads here (it needs gcc, and AVX-512 or AVX2 with FMA)."""
    try:
        load()
    except (SlimlmError, OSError):
        return False
    return True
