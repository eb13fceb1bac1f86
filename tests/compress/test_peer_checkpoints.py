"""Checkpoints written by llm-compressor (scripts/peers/llmcompressor_fixture.py) read back exactly."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slimlm import models
from slimlm.formats import reader

FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.mark.parametrize("name", ["llmcompressor-gptq-w4g32-sym", "llmcompressor-gptq-w4g32-asym"])
def test_llmcompressor_checkpoint_matches_its_own_logits(name):
    ref = load_file(FIXTURES / name / "reference.safetensors")
    model = models.load(str(FIXTURES / name))[0]
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    assert ((logits - ref["logits"]).norm() / ref["logits"].norm()).item() < 1e-5
    quantized, _ = reader.read_checkpoint(FIXTURES / name)
    assert len(quantized) == 14 and all(q.args.group_size == 32 for q in quantized.values())
    assert all((q.zero is None) == name.endswith("-sym") for q in quantized.values())
