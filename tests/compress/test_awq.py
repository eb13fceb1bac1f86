import copy

import pytest
import torch
from torch.utils._pytree import tree_map
from transformers import LlamaConfig, LlamaForCausalLM

from slimlm import SlimlmError
from slimlm.compress import pipeline
from slimlm.compress.awq import AWQ, fold_scales, layer_mappings
from slimlm.compress.rtn import RTN
from slimlm.formats.quantized import QuantArgs


def tiny(kv_heads: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
    )
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
        report = pipeline.run(model, [method], calib, pipeline.Passes(4, progress=False)).report
        errors[name] = sum(r["relative_error"] for r in report)
    assert errors["awq"] < 0.8 * errors["rtn"], errors


def test_a_grid_of_one_tries_only_unit_scales():
    """α = i/grid: grid 1 is α = 0 alone (s = 1, so without clipping AWQ + RTN is RTN); coarser and finer grids
    both find scales that help. (A finer grid is not always better for the layer: each mapping's search
    minimises its own block's error, not the layer's.)"""
    args = QuantArgs(4, 32, False)
    calib = torch.randint(0, 256, (8, 64))
    quantized = {}
    for name, steps in [
        ("rtn", [RTN(args)]),
        ("grid1", [AWQ(args, clip=False, grid=1), RTN(args)]),
        ("grid4", [AWQ(args, clip=False, grid=4), RTN(args)]),
        ("grid8", [AWQ(args, clip=False, grid=8), RTN(args)]),
    ]:
        result = pipeline.run(tiny(4), steps, calib, pipeline.Passes(4, progress=False))
        quantized[name] = result
    for name, q in quantized["rtn"].quantized.items():
        assert torch.equal(q.codes, quantized["grid1"].quantized[name].codes)
    first = {name: r.report[0]["relative_error"] for name, r in quantized.items()}
    assert max(first["grid4"], first["grid8"]) < 0.8 * first["grid1"], first
    with pytest.raises(SlimlmError, match="^grid 0 must be a positive integer"):
        AWQ(args, grid=0)


def test_clipping_never_hurts_the_sampled_output():
    awq = AWQ(QuantArgs(3, 32, False))
    w, x = torch.randn(64, 128), torch.randn(256, 128)
    from slimlm.compress.quantize import quantize_rtn

    err = lambda wq: ((x @ wq.T - x @ w.T) ** 2).mean().item()  # noqa: E731
    clipped = awq._clip(w, x, awq.args)
    assert (clipped.abs() <= w.abs() + 1e-7).all()
    assert err(quantize_rtn(clipped, awq.args).dequantize()) <= err(quantize_rtn(w, awq.args).dequantize())


def test_awq_then_gptq_composes_and_beats_either_alone():
    from slimlm.compress.gptq import GPTQ

    args = QuantArgs(4, 32, False)
    calib = torch.randint(0, 256, (8, 64))
    errors = {}
    for name, steps in [
        ("awq+rtn", lambda: [AWQ(args), RTN(args)]),
        ("gptq", lambda: [GPTQ(args)]),
        ("awq+gptq", lambda: [AWQ(args), GPTQ(args)]),
    ]:
        result = pipeline.run(tiny(4), steps(), calib, pipeline.Passes(4, progress=False))
        assert len(result.quantized) == 14
        errors[name] = sum(r["relative_error"] for r in result.report)
    assert errors["awq+gptq"] < errors["awq+rtn"] and errors["awq+gptq"] < errors["gptq"], errors


def observed(awq: AWQ, model: LlamaForCausalLM, batches: int, tokens: int = 40) -> torch.nn.Module:
    """Layer 0 of `model` after `batches` calibration forwards with AWQ's hooks on it."""
    layer = model.model.layers[0]
    handles = awq.observe(layer, {})
    with torch.no_grad():
        for b in range(batches):
            model(torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(b)), use_cache=False)
    for h in handles:
        h.remove()
    return layer


def test_observe_counts_every_token_keeps_a_subsample_and_the_first_block_inputs():
    awq = AWQ(QuantArgs(4, 32, False))
    assert awq.arguments() == {"search_batches": 2, "clip": True, "grid": 20, "search_dtype": "auto"}  # defaults
    observed(awq, tiny(4), batches=3, tokens=50)
    stats = awq.stats["self_attn.q_proj"]
    assert stats.tokens == 3 * 50
    assert len(torch.cat(stats.samples)) == 3 * 3  # every 17th token of each batch: 0, 17, 34
    assert len(awq.block_inputs["self_attn"]) == len(awq.block_inputs["mlp"]) == 2  # search_batches


def test_the_clipping_sample_does_not_favour_the_windows_first_position():
    """Calibration as run: 16 batches of 8 windows of 512 tokens. A sampling stride that divides the window
    length took the first position (Qwen2.5's massive activations) for 1 in 8 of the clipping sample, against
    1 in 512 of the data; now about 1 in 250, and the sample spreads over the window's positions."""
    from slimlm.compress.awq import CLIP_TOKENS, SAMPLE_STRIDE, _Stats

    stats = _Stats()
    for _ in range(16):  # each token's value is its position in its window
        stats.add(torch.arange(512.0).repeat(8)[:, None], stride=SAMPLE_STRIDE)
    positions = stats.clip_sample()[:, 0].long()
    assert len(positions) == CLIP_TOKENS
    assert (positions == 0).float().mean() < 1 / 100 and len(positions.unique()) > 200


def test_stats_sum_over_batches():
    from slimlm.compress.awq import _Stats

    stats, a, b = _Stats(), torch.randn(2, 5, 8), torch.randn(7, 8)
    stats.add(a, stride=4)
    stats.add(b, stride=4)
    assert stats.tokens == 17
    assert torch.allclose(stats.abs_sum, a.abs().sum((0, 1)) + b.abs().sum(0))


@pytest.mark.parametrize("value", [0, -1, True, 1.0])
def test_search_batches_must_be_a_positive_integer(value):
    message = rf"^search_batches {value!r} must be a positive integer \(2 is the default\)"
    with pytest.raises(SlimlmError, match=message):
        AWQ(QuantArgs(4, 32), search_batches=value)
    assert AWQ(QuantArgs(4, 32), search_batches=1).search_batches == 1


def test_a_block_that_returns_a_tensor_is_compared_whole():
    block = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)
    (out,) = AWQ(QuantArgs(4, 32))._block_output(block, [((x,), {})])
    assert torch.equal(out, block(x))


@pytest.mark.parametrize(
    ("dtype", "search"),
    [(torch.float32, "float32"), (torch.bfloat16, "auto"), (torch.float32, "bfloat16"), (torch.bfloat16, "float32")],
)
def test_the_scale_is_the_grid_power_with_the_least_block_error(dtype, search):
    """The paper's search, written out: s = s_x^α normalised by √(max·min), α = i/grid, the α whose
    fake-quantized q/k/v give the smallest error of the attention block's output, the block run in the
    search dtype. The layer's own dtype is kept, and its weights are left as they were."""
    from slimlm.compress.quantize import quantize_rtn

    args, grid = QuantArgs(4, 32, False), 6
    awq = AWQ(args, grid=grid, search_dtype=search)
    model = tiny(4).to(dtype)
    layer = observed(awq, model, batches=2)
    mapping = next(m for m in layer_mappings(layer) if m.block == "self_attn")
    originals = [layer.get_submodule(n).weight.data.clone() for n in mapping.linears]
    search_dtype = dtype if search == "auto" else getattr(torch, search)
    block = copy.deepcopy(layer.self_attn).to(search_dtype)
    mods = [block.get_submodule(n.split(".")[1]) for n in mapping.linears]
    stats = awq.stats[mapping.linears[0]]
    x_mean = stats.abs_sum / stats.tokens
    assert (x_mean < 1).any()  # powers of small means stay small: no floor but 1e-4 may lift them
    inputs = tree_map(
        lambda t: t.to(search_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        awq.block_inputs["self_attn"],
    )
    with torch.no_grad():
        ref = [block(*a, **k)[0] for a, k in inputs]
        losses, scales = [], []
        for i in range(grid):
            s = x_mean.pow(i / grid).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            for mod, w in zip(mods, originals, strict=True):
                mod.weight.data = (quantize_rtn(w.float() * s, args).dequantize() / s).to(search_dtype)
            out = [block(*a, **k)[0] for a, k in inputs]
            losses.append(sum((o - r).float().pow(2).mean() for o, r in zip(out, ref, strict=True)).item())
            scales.append(s)
        found = awq._search_scale(layer, mapping, awq.args)
    assert found.dtype == dtype
    assert torch.equal(found, scales[losses.index(min(losses))].to(dtype))
    assert losses.index(min(losses)) > 0  # the outliers make some α > 0 win
    assert all(
        torch.equal(layer.get_submodule(n).weight.data, w) for n, w in zip(mapping.linears, originals, strict=True)
    )


def test_auto_searches_in_bf16_only_where_bf16_is_fast(monkeypatch):
    from slimlm import devices

    awq = AWQ(QuantArgs(4, 32))
    w32, w16 = torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.bfloat16)
    monkeypatch.setattr(devices, "fast_bf16_matmul", lambda device: True)
    assert (awq._dtype_for_search(w32), awq._dtype_for_search(w16)) == (torch.bfloat16, torch.bfloat16)
    monkeypatch.setattr(devices, "fast_bf16_matmul", lambda device: False)
    assert (awq._dtype_for_search(w32), awq._dtype_for_search(w16)) == (torch.float32, torch.float32)
    assert AWQ(QuantArgs(4, 32), search_dtype="float32")._dtype_for_search(w16) == torch.float32
    with pytest.raises(SlimlmError) as e:
        AWQ(QuantArgs(4, 32), search_dtype="fp8")
    assert str(e.value) == "search_dtype 'fp8' is not one of auto, float32, bfloat16"


def reference_clip(w: torch.Tensor, x: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """Per row and group, one at a time: the range shrink 1, 0.95, …, 0.5 (the first best) whose quantized
    group keeps x_g · w_g closest, in mean squared error over the tokens (of x_g · (ŵ_g − w_g), the same
    difference without the cancellation)."""
    from slimlm.compress.quantize import quantize_rtn

    gs = w.shape[1] if args.group_size == -1 else args.group_size
    one = QuantArgs(args.bits, gs, args.sym)
    out = w.clone()
    for o in range(w.shape[0]):
        for g0 in range(0, w.shape[1], gs):
            wg, xg = w[o, g0 : g0 + gs], x[:, g0 : g0 + gs]
            best, best_w = float("inf"), wg
            for i in range(11):
                bound = wg.abs().max() * (1 - i / 20)
                clipped = wg.clamp(-bound, bound)
                deq = quantize_rtn(clipped[None], one).dequantize()[0]
                err = ((xg @ (deq - wg)) ** 2).mean().item()
                if err < best:
                    best, best_w = err, clipped
            out[o, g0 : g0 + gs] = best_w
    return out


@pytest.mark.parametrize("args", [QuantArgs(3, 32, False), QuantArgs(3, 32, True), QuantArgs(4, -1, False)])
def test_clipping_is_the_per_group_search_of_the_reference(args, monkeypatch):
    from slimlm.compress import awq as awq_module

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(80, 64, generator=g), torch.randn(32, 64, generator=g)  # more rows than inputs
    w[0, 0], x[:, 0] = 20.0, 0.0  # an outlier no token sees: the largest shrink allowed (0.5) is best
    x[:, 48:] = 0.0  # a group no token sees (with groups of 32): every shrink ties, the first (none) is kept
    awq = AWQ(args, search_dtype="float32")
    expected = reference_clip(w, x, args)
    assert torch.allclose(awq._clip(w, x, awq.args), expected, atol=1e-6)
    assert not torch.equal(expected, w)  # some group is clipped
    # Products in bf16 rank the shrinks as fp32 ones do but for near ties
    gs = 64 if args.group_size == -1 else args.group_size
    in_bf16 = AWQ(args, search_dtype="bfloat16")._clip(w, x, args)
    assert (in_bf16 == expected).reshape(80, -1, gs).all(-1).float().mean() > 0.9
    assert torch.equal(in_bf16[0], expected[0])  # the unseen outlier's group gets the largest shrink
    monkeypatch.setattr(awq_module, "CLIP_CHUNK_ELEMENTS", 2 * 32 * 64)  # two rows at a time
    assert torch.allclose(awq._clip(w, x, awq.args), expected, atol=1e-6)
    assert awq._clip(w.bfloat16(), x, awq.args).dtype == torch.bfloat16


@pytest.mark.parametrize("args", [QuantArgs(3, 32, False), QuantArgs(4, 32, True)])
def test_clipping_over_more_tokens_than_a_group_is_the_reference_search(args):
    """With more tokens than a group's width the search measures each group's error through its input
    covariance: the same objective as the reference's products, shrink for shrink."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(40, 64, generator=g), torch.randn(256, 64, generator=g) * torch.linspace(0.1, 3, 64)
    w[3, 5] = 15.0
    x[:, 48:] = 0.0  # a group no token sees: every shrink ties at zero error, the first (none) is kept
    expected = reference_clip(w, x, args)
    got = AWQ(args, search_dtype="bfloat16")._clip(w, x, args)  # fp32 whatever the search dtype
    assert torch.allclose(got, expected, atol=1e-6)
    assert not torch.equal(expected, w)
