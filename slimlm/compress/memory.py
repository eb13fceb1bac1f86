"""Returning freed memory to the operating system between layers."""

from __future__ import annotations

import ctypes
import gc


def _glibc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return None


_LIBC = _glibc()


def return_freed_memory() -> None:
    """Hand memory freed by the last layer back to the OS.

    glibc keeps freed blocks below its (self-raising) mmap threshold in the heap, so without this the
    process grows by roughly a layer's working set per layer even though that memory is free.
    """
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
