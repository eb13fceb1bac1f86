"""Which device a command runs on."""

from __future__ import annotations

import torch

from slimlm.errors import FieldError
from slimlm.kernels.cpu_library import cpu_flags


def resolve_device(device: str | None) -> torch.device:
    """--device: default cuda when there is one, else cpu; an unavailable device is a one-line error."""
    name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise FieldError("device", f"{name!r} is not a device; use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FieldError("device", f"{{device}} {name}: no CUDA device is available here; use {{device}} cpu")
    if dev.type not in ("cpu", "cuda"):
        raise FieldError("device", f"{name}: slimlm runs on cpu or cuda")
    return dev


def available_memory(device: torch.device | str) -> int:
    """Bytes still free on `device`: a GPU's free memory, or what Linux can hand out without swapping."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def fast_bf16_matmul(device: torch.device) -> bool:
    """Whether bf16 matrix products run faster than fp32 here: CUDA GPUs with bf16, and CPUs with AVX-512 BF16
    or AMX (measured here: 5.9× fp32's rate on one core) whose torch runs its AVX-512 kernels (not capped at
    AVX2 by ATEN_CPU_CAPABILITY, as the AVX2 checks run). Elsewhere the CPU emulates bf16 far slower."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    flags = cpu_flags()
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and torch.backends.cpu.get_cpu_capability() == "AVX512"


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as configs and results spell it: bfloat16, not torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


COMPUTE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def fast_dtype(stored: torch.dtype, device: torch.device) -> torch.dtype:
    """The machine's fast dtype, not the checkpoint's: bf16 where bf16 products are fast, else fp32 (a bf16
    checkpoint on an AVX2 CPU ran its passes at 3.3 GFLOP/s in bf16 against 18 in fp32); fp16 weights stay
    fp16 on a GPU. What `auto` means for calibration passes and for the runtime's activations alike."""
    if stored == torch.float16 and device.type == "cuda":
        return stored
    return torch.bfloat16 if fast_bf16_matmul(device) else torch.float32


def compute_dtype(choice: str, stored: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype calibration passes run in: auto is `fast_dtype`. Only activations and products change: the
    weights are quantized from their stored values."""
    if choice not in COMPUTE_DTYPES:
        raise FieldError("compute_dtype", f"{choice!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[choice] or fast_dtype(stored, device)
