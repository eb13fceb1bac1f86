"""KV-cache calibration: the scales are the largest cached |K| (after RoPE) and |V| per head over the
calibration data, divided by the dtype's range, computed here from transformers' own KV cache."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from slimlm import SlimlmError, data, models
from slimlm.compress.job import CalibData, Quantization, quantize_weights
from slimlm.compress.kv import KVCache
from slimlm.compress.rtn import RTN
from slimlm.formats import kv_cache
from slimlm.formats.quantized import QuantArgs


def _reference_cache(model_dir, calib) -> list:
    """transformers' KV cache (keys after RoPE) of each layer over the calibration windows."""
    model, tokenizer, _ = models.load(str(model_dir))
    windows = data.calibration_windows(str(calib), tokenizer, 8, 64, 0)
    with torch.no_grad():
        return model(input_ids=windows, use_cache=True).past_key_values.layers


def _reference_amax(model_dir, calib) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, per KV head: max |K| and max |V| in transformers' KV cache over the calibration windows."""
    layers = _reference_cache(model_dir, calib)
    return [(layer.keys.abs().amax(dim=(0, 2, 3)), layer.values.abs().amax(dim=(0, 2, 3))) for layer in layers]


@pytest.mark.parametrize("kv_dtype,strategy", [("fp8", "tensor"), ("int8", "attn_head")])
def test_scales_are_the_cached_amax_over_the_dtype_range(tiny_llama, calib_txt, tmp_path, kv_dtype, strategy):
    calib = CalibData(str(calib_txt), 8, 64, batch_size=4, compute_dtype="float32")
    out = quantize_weights(
        Quantization(
            "kv", [KVCache(kv_dtype, strategy)], None, str(tiny_llama), tmp_path / "kv", calib, report_error=False
        ),
        progress=False,
    )
    tensors = load_file(out / "model.safetensors")
    limit = kv_cache.KV_DTYPES[kv_dtype][1]
    for i, (k_amax, v_amax) in enumerate(_reference_amax(tiny_llama, calib_txt)):
        k_name, v_name = kv_cache.scale_names(i)
        for name, amax in ((k_name, k_amax), (v_name, v_amax)):
            want = amax.max().reshape(1) if strategy == "tensor" else amax.reshape(-1, 1, 1)
            torch.testing.assert_close(tensors[name], want / limit, rtol=1e-4, atol=0)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["kv_cache_scheme"] == kv_cache.scheme(kv_dtype, strategy)
    assert qcfg["config_groups"] == {} and qcfg["format"] == "dense"
    assert torch.equal(
        tensors["model.layers.0.mlp.up_proj.weight"],
        load_file(tiny_llama / "model.safetensors")["model.layers.0.mlp.up_proj.weight"],
    )


def test_key_offsets_are_the_mean_cached_key_per_head_and_channel(tiny_llama, calib_txt, tmp_path):
    """key_offsets.json beside the weights (named in slimlm.json, out of the safetensors that vLLM and
    transformers load): each layer's mean key after RoPE [kv_heads, head_dim] over the calibration windows."""
    calib = CalibData(str(calib_txt), 8, 64, batch_size=4, compute_dtype="float32")
    out = quantize_weights(
        Quantization("kv", [KVCache("fp8")], None, str(tiny_llama), tmp_path / "kv", calib, report_error=False),
        progress=False,
    )
    assert json.loads((out / "slimlm.json").read_text())["kv_cache"]["key_offsets"] == kv_cache.KEY_OFFSETS_FILE
    stored = json.loads((out / kv_cache.KEY_OFFSETS_FILE).read_text())["key_offsets"]
    assert not any("offset" in name for name in load_file(out / "model.safetensors"))
    layers = _reference_cache(tiny_llama, calib_txt)
    assert len(stored) == len(layers)
    for got, layer in zip(stored, layers, strict=True):
        torch.testing.assert_close(torch.tensor(got), layer.keys.mean(dim=(0, 2)), rtol=1e-5, atol=1e-5)


def test_kv_alone_keeps_a_bf16_sources_weights_as_stored(tiny_llama, calib_txt, tmp_path):
    """The passes run in fp32, but the weights a KV step leaves alone are written as the source stores them:
    a bf16 model's checkpoint is not doubled in size (a 1.5B's 3.5 GB became 7 GB, and the writer's pending
    shard outgrew a 4 GB memory cap)."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).save_pretrained(source)
    for f in tiny_llama.glob("tokenizer*"):
        (source / f.name).write_bytes(f.read_bytes())
    calib = CalibData(str(calib_txt), 4, 64, compute_dtype="float32")
    out = quantize_weights(
        Quantization("kv", [KVCache("fp8")], None, str(source), tmp_path / "kv", calib), progress=False
    )
    before, after = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    for name, t in before.items():
        assert after[name].dtype == torch.bfloat16 and torch.equal(after[name], t), name
    assert after[kv_cache.scale_names(0)[0]].dtype == torch.float32  # the new scales as calibrated
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_kv_composes_with_weight_quantization_in_one_run(tiny_llama, calib_txt, tmp_path):
    args = QuantArgs(4, 32, True)
    calib = CalibData(str(calib_txt), 8, 64)
    out = quantize_weights(
        Quantization("rtn+kv", [RTN(args), KVCache("fp8")], args, str(tiny_llama), tmp_path / "w4kv", calib),
        progress=False,
    )
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "pack-quantized" and qcfg["kv_cache_scheme"]["type"] == "float"
    tensors = load_file(out / "model.safetensors")
    assert "model.layers.1.self_attn.k_proj.weight_packed" in tensors
    assert tensors["model.layers.1.self_attn.v_scale"].shape == (1,)


def test_kv_on_a_quantized_checkpoint_keeps_its_packed_weights(tiny_llama, calib_txt, tmp_path):
    args = QuantArgs(4, 32, True)
    w4 = quantize_weights(
        Quantization("rtn", [RTN(args)], args, str(tiny_llama), tmp_path / "w4", report_error=False), progress=False
    )
    out = quantize_weights(
        Quantization(
            "kv", [KVCache("int8", "attn_head")], None, str(w4), tmp_path / "w4-kv", CalibData(str(calib_txt), 8, 64)
        ),
        progress=False,
    )
    before, after = load_file(w4 / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(after) - set(before) == {n for i in range(2) for n in kv_cache.scale_names(i)}
    assert all(torch.equal(before[k], after[k]) for k in before)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["config_groups"] == json.loads((w4 / "config.json").read_text())["quantization_config"]["config_groups"]
    assert qcfg["kv_cache_scheme"]["strategy"] == "attn_head"


def test_kv_refuses_a_gptq_format_source_and_output(tiny_llama, calib_txt, tmp_path):
    args = QuantArgs(4, 32, True)
    v1 = quantize_weights(
        Quantization("rtn", [RTN(args)], args, str(tiny_llama), tmp_path / "v1", report_error=False, fmt="gptq"),
        progress=False,
    )
    with pytest.raises(SlimlmError, match="gptq checkpoint, which has no place for KV-cache scales"):
        quantize_weights(
            Quantization("kv", [KVCache("fp8")], None, str(v1), tmp_path / "x", CalibData(str(calib_txt))),
            progress=False,
        )
    with pytest.raises(SlimlmError, match="^format gptq has no place for KV-cache scales"):
        quantize_weights(
            Quantization(
                "rtn+kv",
                [RTN(args), KVCache("fp8")],
                args,
                str(tiny_llama),
                tmp_path / "y",
                CalibData(str(calib_txt)),
                fmt="gptq",
            ),
            progress=False,
        )
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
