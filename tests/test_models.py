import json
import shutil

import pytest
import torch

from slimlm import SlimlmError, models


def test_unknown_name_and_missing_directory(tmp_path):
    with pytest.raises(SlimlmError, match="unknown model 'llama-7'.*smollm2-135m"):
        models.resolve("llama-7")
    with pytest.raises(SlimlmError, match="unknown model"):
        models.resolve(str(tmp_path / "missing" / "dir"))


def test_hub_unreachable_names_the_offline_alternative():
    with pytest.raises(SlimlmError, match=r"cannot fetch 'someorg/somemodel'.*--model smollm2-135m"):
        models.resolve("someorg/somemodel")


def test_text_asset_is_not_a_model():
    with pytest.raises(SlimlmError, match="'owt' is a text asset"):
        models.resolve("owt")


def test_unsupported_architecture(tiny_llama, tmp_path):
    d = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SlimlmError, match="unsupported architecture GPT2LMHeadModel.*LlamaForCausalLM"):
        models.load(str(d))


def test_no_safetensors(tiny_llama, tmp_path):
    d = tmp_path / "nosafe"
    shutil.copytree(tiny_llama, d)
    (d / "model.safetensors").unlink()
    with pytest.raises(SlimlmError, match="no .safetensors weights"):
        models.load(str(d))


def test_missing_tokenizer(tiny_llama, tmp_path):
    d = tmp_path / "notok"
    shutil.copytree(tiny_llama, d)
    for f in d.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(SlimlmError, match="cannot load a tokenizer from"):
        models.load(str(d))


def test_hub_endpoint_port_is_probed(monkeypatch):
    from slimlm import hub

    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.local:8080/hf")
    assert hub.hub_address() == ("mirror.local", 8080)
    monkeypatch.setenv("HF_ENDPOINT", "https://hf.example.org")
    assert hub.hub_address() == ("hf.example.org", 443)


@pytest.mark.parametrize(
    ("config", "want"),
    [
        ({"dtype": "bfloat16"}, torch.bfloat16),
        ({"torch_dtype": "float16"}, torch.float16),  # transformers 4's key
        ({"dtype": "float32", "torch_dtype": "bfloat16"}, torch.float32),  # transformers 5's key wins
        ({}, torch.float32),
        ({"dtype": "Tensor"}, torch.float32),  # a torch attribute that is not a dtype
    ],
)
def test_the_stored_dtype_is_read_from_config(config, want):
    assert models.stored_dtype(config) == want
