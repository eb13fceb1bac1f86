"""Integration on the real default model, SmolLM2-135M, with small calibration."""

import json

import pytest
import torch

from slimlm import models
from slimlm.eval.perplexity import engine_for, perplexity
from slimlm.formats import shards
from tests.conftest import transformers_logits_error

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rtn_checkpoint(smollm2_w4):
    return smollm2_w4


def test_converted_model_is_the_real_smollm2(smollm2):
    model, tokenizer, _ = models.load("smollm2-135m")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax().item()
    assert tokenizer.decode(nxt).strip() == "Paris"


def test_rtn_w4_g64_quality_and_size(smollm2, rtn_checkpoint):
    p0 = perplexity(engine_for("smollm2-135m", 512), "wiki", seq_len=512, max_tokens=2048, progress=False)["perplexity"]
    p1 = perplexity(engine_for(str(rtn_checkpoint), 512), "wiki", 512, max_tokens=2048, progress=False)["perplexity"]
    assert 10 < p0 < 60
    assert p0 < p1 < 1.6 * p0  # 4-bit RTN costs something, but the model still works
    assert shards.total_size(rtn_checkpoint) < 0.35 * shards.total_size(smollm2)
    meta = json.loads((rtn_checkpoint / "slimlm.json").read_text())
    assert len(meta["layers"]) == 30 and meta["calibration"] is None  # RTN read no calibration data


def test_transformers_loads_the_real_checkpoint(rtn_checkpoint):
    assert transformers_logits_error(rtn_checkpoint, seq_len=48) < 1e-4
