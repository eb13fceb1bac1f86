"""Quantized KV caches in the engine, held to transformers with the same quantize-dequantize of every
cached key (after RoPE) and value, per KV head: prompt log-probabilities, greedy decoding, capacity, bad
scales."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from slimlm import SlimlmError, models
from slimlm.compress.job import CalibData, Quantization, quantize_weights
from slimlm.compress.kv import KVCache
from slimlm.formats import kv_cache, kv_int4
from slimlm.runtime.engine import Engine, EngineConfig
from slimlm.runtime.llm import LLM
from slimlm.runtime.sampling import SamplingParams
from tests.conftest import make_text, make_tiny_llama
from tests.runtime.conftest import next_token_logprobs


@pytest.fixture(scope="module", params=[("fp8", "tensor"), ("int8", "attn_head")], ids=["fp8", "int8"])
def kv_checkpoint(request, tiny_llama, calib_txt, tmp_path_factory):
    kv_dtype, strategy = request.param
    out = tmp_path_factory.mktemp("kv") / f"tiny-{kv_dtype}"
    quantize_weights(
        Quantization(
            "kv",
            [KVCache(kv_dtype, strategy)],
            None,
            str(tiny_llama),
            out,
            CalibData(str(calib_txt), 8, 64),
            report_error=False,
        ),
        progress=False,
    )
    return out, kv_dtype


def _qdq(x: torch.Tensor, scale: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """x [B, H, T, D] through an fp8/int8 cache with per-head scale [H], written from the definition."""
    s = scale[None, :, None, None]
    limit = 448.0 if kv_dtype == "fp8" else 127.0
    y = (x / s).clamp(-limit, limit)
    y = y.to(torch.float8_e4m3fn).float() if kv_dtype == "fp8" else y.round()
    return y * s


def mean_keys(model_dir, max_len: int) -> list[torch.Tensor]:
    """Each layer's mean key (after RoPE) [Hkv, D] over KEY_OFFSET_TEXT's first max_len tokens, as transformers'
    own attention computes the keys."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    from slimlm.runtime.model_runner import KEY_OFFSET_TEXT

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    keys, rotary = [], modeling_llama.apply_rotary_pos_emb

    def grab(q, k, *args, **kwargs):
        q, k = rotary(q, k, *args, **kwargs)
        keys.append(k[0].mean(1))  # [H, D]
        return q, k

    modeling_llama.apply_rotary_pos_emb = grab
    try:
        with torch.no_grad():
            model(torch.tensor([models.load_tokenizer(model_dir).encode(KEY_OFFSET_TEXT)[:max_len]]))
    finally:
        modeling_llama.apply_rotary_pos_emb = rotary
    return keys


def transformers_with_quantized_kv(model_dir, kv_dtype: str):
    """transformers' Llama whose attention sees every K (after RoPE) and V as the quantized cache holds it: fp8
    keys less their layer's mean key μ, rotated by H, rounded at 2√D times their scale, rotated back and given μ
    back (attention cannot tell: q·μ shifts every score alike, and H is orthonormal)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    offsets = None  # compress kv's calibrated offsets, which the runtime uses
    if kv_dtype == "fp8":
        offsets = json.loads((model_dir / kv_cache.KEY_OFFSETS_FILE).read_text())["key_offsets"]
        offsets = [torch.tensor(layer) for layer in offsets]
    tensors = load_file(model_dir / "model.safetensors")
    heads = model.config.num_key_value_heads
    scales = [
        [tensors[n].float().flatten().expand(heads) for n in kv_cache.scale_names(i)]
        for i in range(model.config.num_hidden_layers)
    ]
    layer = {}
    rotary = modeling_llama.apply_rotary_pos_emb

    def rotary_then_quantize(q, k, cos, sin, *args, **kwargs):
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        scale = scales[layer["i"]][0]
        if offsets is None:
            return q, _qdq(k, scale, kv_dtype)
        shift, h = offsets[layer["i"]][:, None], kv_int4.rotation(k.shape[-1])  # [B, H, T, D] against μ [H, D]
        return q, _qdq((k - shift) @ h, scale * 2 * k.shape[-1] ** 0.5, kv_dtype) @ h.T + shift

    for i, block in enumerate(model.model.layers):
        attn = block.self_attn
        attn.register_forward_pre_hook(lambda _m, _a, i=i: layer.update(i=i))
        attn.v_proj.register_forward_hook(
            lambda _m, _x, out, i=i: (
                _qdq(out.unflatten(-1, (heads, -1)).transpose(1, 2), scales[i][1], kv_dtype).transpose(1, 2).flatten(-2)
            )
        )
    return model, rotary_then_quantize


@pytest.fixture
def reference(kv_checkpoint, monkeypatch):
    from transformers.models.llama import modeling_llama

    model_dir, kv_dtype = kv_checkpoint
    model, patched = transformers_with_quantized_kv(model_dir, kv_dtype)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", patched)
    return model


def _prompt(engine: Engine, seed: int, n: int) -> list[int]:
    return engine.tokenizer.encode(" ".join(make_text(30, seed=seed).split()[:n]))


def assert_prompt_logprobs_match(llm: LLM, reference, tiny_llama) -> None:
    """A prompt of several blocks: its log-probabilities as `reference` computes them, and far from a float
    cache's (the rounding is really there and really matched)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    ids = _prompt(llm.engine, 5, 70)
    ours = torch.tensor(llm.generate([ids], params)[0].prompt_logprobs)
    with torch.no_grad():
        theirs = next_token_logprobs(reference(torch.tensor([ids])).logits[0], ids)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=0)
    float_kv = torch.tensor(LLM(str(tiny_llama)).generate([ids], params)[0].prompt_logprobs)
    assert (float_kv - theirs).abs().max() > 10 * 2e-4


def assert_greedy_matches(llm: LLM, reference, lengths: tuple[int, ...], tokens: int) -> None:
    prompts = [_prompt(llm.engine, seed, n) for seed, n in enumerate(lengths, 1)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = reference.generate(
                torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens
            )
        assert out.outputs[0].token_ids == want[0, len(ids) :].tolist()


def test_prompt_logprobs_match_transformers_through_the_same_quantized_cache(kv_checkpoint, reference, tiny_llama):
    model_dir, kv_dtype = kv_checkpoint
    llm = LLM(str(model_dir), block_size=16)  # the prompt prefilled in one chunk
    assert llm.engine.runner.kv_cache.dtype == kv_cache.KV_DTYPES[kv_dtype][0]
    assert_prompt_logprobs_match(llm, reference, tiny_llama)


def test_greedy_decoding_matches_transformers_through_the_same_quantized_cache(kv_checkpoint, reference):
    model_dir, _ = kv_checkpoint
    llm = LLM(str(model_dir), block_size=8, max_num_batched_tokens=16)  # chunked prefill, decodes across blocks
    assert_greedy_matches(llm, reference, (5, 19, 33), 20)


def test_one_memory_budget_holds_4x_the_tokens_of_fp32_in_8_bits(kv_checkpoint, tiny_llama):
    model_dir, _ = kv_checkpoint
    budget = dict(kv_cache_memory=4 << 20, max_model_len=256)
    fp32 = Engine(str(tiny_llama), EngineConfig(**budget)).runner
    bf16 = Engine(str(tiny_llama), EngineConfig(kv_cache_dtype="bfloat16", **budget)).runner
    eight = Engine(str(model_dir), EngineConfig(**budget)).runner
    assert eight.num_blocks == 4 * fp32.num_blocks == 2 * bf16.num_blocks
    assert eight.kv_bytes_per_token * 4 == fp32.kv_bytes_per_token


def test_kv_cache_dtype_overrides_the_checkpoint(kv_checkpoint):
    model_dir, kv_dtype = kv_checkpoint
    other = "int8" if kv_dtype == "fp8" else "fp8"
    engine = Engine(str(model_dir), EngineConfig(kv_cache_dtype=other, max_model_len=256))
    assert engine.runner.kv_cache.dtype == kv_cache.KV_DTYPES[other][0]
    tensors = load_file(model_dir / "model.safetensors")
    stored = tensors["model.layers.1.self_attn.k_scale"].float().flatten()
    ratio = kv_cache.KV_DTYPES[kv_dtype][1] / kv_cache.KV_DTYPES[other][1]  # the same calibrated amax
    attn = engine.model.model.layers[1].self_attn
    if other == "fp8":  # rotated keys: 2√D times the scale
        ratio *= kv_cache.key_scale_factor(attn.head_dim)
    torch.testing.assert_close(attn.k_scale, (stored * ratio).expand(2))
    float_engine = Engine(str(model_dir), EngineConfig(kv_cache_dtype="float32", max_model_len=256))
    assert float_engine.runner.kv_cache.dtype == torch.float32
    assert float_engine.model.model.layers[0].self_attn.k_scale is None


def test_without_scales_fp8_uses_1_with_a_warning_and_int8_is_refused(tiny_llama):
    with pytest.warns(UserWarning, match="fp8 KV cache without calibrated scales: using scale 1.0"):
        engine = Engine(str(tiny_llama), EngineConfig(kv_cache_dtype="fp8", max_model_len=256))
    assert torch.equal(engine.model.model.layers[0].self_attn.v_scale, torch.ones(2))
    with pytest.raises(SlimlmError, match="has no KV-cache scales, which an int8 KV cache needs; calibrate them"):
        Engine(str(tiny_llama), EngineConfig(kv_cache_dtype="int8", max_model_len=256))
    with pytest.raises(SlimlmError, match="kv_cache_dtype 'int2' is not one of auto, fp8, int8, int4"):
        EngineConfig(kv_cache_dtype="int2")


def _broken(model_dir, tmp_path, edit) -> str:
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    edit(tensors)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "slimlm.json").unlink()  # the file hashes would catch the edit first; this is about the contents
    return str(bad)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.pop("model.layers.1.self_attn.v_scale"), "model.layers.1.self_attn.v_scale is missing"),
        (lambda t: t["model.layers.0.self_attn.k_scale"].fill_(float("nan")), "k_scale holds NaN or Inf"),
        (lambda t: t["model.layers.0.self_attn.k_scale"].fill_(0), "finite and positive"),
        (lambda t: t.update({"model.layers.0.self_attn.k_scale": torch.ones(3)}), "implies a float"),
    ],
    ids=["missing", "nan", "zero", "shape"],
)
def test_bad_kv_scales_are_named(kv_checkpoint, tmp_path, edit, message):
    model_dir, _ = kv_checkpoint
    with pytest.raises(SlimlmError, match=message):
        Engine(_broken(model_dir, tmp_path, edit), EngineConfig(max_model_len=256))


def test_an_unsupported_kv_cache_scheme_is_named(kv_checkpoint, tmp_path):
    model_dir, _ = kv_checkpoint
    bad = tmp_path / "scheme"
    shutil.copytree(model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"]["num_bits"] = 4
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(SlimlmError, match="kv_cache_scheme num_bits=4 type=.* is not supported"):
        Engine(str(bad), EngineConfig(max_model_len=256))


def int4_reference(tiny_llama, offsets: list[torch.Tensor]):
    """transformers' Llama whose attention sees every K (after RoPE) and V as 4-bit rows hold them: keys rounded
    less the engine's offsets μ and given them back (attention cannot tell: q·μ shifts every score alike)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    rotary, layer = modeling_llama.apply_rotary_pos_emb, {}

    def rounded(x: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
        if offset is None:
            return kv_int4.dequantize(kv_int4.quantize(x), x.dtype)
        shift = offset[:, None]  # [B, H, T, D] against μ [H, D]
        return kv_int4.dequantize(kv_int4.quantize(x, shift), x.dtype) + shift

    def rotary_then_quantize(q, k, cos, sin, *args, **kwargs):
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        return q, rounded(k, offsets[layer["i"]])

    heads = model.config.num_key_value_heads
    for i, block in enumerate(model.model.layers):
        block.self_attn.register_forward_pre_hook(lambda _m, _a, i=i: layer.update(i=i))
        block.self_attn.v_proj.register_forward_hook(
            lambda _m, _x, out: rounded(out.unflatten(-1, (heads, -1))).flatten(-2)
        )
    return model, rotary_then_quantize


def test_int4_prompt_logprobs_and_greedy_tokens_match_transformers_through_the_same_rows(tiny_llama, monkeypatch):
    from transformers.models.llama import modeling_llama

    llm = LLM(str(tiny_llama), kv_cache_dtype="int4", block_size=8, max_num_batched_tokens=32)
    assert llm.engine.runner.kv_cache.dtype == torch.uint8
    offsets = [layer.self_attn.k_offset for layer in llm.engine.model.model.layers]
    reference, patched = int4_reference(tiny_llama, offsets)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", patched)
    assert_prompt_logprobs_match(llm, reference, tiny_llama)  # prefilled in chunks
    assert_greedy_matches(llm, reference, (5, 19), 12)


@pytest.mark.parametrize("kv_dtype", ["int4", "fp8"])
def test_key_offsets_are_the_mean_key_of_a_fixed_text(tiny_llama, kv_dtype):
    """A 4-bit or fp8 cache's offsets: each layer's mean key (after RoPE) per KV head and channel over
    KEY_OFFSET_TEXT (its first max_model_len tokens), as transformers computes the keys; the same on every load;
    none for int8 or float caches."""
    config = EngineConfig(kv_cache_dtype=kv_dtype, max_model_len=256)
    offsets = [layer.self_attn.k_offset for layer in Engine(str(tiny_llama), config).model.model.layers]
    for ours, theirs in zip(offsets, mean_keys(tiny_llama, 256), strict=True):  # as far as the context goes
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    again = Engine(str(tiny_llama), config).model.model.layers
    assert all(torch.equal(a, b.self_attn.k_offset) for a, b in zip(offsets, again, strict=True))
    assert Engine(str(tiny_llama), EngineConfig(max_model_len=256)).model.model.layers[0].self_attn.k_offset is None


def test_a_calibrated_checkpoints_key_offsets_are_used_and_checked(kv_checkpoint, tmp_path):
    """compress kv's key offsets (its calibration's mean keys) take the place of the fixed text's, for an fp8 or
    4-bit cache; a file that does not fit the model is named in one line."""
    model_dir, _ = kv_checkpoint
    stored = json.loads((model_dir / kv_cache.KEY_OFFSETS_FILE).read_text())["key_offsets"]
    for kv_dtype in ("fp8", "int4"):
        engine = Engine(str(model_dir), EngineConfig(kv_cache_dtype=kv_dtype, max_model_len=256))
        for layer, want in zip(engine.model.model.layers, stored, strict=True):
            assert torch.equal(layer.self_attn.k_offset, torch.tensor(want))
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    (bad / kv_cache.KEY_OFFSETS_FILE).write_text(json.dumps({"key_offsets": stored[:-1]}))
    with pytest.raises(SlimlmError, match=r"key offsets of shape \[1, 2, 16\].*needs finite \[2, 2, 16\]"):
        Engine(str(bad), EngineConfig(kv_cache_dtype="fp8", max_model_len=256))
    (bad / kv_cache.KEY_OFFSETS_FILE).unlink()
    with pytest.raises(SlimlmError, match="unreadable key offsets"):
        Engine(str(bad), EngineConfig(kv_cache_dtype="fp8", max_model_len=256))


def test_an_int8_cache_has_no_key_offsets(kv_checkpoint):
    """int8 rounds to its scale's fixed step: centering would change no key's error, so it is not done."""
    model_dir, _ = kv_checkpoint
    engine = Engine(str(model_dir), EngineConfig(kv_cache_dtype="int8", max_model_len=256))
    assert all(layer.self_attn.k_offset is None for layer in engine.model.model.layers)


def test_int4_holds_head_dim_over_half_of_it_plus_4_times_the_tokens_of_int8(tiny_llama, kv_checkpoint):
    model_dir, _ = kv_checkpoint
    budget = dict(kv_cache_memory=4 << 20, max_model_len=256)
    eight = Engine(str(model_dir), EngineConfig(**budget)).runner
    four = Engine(str(model_dir), EngineConfig(kv_cache_dtype="int4", **budget)).runner  # stored scales unused
    assert four.model.model.layers[0].self_attn.k_scale is None
    assert four.kv_bytes_per_token * 16 == eight.kv_bytes_per_token * (16 // 2 + 4)  # head_dim 16: 12 of 16 bytes
    assert four.num_blocks == (4 << 20) // (four.kv_bytes_per_token * 16)


def test_int4_refuses_a_head_dimension_hadamard_cannot_rotate(tmp_path):
    model = make_tiny_llama(tmp_path / "hd24", hidden=96)  # 4 heads of 24
    with pytest.raises(SlimlmError, match="needs a power-of-two head dimension; this model's is 24"):
        Engine(str(model), EngineConfig(kv_cache_dtype="int4", max_model_len=256))
