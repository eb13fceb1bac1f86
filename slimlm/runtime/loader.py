"""Build a runtime model from a checkpoint directory: float, compressed-tensors, GPTQ v1 or AWQ GEMM.

Quantized linears are repacked once into the kernels' layout (slimlm.kernels.packed) and never exist as
float matrices. Widths the kernels do not cover (2- and 3-bit) run as dequantized float weights, with a
warning, rather than being refused.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from slimlm import SlimlmError, models
from slimlm.compress import checkpoint
from slimlm.kernels import pack
from slimlm.kernels.packed import KERNEL_BITS
from slimlm.runtime.model import CausalLM


def hf_config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)  # no trust_remote_code: only the built-in architectures


def load_model(model_dir: Path, dtype: torch.dtype, device: str, max_positions: int) -> CausalLM:
    """The model in `model_dir`, which the caller has checked (models.check: architecture, file hashes)."""
    config = hf_config(model_dir)
    with torch.device("meta"):  # no memory until the checkpoint's tensors are put in place
        model = CausalLM(config, dtype)
    quantized = {}
    if "quantization_config" in models.read_config(model_dir):
        quantized, tensors = checkpoint.read_quantized(model_dir)
    else:
        tensors = checkpoint.read_tensors(model_dir)
    if config.tie_word_embeddings or ("lm_head.weight" not in tensors and "lm_head" not in quantized):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    narrow = sorted({q.args.bits for q in quantized.values()} - set(KERNEL_BITS))
    if narrow:
        warnings.warn(f"no kernel for {narrow}-bit weights: they run dequantized to {dtype}", stacklevel=2)
    for name, q in quantized.items():
        if q.args.bits in KERNEL_BITS:
            model.get_submodule(name).set_packed(pack(q).to(device))
        else:
            tensors[f"{name}.weight"] = q.dequantize(dtype)
    for name, _ in list(model.named_parameters()):
        if name not in tensors:
            raise SlimlmError(f"{model_dir} has no tensor '{name}': the checkpoint is incomplete")
        module, _, attr = name.rpartition(".")
        weight = torch.nn.Parameter(tensors[name].to(device, dtype), requires_grad=False)
        setattr(model.get_submodule(module), attr, weight)
    model.set_rope(max_positions, device)
    return model.eval()
