"""Kernel tests: fresh random inputs, outputs poisoned, references in float64."""

from __future__ import annotations

import pytest

from tests.kernels.problems import poisoned_allocations


@pytest.fixture
def poisoned():
    """Every buffer a kernel allocates starts as NaN or garbage, so an unwritten element shows."""
    with poisoned_allocations():
        yield
