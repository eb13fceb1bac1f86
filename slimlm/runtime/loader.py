"""Build a runtime model from a checkpoint directory: float, compressed-tensors, GPTQ v1 or AWQ GEMM.

Quantized linears are repacked once into the kernels' layout (slimlm.kernels.packed) and never exist as
float matrices. Widths the kernels do not cover (2- and 3-bit) run as dequantized float weights, with a
warning, rather than being refused.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from slimlm import kernels
from slimlm.formats import reader
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
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    quantized, tensors = reader.read_checkpoint(model_dir, expected, optional=tied)
    if tied:
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
        module, _, attr = name.rpartition(".")
        weight = torch.nn.Parameter(tensors[name].to(device, dtype), requires_grad=False)
        setattr(model.get_submodule(module), attr, weight)
    model.set_rope(max_positions, device)
    model.set_backend(kernels.select(device))
    return model.eval()
