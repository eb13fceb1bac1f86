"""The runtime on the real default model: token-for-token greedy parity with transformers."""

import pytest
import torch

from slimlm import models
from slimlm.formats import reader
from slimlm.runtime.llm import LLM
from slimlm.runtime.sampling import SamplingParams
from tests.runtime.conftest import model_logprobs

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "Q: What is 12 times 7?\nA:",
    "The mitochondria is",
    "import numpy as np\n\ndef normalize(x):",
    "Translate to French: Good morning, how are you?",
    "Water boils at",
    "The three laws of motion were described by",
    "Write a haiku about autumn leaves.",
    "In 1969, Apollo 11",
    "SELECT name, age FROM users WHERE",
    "A recipe for pancakes needs flour, eggs,",
    "The quick brown fox",
    "Photosynthesis converts sunlight, water and carbon dioxide into glucose and oxygen. Explain why this matters "
    "for the food chain, for the atmosphere, and for the climate of the planet over long periods of time:",
    "<|im_start|>user\nWhat is the tallest mountain on Earth?<|im_end|>\n<|im_start|>assistant\n",
    "Here is a short story about a robot who learns to paint. The robot lived in a workshop full of brushes, jars "
    "and half-finished canvases, and every night it watched the old painter work until the candles burned out.",
    "1, 1, 2, 3, 5, 8,",
    "The best way to learn a new programming language is",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def expected(smollm2) -> list[list[int]]:
    model, tok, _ = models.load("smollm2-135m")
    out = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def test_greedy_one_at_a_time_equals_transformers(expected):
    llm = LLM("smollm2-135m")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    got = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    assert got == expected


def test_greedy_in_one_continuous_batch_with_chunks_and_preemption_equals_transformers(expected):
    # 16 blocks of 16 tokens for 20 sequences of up to ~70 tokens: sequences must be preempted and recomputed
    per_block = 30 * 2 * 16 * 3 * 64 * 4
    llm = LLM("smollm2-135m", kv_cache_memory=16 * per_block, max_num_batched_tokens=32, max_model_len=256)
    preempt, count = llm.engine.scheduler._preempt, []
    llm.engine.scheduler._preempt = lambda seq: (count.append(seq.seq_id), preempt(seq))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert count and llm.engine.blocks.num_free == llm.engine.runner.num_blocks


def test_w4_checkpoint_logits_equal_transformers(smollm2_w4):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(smollm2_w4))
    ids = llm.tokenizer.encode(PROMPTS[15])
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    got = torch.tensor(out.prompt_logprobs)

    # The kernels keep scales in fp16 (4 bytes less per group than fp32); transformers uses the checkpoint's
    # fp32 scales. Over 30 layers that moves log-probabilities by up to ~0.01 (measured 0.009)...
    hf = AutoModelForCausalLM.from_pretrained(smollm2_w4, dtype=torch.float32)
    assert torch.allclose(got, model_logprobs(hf, ids), atol=2e-2)
    # ...and it is the only difference: against the same checkpoint with fp16-rounded scales, 1.8e-5.
    model = models.load(str(smollm2_w4))[0]
    quantized, _ = reader.read_checkpoint(smollm2_w4)
    with torch.no_grad():
        for name, q in quantized.items():
            q.scale = q.scale.half().float()
            model.get_submodule(name).weight.copy_(q.dequantize())
    assert torch.allclose(got, model_logprobs(model, ids), atol=1e-4)
