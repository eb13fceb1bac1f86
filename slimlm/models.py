"""Turn a `--model` argument into a local directory and load it, float or compressed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from slimlm import SlimlmError, assets

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def resolve(spec: str) -> Path:
    """A bundled asset name, a local directory or a Hugging Face hub id -> a local model directory."""
    if spec in assets.ASSETS:
        if assets.ASSETS[spec].kind != "model":
            raise SlimlmError(f"'{spec}' is a text asset, not a model; models: {_model_assets()}")
        return assets.fetch(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SlimlmError(f"{path} has no config.json; point --model at a Hugging Face model directory")
        return path
    looks_like_hub_id = spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise SlimlmError(
            f"unknown model '{spec}': not a bundled asset ({_model_assets()}), not a local directory, "
            "and not a hub id of the form org/name"
        )
    return _download_from_hub(spec)


def _model_assets() -> str:
    return ", ".join(n for n, a in assets.ASSETS.items() if a.kind == "model")


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    from slimlm.hub import require_hub

    alternative = f"a local directory or the bundled model: --model {assets.DEFAULT_MODEL}"
    require_hub(f"'{repo_id}'", alternative)
    try:
        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # the hub client raises many types; all mean "could not get it"
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SlimlmError(
            f"could not fetch '{repo_id}' from the Hugging Face hub ({reason}); use {alternative}"
        ) from None


def read_config(model_dir: Path) -> dict:
    try:
        with open(model_dir / "config.json", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SlimlmError(f"cannot read {model_dir / 'config.json'}: {e}") from None


def check_architecture(config: dict, where: Path | str) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        arch = ",".join(config.get("architectures") or []) or model_type
        supported = ", ".join(SUPPORTED_ARCHITECTURES.values())
        raise SlimlmError(f"unsupported architecture {arch} in {where}; supported: {supported}")


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SlimlmError(
            f"cannot load a tokenizer from {model_dir} ({reason}); copy the source model's tokenizer files there"
        ) from None


def check(model_dir: Path) -> None:
    """Supported architecture and intact weight files, or a one-line SlimlmError."""
    from slimlm.compress import checkpoint

    check_architecture(read_config(model_dir), model_dir)
    checkpoint.verify(model_dir)


def load_empty(model_dir: Path):
    """(model with meta-device weights, tokenizer) for a float checkpoint: layers are loaded on demand."""
    from slimlm.compress import offload

    check(model_dir)
    return offload.empty_model(model_dir), load_tokenizer(model_dir)


def load(spec: str, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer, model_dir) for a float or quantized (compressed-tensors, GPTQ v1) checkpoint.

    Quantized checkpoints come back as float models holding the dequantized weights: exactly the
    function the quantized checkpoint computes, which is what perplexity and calibration need.
    """
    from transformers import AutoModelForCausalLM

    from slimlm.compress import checkpoint

    model_dir = resolve(spec)
    check(model_dir)
    tokenizer = load_tokenizer(model_dir)
    if "quantization_config" in read_config(model_dir):
        model = checkpoint.load_compressed(model_dir, dtype)
    else:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    return model, tokenizer, model_dir
