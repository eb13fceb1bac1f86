"""Which device a command runs on."""

from __future__ import annotations

import torch

from slimlm import SlimlmError


def resolve_device(device: str | None) -> torch.device:
    """--device: default cuda when there is one, else cpu; an unavailable device is a one-line error."""
    name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise SlimlmError(f"--device {name!r} is not a device; use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SlimlmError(f"--device {name}: no CUDA device is available here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise SlimlmError(f"--device {name}: slimlm runs on cpu or cuda")
    return dev
