import torch

import slimlm.kernels as kernels
from slimlm.kernels import cpu_attention, cpu_gemm, reference
from tests.kernels.problems import paged_problem, quantized_weight, relative_error


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
