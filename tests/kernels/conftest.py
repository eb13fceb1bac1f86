"""Kernel tests: fresh random inputs, outputs poisoned, references in float64."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer a kernel allocates starts as NaN (floats) or garbage (ints), so an unwritten element shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else 77)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(empty_like(*a, **kw)))
