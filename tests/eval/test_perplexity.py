import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimlm import data
from slimlm.eval.perplexity import engine_for, perplexity


def test_runtime_perplexity_matches_transformers_loss(tiny_llama, calib_txt):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    result = perplexity(engine_for(str(tiny_llama), 32), str(calib_txt), seq_len=32, max_tokens=160, progress=False)
    assert result["windows"] == 5 and result["tokens_scored"] == 5 * 31
    ids = data.token_stream(data.passages(str(calib_txt)), tokenizer, max_tokens=160)
    x = data.windows(ids, 32, 5)
    with torch.no_grad():
        loss = model(input_ids=x, labels=x).loss  # mean over all 5 × 31 predicted tokens
    assert math.isclose(result["perplexity"], math.exp(loss.item()), rel_tol=1e-5)
