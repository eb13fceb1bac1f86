import builtins
import io

import pytest
import torch

from slimlm import SlimlmError, devices


def test_resolve_device_names_what_is_wrong():
    assert devices.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(SlimlmError, match="^device 'nope' is not a device; use cpu or cuda"):
        devices.resolve_device("nope")


@pytest.mark.parametrize(
    ("flags", "capability", "fast"),
    [
        ("fpu avx512f avx512_bf16 sse", "AVX512", True),
        ("fpu amx_bf16 avx2", "AVX512", True),
        ("fpu avx512f avx512_bf16 sse", "AVX2", False),  # torch capped at AVX2 (ATEN_CPU_CAPABILITY=avx2)
        ("fpu avx512f avx512bw avx2", "AVX512", False),
        ("", "AVX2", False),
    ],
)
def test_bf16_counts_as_fast_on_cpus_with_bf16_dot_products_only(monkeypatch, flags, capability, fast):
    cpuinfo = f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    real_open = builtins.open
    monkeypatch.setattr(
        builtins, "open", lambda p, *a, **k: io.StringIO(cpuinfo) if p == "/proc/cpuinfo" else real_open(p, *a, **k)
    )
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    devices.cpu_flags.cache_clear()
    try:
        assert devices.fast_bf16_matmul(torch.device("cpu")) is fast
    finally:
        devices.cpu_flags.cache_clear()


def test_bf16_is_slow_where_the_cpu_flags_cannot_be_read(monkeypatch):
    def refuse(*_a, **_k):
        raise OSError("no /proc here")

    monkeypatch.setattr(builtins, "open", refuse)
    devices.cpu_flags.cache_clear()
    try:
        assert devices.fast_bf16_matmul(torch.device("cpu")) is False
    finally:
        devices.cpu_flags.cache_clear()


@pytest.mark.parametrize(
    ("fast", "stored", "device", "want"),
    [
        (True, torch.float32, "cpu", torch.bfloat16),
        (True, torch.bfloat16, "cpu", torch.bfloat16),
        (True, torch.float16, "cpu", torch.bfloat16),
        (True, torch.float16, "cuda", torch.float16),
        (False, torch.float32, "cpu", torch.float32),
        (False, torch.bfloat16, "cpu", torch.float32),
        (False, torch.float16, "cpu", torch.float32),
        (False, torch.bfloat16, "cuda", torch.float32),
    ],
)
def test_auto_computes_in_the_machines_fast_dtype_not_the_checkpoints(monkeypatch, fast, stored, device, want):
    monkeypatch.setattr(devices, "fast_bf16_matmul", lambda _dev: fast)
    assert devices.compute_dtype("auto", stored, torch.device(device)) == want
    assert devices.compute_dtype("float32", stored, torch.device(device)) == torch.float32
    assert devices.compute_dtype("bfloat16", stored, torch.device(device)) == torch.bfloat16


def test_an_unknown_compute_dtype_is_named():
    with pytest.raises(SlimlmError) as e:
        devices.compute_dtype("fp8", torch.float32, torch.device("cpu"))
    assert str(e.value) == "compute_dtype 'fp8' is not one of auto, float32, bfloat16"
