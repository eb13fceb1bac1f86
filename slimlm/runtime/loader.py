"""Build a runtime model from a checkpoint directory: float, compressed-tensors, GPTQ v1 or AWQ GEMM.

Quantized linears are repacked once into the kernels' layout (slimlm.kernels.packed) and never exist as
float matrices. So are a bf16 model's float linears on CPUs whose C loops take them (cpu_gemm.dense_fits):
those read one row of x ~2× faster than torch's bf16 matmul here, and a decode step is made of such rows.
2- and 3-bit codes are served by the 4-bit kernels (packed.SERVED_BITS). The KV cache's dtype is
decided here too: what the checkpoint's kv_cache_scheme says, or what was asked for, with the checkpoint's
calibrated scales when it has them.
"""

from __future__ import annotations

import ctypes
import warnings
from pathlib import Path

import torch

from slimlm import kernels
from slimlm.errors import SlimlmError
from slimlm.formats import kv_cache, kv_int4, reader
from slimlm.kernels import cpu_gemm, pack
from slimlm.kernels.packed import pack_dense
from slimlm.runtime.model import CausalLM, Linear


def hf_config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)  # no trust_remote_code: only the built-in architectures


FLOAT_KV = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    model_dir: Path, dtype: torch.dtype, device: str, max_positions: int, kv_cache_dtype: str = "auto"
) -> CausalLM:
    """The model in `model_dir`, which the caller has checked (models.check: architecture, file hashes).
    `model.kv_cache_dtype` is the dtype its KV cache pool must have."""
    config = hf_config(model_dir)
    with torch.device("meta"):  # no memory until the checkpoint's tensors are put in place
        model = CausalLM(config, dtype)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()

    def convert(q):  # each linear as read, in the kernels' layout
        release_freed()  # the previous linear's codes and this one's file copy
        return pack(q).to(device)

    quantized, tensors = reader.read_checkpoint(model_dir, expected, optional=tied, convert=convert)
    if tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    scheme = reader.kv_cache_scheme(reader.read_config(model_dir), model_dir)
    attn = model.model.layers[0].self_attn
    scales = None
    if scheme is not None:
        scales = kv_cache.read_scales(tensors, scheme, len(model.model.layers), attn.kv_heads, str(model_dir))
    for name, weight in quantized.items():
        model.get_submodule(name).set_packed(weight)
    del quantized
    release_freed()
    for name, _ in list(model.named_parameters()):  # each original freed as its converted copy takes its place
        module, _, attr = name.rpartition(".")
        tensor = tensors.pop(name)
        # An untied embedding table stays as narrow as stored (a lookup reads a few rows, converted then): a
        # bf16 checkpoint served in fp32 keeps its 151,936-row table at half the bytes (Qwen2.5: 467 MB).
        narrow = name == "model.embed_tokens.weight" and not tied and tensor.dtype.itemsize < dtype.itemsize
        weight = torch.nn.Parameter(tensor.to(device, tensor.dtype if narrow else dtype), requires_grad=False)
        setattr(model.get_submodule(module), attr, weight)
    tensors.clear()  # the modules hold what is needed: joining and packing below then free each original
    model.fuse_projections(release_freed)  # float parts join as they are, before packing: any widths
    backend = kernels.select(device)
    if backend.name == "cpu":
        for module in model.modules():
            if isinstance(module, Linear) and module.packed is None and cpu_gemm.dense_fits(module.weight):
                module.set_packed(pack_dense(module.weight))
                release_freed()
    release_freed()
    model.set_rope(max_positions, device)
    model.set_backend(backend)
    set_kv_cache(model, kv_cache_dtype, scheme, scales, device)
    return model.eval()


def release_freed() -> None:
    """Hand the memory of freed tensors back to the OS (glibc's malloc_trim; elsewhere nothing). Replacing
    weights by joined or packed copies frees their memory inside the heap, where malloc keeps it: a float
    model loaded in fp32 stayed at 1.2 GB resident for 0.54 GB of weights without this, 0.85 GB with it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def set_kv_cache(model: CausalLM, requested: str, scheme: dict | None, scales: list | None, device: str) -> None:
    """Give every attention layer its KV scales and the model its `kv_cache_dtype`. `auto` is what the
    checkpoint's kv_cache_scheme says (else the model's dtype); fp8 without calibrated scales uses 1.0, as
    vLLM does; int8 without them is refused (its range would clip almost every value)."""
    if requested not in kv_cache.CACHE_DTYPES:
        raise SlimlmError(f"KV cache dtype '{requested}' is not one of {', '.join(kv_cache.CACHE_DTYPES)}")
    stored = kv_cache.kv_dtype_of(scheme) if scheme is not None else None
    chosen = stored if requested == "auto" else requested
    layers = [layer.self_attn for layer in model.model.layers]
    if chosen is None or chosen in FLOAT_KV:
        model.kv_cache_dtype = FLOAT_KV.get(chosen, model.model.norm.weight.dtype)
        return
    if chosen == "int4":  # rounded per row as written: no scales (any stored 8-bit ones are not used)
        try:
            kv_int4.rotation(layers[0].head_dim)
        except ValueError:
            raise SlimlmError(
                f"a 4-bit KV cache rotates each head by a Hadamard matrix, which needs a power-of-two "
                f"head dimension; this model's is {layers[0].head_dim} (use int8, calibrated by "
                "compress kv, or a float cache)"
            ) from None
        model.kv_cache_dtype = torch.uint8
        return
    if torch.device(device).type == "cuda" and chosen == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        raise SlimlmError(
            f"an fp8 KV cache needs a GPU of compute capability 8.9 or newer ({device} has "
            f"{torch.cuda.get_device_capability(device)}); use --kv-cache-dtype int8"
        )
    if scales is None:
        if chosen == "int8":
            raise SlimlmError(
                f"{model.config.name_or_path or 'the checkpoint'} has no KV-cache scales, which "
                "an int8 KV cache needs; calibrate them: compress kv MODEL --kv-dtype int8 --out DIR"
            )
        warnings.warn(
            "fp8 KV cache without calibrated scales: using scale 1.0 (compress kv calibrates them)", stacklevel=3
        )
        heads = layers[0].kv_heads
        scales = [(torch.ones(heads), torch.ones(heads)) for _ in layers]
    elif stored != chosen:  # the same calibrated range, mapped onto the other dtype's
        ratio = kv_cache.KV_DTYPES[stored][1] / kv_cache.KV_DTYPES[chosen][1]
        scales = [(k * ratio, v * ratio) for k, v in scales]
    model.kv_cache_dtype = kv_cache.KV_DTYPES[chosen][0]
    head_dim = layers[0].head_dim
    rotated = kv_cache.key_rotation(model.kv_cache_dtype, head_dim) is not None  # keys at a wider scale
    factor = kv_cache.key_scale_factor(head_dim) if rotated else 1.0
    for attn, (k, v) in zip(layers, scales, strict=True):
        attn.k_scale, attn.v_scale = (k * factor).to(device), v.to(device)
