"""Turn a `--model` argument into a local directory and load it, float or compressed."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from slimlm import assets
from slimlm.cache import cache_dir
from slimlm.errors import FieldError, SlimlmError
from slimlm.formats import manifest, reader
from slimlm.formats.reader import read_config

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",  # Qwen2 with q and k RMS-normed per head before RoPE, no q/k/v biases
}

SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def resolve(spec: str) -> Path:
    """A bundled asset name, a local directory or a Hugging Face hub id -> a local model directory."""
    if spec in assets.ASSETS:
        if assets.ASSETS[spec].kind != "model":
            raise SlimlmError(f"'{spec}' is a text asset, not a model; models: {_model_assets()}")
        return assets.fetch(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FieldError("model", f"{path} has no config.json; point {{model}} at a Hugging Face model directory")
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


def check_architecture(config: dict, where: Path | str) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(f"{a} (model_type {t})" for t, a in SUPPORTED_ARCHITECTURES.items())
        archs = config.get("architectures") or []
        if set(archs) & set(SUPPORTED_ARCHITECTURES.values()):  # a supported class name on another model type
            what = f"model_type {model_type!r} (architectures {','.join(archs)})"
        else:
            what = f"architecture {','.join(archs) or model_type}"
        raise SlimlmError(f"unsupported {what} in {where}; supported: {supported}")
    for key in SIZE_FIELDS:
        value = config.get(key)
        if (value is not None or key != "num_key_value_heads") and not (type(value) is int and value > 0):
            raise SlimlmError(f"{where}/config.json: {key} is {value!r}, not a positive integer")


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SlimlmError(
            f"cannot load a tokenizer from {model_dir} ({reason}); copy the source model's tokenizer files there"
        ) from None


def context_length(config: dict) -> int:
    """Tokens one sequence may hold: max_position_embeddings, or the sliding window when that is less
    (within the window, sliding attention is full attention)."""
    context = config.get("max_position_embeddings", 2048)
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        context = min(context, config["sliding_window"])
    return context


def stored_dtype_name(config: dict) -> str:
    """The dtype config.json says the float weights were saved in (transformers 5 writes `dtype`, 4 `torch_dtype`)."""
    return config.get("dtype") or config.get("torch_dtype") or "float32"


def stored_dtype(config: dict) -> torch.dtype:
    """stored_dtype_name as a torch dtype (float32 where it names none)."""
    name = stored_dtype_name(config)
    return getattr(torch, name) if isinstance(getattr(torch, name, None), torch.dtype) else torch.float32


def check(model_dir: Path) -> dict:
    """Supported architecture and intact weight files, or a one-line SlimlmError; returns config.json."""
    config = read_config(model_dir)
    check_architecture(config, model_dir)
    try:
        manifest.verify(model_dir)
    except SlimlmError as e:
        asset = next((n for n in assets.ASSETS if Path(model_dir).resolve() == (cache_dir() / n).resolve()), None)
        if asset is None:
            raise
        fix = f"run: compress assets fetch {asset} --force"
        raise SlimlmError(f"the cached asset {asset} is damaged ({e}); {fix}") from None
    return config


def empty_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers model with meta-device parameters (no memory) and real buffers (rotary tables)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        config = AutoConfig.from_pretrained(model_dir)  # no trust_remote_code: only the built-in architectures
        if hasattr(config, "quantization_config"):  # slimlm's readers dequantize; transformers' must not run
            del config.quantization_config
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SlimlmError(f"{model_dir}/config.json does not describe a model transformers builds ({reason})") from None
    return model.eval()


def tied_lm_head(config) -> set[str]:
    """Parameter names a checkpoint may leave out because they are tied to another one."""
    return {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()


def load(spec: str, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer, model_dir) for a float or quantized checkpoint of any format slimlm reads.

    Quantized checkpoints come back as float models holding the dequantized weights: exactly the
    function the quantized checkpoint computes, which is what perplexity and calibration need. Every
    parameter must come from the checkpoint (a missing one is an error, never a random initialisation).
    """
    model_dir = resolve(spec)
    check(model_dir)
    tokenizer = load_tokenizer(model_dir)
    model = empty_model(model_dir, dtype)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    quantized, tensors = reader.read_checkpoint(model_dir, expected, tied_lm_head(model.config))
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    state.update({f"{n}.weight": q.dequantize(dtype) for n, q in quantized.items()})
    model.load_state_dict(state, strict=False, assign=True)
    if tied_lm_head(model.config):
        model.tie_weights()
    return model.eval(), tokenizer, model_dir
