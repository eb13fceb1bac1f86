"""A checkpoint's contents: tensors stored once, the quantization config per format, metadata files."""

import json

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig

from slimlm import SlimlmError
from slimlm.formats import compressed_tensors, gptq_v1, manifest, writer
from slimlm.formats.quantized import QuantArgs, QuantizedWeight
from tests.conftest import make_tokenizer


def quantized(args: QuantArgs, rows: int = 4, cols: int = 64) -> QuantizedWeight:
    torch.manual_seed(0)
    codes = torch.randint(args.qmin, args.qmax + 1, (rows, cols), dtype=torch.int8)
    return QuantizedWeight(codes, torch.rand(rows, cols // 32) + 0.1, None, args)


def test_state_tensors_keep_tied_weights_once_under_their_first_name_contiguous_and_detached():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(6, 4)
    model.head = torch.nn.Linear(4, 6, bias=False)
    model.head.weight = model.embed.weight  # tied
    model.proj = torch.nn.Linear(4, 3)
    model.proj.weight = torch.nn.Parameter(torch.randn(3, 4).T.contiguous().T)  # a transposed view
    out = writer.state_tensors(model)
    assert list(out) == ["embed.weight", "proj.weight", "proj.bias"]
    assert all(t.is_contiguous() and not t.requires_grad for t in out.values())
    assert torch.equal(out["proj.weight"], model.proj.weight)


def test_an_unknown_format_is_named_with_the_choices():
    with pytest.raises(SlimlmError) as e:
        writer.quantization_config("awq", QuantArgs(), [], {})
    assert str(e.value) == "format awq is not supported; use one of compressed-tensors, gptq"


def test_gptq_format_refuses_kv_scales_and_a_second_scheme():
    args = QuantArgs(4, 128)
    with pytest.raises(SlimlmError) as e:
        writer.quantization_config("gptq", args, [], {"kv_cache_scheme": {"num_bits": 8}})
    assert str(e.value) == (
        "format gptq has no place for KV-cache scales; use format compressed-tensors to quantize the KV cache too"
    )
    with pytest.raises(SlimlmError) as e:
        writer.quantization_config("gptq", args, [], {}, named={"lm_head": QuantArgs(8, -1)})
    assert str(e.value) == (
        "format gptq stores one scheme for every linear; use format compressed-tensors for an lm_head of other bits "
        "or a budget's mix"
    )
    with pytest.raises(SlimlmError, match="one scheme for every linear"):
        writer.quantization_config("gptq", args, [], {}, layers={"model.layers.0.mlp.up_proj": QuantArgs(8, 128)})
    same = writer.quantization_config("gptq", args, [], {"act_order": "group", "damp": 0.05}, named={"x": args})
    assert same == gptq_v1.quantization_config(args, "group", 0.05) and same["desc_act"] is True


def test_compressed_tensors_config_carries_act_order_kv_scheme_and_named_schemes():
    args, kv = QuantArgs(4, 64, False), {"num_bits": 8, "type": "float", "strategy": "tensor"}
    named = {"lm_head": QuantArgs(8, -1)}
    got = writer.quantization_config(
        "compressed-tensors", args, ["lm_head"], {"act_order": "group", "kv_cache_scheme": kv}, named
    )
    assert got == compressed_tensors.quantization_config(args, ["lm_head"], "group", kv, named)
    assert got != compressed_tensors.quantization_config(args, ["lm_head"], None, None, None)


@pytest.mark.parametrize(
    ("fmt", "per_linear"), [("gptq", gptq_v1.to_tensors), ("compressed-tensors", compressed_tensors.to_tensors)]
)
def test_quantized_tensors_replace_each_weight_with_its_formats_tensors(fmt, per_linear):
    q = quantized(QuantArgs(4, 32))
    floats = {"a.weight": torch.ones(4, 64), "a.bias": torch.zeros(4), "norm.weight": torch.ones(64)}
    out = writer.quantized_tensors({"a": q}, floats, fmt)
    expected = {f"a.{k}": v for k, v in per_linear(q).items()}
    assert set(out) == {"a.bias", "norm.weight", *expected}
    assert all(torch.equal(out[k], v) and out[k].device.type == "cpu" for k, v in expected.items())
    assert "a.weight" in floats  # the caller's dict is left alone


def test_metadata_files_config_patch_generation_config_tokenizer_and_manifest(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=1)
    patch = {"quantization_config": {"quant_method": "gptq"}, "num_key_value_heads": 2}
    meta = {"method": "gptq", "arguments": {"damp": 0.01}}
    writer.write_metadata(
        tmp_path, ["model.safetensors"], config, make_tokenizer(), meta, patch, GenerationConfig(max_new_tokens=7)
    )
    text = (tmp_path / "config.json").read_text()
    data = json.loads(text)
    assert data["quantization_config"] == {"quant_method": "gptq"} and data["num_key_value_heads"] == 2
    assert data["hidden_size"] == 64
    assert text == json.dumps(data, indent=2, sort_keys=True) + "\n"
    assert json.loads((tmp_path / "generation_config.json").read_text())["max_new_tokens"] == 7
    assert (tmp_path / "tokenizer.json").exists()
    saved = manifest.read(tmp_path)
    assert saved["method"] == "gptq" and saved["arguments"] == {"damp": 0.01}
    assert set(saved["files"]) == {"model.safetensors"} and saved["size_bytes"] == len(b"weights")


def test_metadata_without_patch_or_generation_config_writes_the_config_as_transformers_does(tmp_path):
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=1)
    writer.write_metadata(tmp_path, [], config, make_tokenizer(), {"method": "float"})
    config.save_pretrained(tmp_path / "plain")
    assert (tmp_path / "config.json").read_text() == (tmp_path / "plain" / "config.json").read_text()
    assert not (tmp_path / "generation_config.json").exists()
