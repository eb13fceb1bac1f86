import pytest
import torch

import slimlm.kernels as kernels
from slimlm.kernels import cpu_attention, cpu_gemm, cpu_layer, reference
from tests.kernels.problems import paged_problem, quantized_weight, relative_error, x_as_multiplied


def test_backend_follows_the_device_and_the_override(monkeypatch):
    monkeypatch.delenv("SLIMLM_KERNELS", raising=False)
    assert kernels.backend(torch.device("cuda")) == "triton"
    assert kernels.backend(torch.device("cpu")) == "cpu"
    monkeypatch.setenv("SLIMLM_KERNELS", "reference")
    assert kernels.backend(torch.device("cuda")) == "reference"


def test_reference_override_skips_the_cpu_kernel(monkeypatch):
    _, w = quantized_weight(64, 64, 4, 32, sym=True)
    x = torch.randn(2, 64)
    monkeypatch.setenv("SLIMLM_KERNELS", "reference")
    monkeypatch.setattr(cpu_gemm, "quant_matmul", lambda *a: (_ for _ in ()).throw(AssertionError("cpu kernel ran")))
    assert relative_error(kernels.quant_matmul(x, w), reference.quant_matmul(x.double(), w)) < 1e-6


def test_cpu_attention_runs_the_cpu_path(monkeypatch):
    problem = paged_problem([20, 7], [4, 7], 4, 2, 32, kv_dtype=torch.float32, q_dtype=torch.float32)
    monkeypatch.delenv("SLIMLM_KERNELS", raising=False)
    calls = []
    monkeypatch.setattr(
        cpu_attention, "paged_attention", lambda *a, **kw: calls.append(kw) or reference.paged_attention(*a)
    )
    kernels.paged_attention(*problem.args())
    assert calls


def test_select_names_what_runs_for_each_device(monkeypatch):
    monkeypatch.delenv("SLIMLM_KERNELS", raising=False)
    from slimlm.kernels import triton_attention, triton_gemm

    cuda = kernels.select("cuda")
    assert (cuda.name, cuda.quant_matmul, cuda.paged_attention) == (
        "triton",
        triton_gemm.quant_matmul,
        triton_attention.paged_attention,
    )
    cpu = kernels.select(torch.device("cpu"))
    assert (cpu.name, cpu.quant_matmul) == ("cpu", cpu_gemm.quant_matmul)
    assert cpu.paged_attention.func is cpu_attention.paged_attention
    assert cpu.paged_attention.keywords == {"native": True}
    assert (cpu.add_rms_norm, cpu.rotary_kv_write) == (cpu_layer.add_rms_norm, cpu_layer.rotary_kv_write)
    # no C layer operations on the GPU: their PyTorch definitions
    assert (cuda.add_rms_norm, cuda.rotary_kv_write) == (reference.add_rms_norm, reference.rotary_kv_write)
    monkeypatch.setenv("SLIMLM_KERNELS", "reference")
    for device in ("cpu", "cuda"):
        ref = kernels.select(device)
        assert (ref.name, ref.quant_matmul, ref.paged_attention) == (
            "reference",
            reference.quant_matmul,
            reference.paged_attention,
        )
        assert (ref.add_rms_norm, ref.rotary_kv_write) == (reference.add_rms_norm, reference.rotary_kv_write)
    monkeypatch.setenv("SLIMLM_KERNELS", "triton")  # only "reference" overrides
    assert kernels.select("cpu").name == "cpu"


def test_without_the_c_library_the_cpu_runs_pytorch_and_says_so(monkeypatch):
    monkeypatch.delenv("SLIMLM_KERNELS", raising=False)
    monkeypatch.setattr(kernels.cpu_library, "available", lambda: False)
    kernels.cpu_kernels_available.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"^the CPU kernels \(AVX-512, or AVX2 with FMA\) could not be built here"):
            chosen = kernels.select("cpu")
        assert (chosen.name, chosen.quant_matmul) == ("cpu-pytorch", reference.quant_matmul)
        assert chosen.paged_attention.func is cpu_attention.paged_attention
        assert chosen.paged_attention.keywords == {"native": False}
        assert (chosen.add_rms_norm, chosen.rotary_kv_write) == (reference.add_rms_norm, reference.rotary_kv_write)
    finally:
        monkeypatch.undo()
        kernels.cpu_kernels_available.cache_clear()
    assert kernels.cpu_kernels_available()  # the library is back


def test_paged_attention_passes_every_argument_through(monkeypatch):
    """An int8 cache with per-head scales: dropping or swapping k_scale/v_scale changes the result."""
    monkeypatch.delenv("SLIMLM_KERNELS", raising=False)
    p = paged_problem([20, 7], [4, 1], 4, 2, 32, kv_dtype=torch.int8, q_dtype=torch.float32)
    p.k_scale, p.v_scale = torch.tensor([0.02, 0.05]), torch.tensor([0.03, 0.01])
    expected = reference.paged_attention(*p.args(), dtype=torch.float64)
    assert relative_error(kernels.paged_attention(*p.args()), expected) < 1e-5
    _, w = quantized_weight(48, 64, 4, 32, sym=False)
    x = torch.randn(3, 64)
    assert relative_error(kernels.quant_matmul(x, w), reference.quant_matmul(x_as_multiplied(x, w), w)) < 1e-6
