import pytest
import torch

from slimlm.kernels import cpu_gemm, cpu_library
from slimlm.runtime.model import Linear, fuse
from tests.kernels.problems import quantized_weight


def packed_linear(n: int, k: int, bits: int = 4, group: int = 32, seed: int = 0, perm=None) -> Linear:
    q, w = quantized_weight(n, k, bits, group, sym=False, seed=seed)
    if perm is not None:
        w.perm = perm
    with torch.device("meta"):
        linear = Linear(k, n, False, torch.float32)
    linear.set_packed(w)
    linear.quant_matmul = cpu_gemm.quant_matmul if cpu_library.available() else linear.quant_matmul
    return linear


def float_linear(n: int, k: int, bias: bool = False, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    linear = Linear(k, n, bias, torch.float32)
    linear.weight = torch.nn.Parameter(torch.randn(n, k, generator=g), requires_grad=False)
    if bias:
        linear.bias = torch.nn.Parameter(torch.randn(n, generator=g), requires_grad=False)
    return linear


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_joined_packed_projections_give_the_parts_outputs_exactly(rows):
    perm = torch.randperm(128)
    parts = [packed_linear(n, 128, seed=i, perm=perm) for i, n in enumerate([192, 64, 70])]  # ragged last
    joined = fuse(parts)
    assert joined.packed.out_features == 326 and joined.weight is None
    x = torch.randn(rows, 128)
    for dtype in (torch.float32, torch.bfloat16):
        expected = torch.cat([p(x.to(dtype)) for p in parts], dim=-1)
        assert torch.equal(joined(x.to(dtype)), expected)


def test_joined_float_projections_with_bias():
    parts = [float_linear(n, 48, bias=True, seed=i) for i, n in enumerate([48, 16, 16])]
    joined = fuse(parts)
    x = torch.randn(3, 48)
    assert torch.allclose(joined(x), torch.cat([p(x) for p in parts], dim=-1), atol=1e-6)


@pytest.mark.parametrize(
    "parts",
    [
        lambda: [packed_linear(70, 64), packed_linear(64, 64)],  # a ragged part before the last
        lambda: [packed_linear(64, 64, bits=4), packed_linear(64, 64, bits=8)],
        lambda: [packed_linear(64, 64, group=32), packed_linear(64, 64, group=64)],
        lambda: [packed_linear(64, 64, perm=torch.randperm(64)), packed_linear(64, 64)],
        lambda: [packed_linear(64, 64), float_linear(64, 64)],
        lambda: [float_linear(64, 64, bias=True), float_linear(64, 64)],
    ],
)
def test_weights_that_cannot_be_joined_as_they_are_stay_apart(parts):
    assert fuse(parts()) is None


def test_the_loaded_model_runs_joined_projections(tiny_llama):
    from slimlm.runtime.llm import LLM

    model = LLM(str(tiny_llama)).engine.runner.model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv == [attn.qkv_proj] and mlp.gate_up == [mlp.gate_up_proj]
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")  # the parts' weights are gone
