import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from slimlm import SlimlmError
from slimlm.compress import pipeline
from slimlm.compress.awq import AWQ, fold_scales, layer_mappings
from slimlm.compress.rtn import RTN
from slimlm.formats.quantized import QuantArgs


def tiny(kv_heads: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=128,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # LLM-like activations: a few input channels much larger than the rest
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1 + torch.rand(128))
                norm.weight[:6] *= 25
    return model


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_folding_scales_keeps_the_float_model(kv_heads):
    model = tiny(kv_heads)
    x = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        before = model(x).logits.double()
        for layer in model.model.layers:
            maps = layer_mappings(layer)
            assert any(m.prev == "self_attn.v_proj" for m in maps) == (kv_heads == 4)  # v→o only without GQA
            for m in maps:
                n = layer.get_submodule(m.linears[0]).in_features
                fold_scales(layer, m, torch.rand(n) * 4 + 0.25)
        after = model(x).logits.double()
    assert ((after - before).norm() / before.norm()).item() < 1e-5


def test_awq_beats_rtn_with_activation_outliers():
    args = QuantArgs(4, 32, False)
    calib = torch.randint(0, 256, (8, 64))
    errors = {}
    for name, method in [("rtn", RTN(args)), ("awq", AWQ(args, search_batches=2))]:
        model = tiny(4)
        report = pipeline.run(model, [method], calib, batch_size=4, progress=False).report
        errors[name] = sum(r["relative_error"] for r in report)
    assert errors["awq"] < 0.8 * errors["rtn"], errors


def test_a_grid_of_one_tries_only_unit_scales():
    """α = i/grid: grid 1 is α = 0 alone (s = 1, so without clipping AWQ + RTN is RTN); coarser and finer grids
    both find scales that help. (A finer grid is not always better for the layer: each mapping's search
    minimises its own block's error, not the layer's.)"""
    args = QuantArgs(4, 32, False)
    calib = torch.randint(0, 256, (8, 64))
    quantized = {}
    for name, steps in [("rtn", [RTN(args)]), ("grid1", [AWQ(args, clip=False, grid=1), RTN(args)]),
                        ("grid4", [AWQ(args, clip=False, grid=4), RTN(args)]),
                        ("grid8", [AWQ(args, clip=False, grid=8), RTN(args)])]:  # fmt: skip
        result = pipeline.run(tiny(4), steps, calib, batch_size=4, progress=False)
        quantized[name] = result
    for name, q in quantized["rtn"].quantized.items():
        assert torch.equal(q.codes, quantized["grid1"].quantized[name].codes)
    first = {name: r.report[0]["relative_error"] for name, r in quantized.items()}
    assert max(first["grid4"], first["grid8"]) < 0.8 * first["grid1"], first
    with pytest.raises(SlimlmError, match="--grid 0 must be a positive integer"):
        AWQ(args, grid=0)


def test_clipping_never_hurts_the_sampled_output():
    awq = AWQ(QuantArgs(3, 32, False))
    w, x = torch.randn(64, 128), torch.randn(256, 128)
    from slimlm.compress.quantize import quantize_rtn

    err = lambda wq: ((x @ wq.T - x @ w.T) ** 2).mean().item()  # noqa: E731
    clipped = awq._clip(w, x)
    assert (clipped.abs() <= w.abs() + 1e-7).all()
    assert err(quantize_rtn(clipped, awq.args).dequantize()) <= err(quantize_rtn(w, awq.args).dequantize())


def test_awq_then_gptq_composes_and_beats_either_alone():
    from slimlm.compress.gptq import GPTQ

    args = QuantArgs(4, 32, False)
    calib = torch.randint(0, 256, (8, 64))
    errors = {}
    for name, steps in [("awq+rtn", lambda: [AWQ(args), RTN(args)]), ("gptq", lambda: [GPTQ(args)]),
                        ("awq+gptq", lambda: [AWQ(args), GPTQ(args)])]:  # fmt: skip
        result = pipeline.run(tiny(4), steps(), calib, batch_size=4, progress=False)
        assert len(result.quantized) == 14
        errors[name] = sum(r["relative_error"] for r in result.report)
    assert errors["awq+gptq"] < errors["awq+rtn"] and errors["awq+gptq"] < errors["gptq"], errors
