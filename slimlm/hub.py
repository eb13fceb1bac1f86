"""Fail fast and clearly when the Hugging Face hub cannot be reached.

The hub clients retry with backoff for half a minute before giving up on a machine without network; one
short connection attempt tells the same thing at once.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

from slimlm.errors import SlimlmError


def hub_address() -> tuple[str, int]:
    """(host, port) of HF_ENDPOINT (default https://huggingface.co); the port from the URL or its scheme."""
    url = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        port = url.port
    except ValueError:
        port = None
    return url.hostname or "huggingface.co", port or (80 if url.scheme == "http" else 443)


def _offline_by_env() -> bool:
    return any(
        os.environ.get(v, "0") not in ("", "0", "false", "False") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def require_hub(what: str, offline_alternative: str) -> None:
    if _offline_by_env():
        reason = "HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set"
    else:
        host, port = hub_address()
        try:
            socket.create_connection((host, port), timeout=5).close()
            return
        except OSError as e:
            reason = f"{host}:{port}: {e.strerror or e}"
    raise SlimlmError(f"cannot fetch {what} from the Hugging Face hub ({reason}); offline, use {offline_alternative}")
