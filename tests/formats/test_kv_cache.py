"""KV-cache scales on disk: the scheme written, the schemes read, the scales and their checks."""

import pytest
import torch

from slimlm import SlimlmError
from slimlm.formats import kv_cache


def test_schemes_for_each_dtype_and_strategy_read_back():
    for kv_dtype, kind in (("fp8", "float"), ("int8", "int")):
        for strategy in kv_cache.STRATEGIES:
            s = kv_cache.scheme(kv_dtype, strategy)
            assert s == {"num_bits": 8, "type": kind, "strategy": strategy, "dynamic": False, "symmetric": True}
            assert kv_cache.kv_dtype_of(s) == kv_dtype
    assert kv_cache.kv_dtype_of({"num_bits": 8, "strategy": "tensor"}) == "fp8"  # type, dynamic, symmetric default


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: kv_cache.scheme("int4", "tensor"), "KV dtype 'int4' is not supported; use one of fp8, int8"),
        (
            lambda: kv_cache.scheme("fp8", "channel"),
            "KV scale strategy 'channel' is not supported; use one of tensor, attn_head",
        ),
        (lambda: kv_cache.kv_dtype_of([8]), "kv_cache_scheme is [8], not an object"),
        (
            lambda: kv_cache.kv_dtype_of({"num_bits": 4, "type": "int", "strategy": "tensor"}),
            "kv_cache_scheme num_bits=4 type=int is not supported; slimlm serves 8-bit float (fp8 "
            "e4m3) or int KV caches",
        ),
        (
            lambda: kv_cache.kv_dtype_of({"num_bits": 8, "type": "mx", "strategy": "tensor"}),
            "kv_cache_scheme num_bits=8 type=mx is not supported; slimlm serves 8-bit float (fp8 e4m3) "
            "or int KV caches",
        ),
        (
            lambda: kv_cache.kv_dtype_of({"num_bits": 8, "strategy": "token"}),
            "kv_cache_scheme strategy=token dynamic=None symmetric=None is not supported; slimlm serves static "
            "symmetric scales, strategy tensor or attn_head",
        ),
        (
            lambda: kv_cache.kv_dtype_of({"num_bits": 8, "strategy": "tensor", "dynamic": True}),
            "kv_cache_scheme strategy=tensor dynamic=True symmetric=None is not supported; slimlm serves static "
            "symmetric scales, strategy tensor or attn_head",
        ),
        (
            lambda: kv_cache.kv_dtype_of({"num_bits": 8, "strategy": "attn_head", "symmetric": False}),
            "kv_cache_scheme strategy=attn_head dynamic=None symmetric=False is not supported; slimlm serves static "
            "symmetric scales, strategy tensor or attn_head",
        ),
    ],
)
def test_unsupported_schemes_are_named(call, message):
    with pytest.raises(SlimlmError) as e:
        call()
    assert str(e.value) == message


def test_scale_maps_amax_onto_the_dtype_range_and_zero_amax_keeps_one():
    amax = torch.tensor([448.0, 0.0, 44.8], dtype=torch.bfloat16)
    fp8 = kv_cache.scale_for(amax, "fp8")
    assert fp8.dtype == torch.float32
    assert torch.allclose(fp8, torch.tensor([1.0, 1.0, 44.8 / 448]), rtol=1e-2)
    assert torch.equal(kv_cache.scale_for(torch.tensor([254.0, 0.0]), "int8"), torch.tensor([2.0, 1.0]))


def test_scale_tensor_shapes_per_strategy():
    per_head = torch.tensor([0.5, 2.0, 1.0])
    assert torch.equal(kv_cache.scale_tensor(per_head, "tensor"), torch.tensor([2.0]))
    assert torch.equal(kv_cache.scale_tensor(per_head, "attn_head"), per_head.reshape(3, 1, 1))


def test_scale_names():
    assert kv_cache.scale_names(3) == ("model.layers.3.self_attn.k_scale", "model.layers.3.self_attn.v_scale")
    assert kv_cache.scale_names(0, "m.h") == ("m.h.0.self_attn.k_scale", "m.h.0.self_attn.v_scale")


def stored(layers: int, strategy: str, kv_heads: int = 2) -> dict[str, torch.Tensor]:
    out = {"other": torch.ones(1)}
    for i in range(layers):
        k, v = kv_cache.scale_names(i)
        shape = (1,) if strategy == "tensor" else (kv_heads, 1, 1)
        out[k] = torch.full(shape, 1.0 + i, dtype=torch.bfloat16)
        out[v] = torch.arange(1, 1 + shape[0], dtype=torch.float32).reshape(shape) * (i + 1)
    return out


@pytest.mark.parametrize("strategy", kv_cache.STRATEGIES)
def test_read_scales_pops_each_layers_pair_as_fp32_per_kv_head(strategy):
    tensors = stored(2, strategy)
    pairs = kv_cache.read_scales(tensors, {"strategy": strategy}, 2, 2, "ckpt")
    assert list(tensors) == ["other"]  # popped
    assert len(pairs) == 2
    for i, (k, v) in enumerate(pairs):
        assert k.dtype == v.dtype == torch.float32 and k.shape == v.shape == (2,) and k.is_contiguous()
        assert k.tolist() == [1.0 + i] * 2
        assert v.tolist() == ([i + 1.0] * 2 if strategy == "tensor" else [i + 1.0, 2 * (i + 1.0)])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.v_scale"),
            "ckpt: kv_cache_scheme is set but model.layers.1.self_attn.v_scale is missing; the "
            "checkpoint is incomplete "
            "(re-run compress kv)",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.k_scale": torch.ones(2)}),
            "ckpt: model.layers.0.self_attn.k_scale is [2] torch.float32; strategy tensor with 2 KV heads implies a "
            "float [1]",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.k_scale": torch.ones(1, dtype=torch.int32)}),
            "ckpt: model.layers.0.self_attn.k_scale is [1] torch.int32; strategy tensor with 2 KV heads implies a "
            "float [1]",
        ),
        (
            lambda t: t.update({"model.layers.1.self_attn.k_scale": torch.tensor([0.0])}),
            "ckpt: model.layers.1.self_attn.k_scale holds [0.0]; KV scales must be finite and positive "
            "(re-run compress kv)",
        ),
        (
            lambda t: t.update({"model.layers.1.self_attn.k_scale": torch.tensor([-1.0])}),
            "ckpt: model.layers.1.self_attn.k_scale holds [-1.0]; KV scales must be finite and positive "
            "(re-run compress kv)",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.v_scale": torch.tensor([float("inf")])}),
            "ckpt: model.layers.0.self_attn.v_scale holds [inf]; KV scales must be finite and positive "
            "(re-run compress kv)",
        ),
    ],
)
def test_bad_scales_are_named(edit, message):
    tensors = stored(2, "tensor")
    edit(tensors)
    with pytest.raises(SlimlmError) as e:
        kv_cache.read_scales(tensors, {"strategy": "tensor"}, 2, 2, "ckpt")
    assert str(e.value) == message


def test_per_head_scales_need_one_per_kv_head_and_show_at_most_four_values():
    tensors = stored(1, "attn_head", kv_heads=6)
    with pytest.raises(SlimlmError) as e:
        kv_cache.read_scales(dict(tensors), {"strategy": "attn_head"}, 1, 4, "ckpt")
    assert str(e.value) == (
        "ckpt: model.layers.0.self_attn.k_scale is [6, 1, 1] torch.bfloat16; strategy attn_head "
        "with 4 KV heads implies a float [4, 1, 1]"
    )
    tensors["model.layers.0.self_attn.v_scale"][5] = 0
    with pytest.raises(SlimlmError, match=r"holds \[1\.0, 2\.0, 3\.0, 4\.0\]; KV scales must be finite"):
        kv_cache.read_scales(tensors, {"strategy": "attn_head"}, 1, 6, "ckpt")
