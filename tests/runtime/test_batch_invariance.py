"""In fp32 a request's tokens and log-probabilities do not depend on how its prompt was computed: with or
without prefix-cache hits, in chunks of any size, alone or among other requests of any length, on the AVX-512
kernels and on the AVX2 ones (their int8 loop as well as exact activations)."""

import random

import pytest
import torch

from slimlm.compress.job import Quantization, quantize_weights
from slimlm.compress.rtn import RTN
from slimlm.formats.quantized import QuantArgs
from slimlm.kernels import cpu_library
from slimlm.runtime.llm import LLM
from slimlm.runtime.sampling import SamplingParams
from tests.kernels.problems import haswell_library

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the CPU kernels cannot be built here")

ROUNDS = 14  # engines per case, each serving every request once: 14 × 24 = 336 comparisons a case, 1,008 per ISA
REQUESTS = 24


@pytest.fixture(scope="module")
def w4(tiny_llama, tmp_path_factory):
    args = QuantArgs(4, 32, True)
    out = tmp_path_factory.mktemp("w4") / "w4"
    return quantize_weights(Quantization("rtn", [RTN(args)], args, str(tiny_llama), out), progress=False)


def workload(seed: int, vocab: int) -> list[list[int]]:
    """Prompts that share prefixes of 0-300 tokens (so that later ones hit the cache; past 256 tokens the decode
    kernel splits a sequence in two parts) and end in tails of their own."""
    g = random.Random(seed)
    prefixes = [[g.randrange(3, vocab) for _ in range(n)] for n in (0, 17, 64, 150, 300)]
    return [g.choice(prefixes) + [g.randrange(3, vocab) for _ in range(g.randrange(1, 40))] for _ in range(REQUESTS)]


def results(llm: LLM, prompts: list[list[int]], order: list[int], groups: list[int]) -> dict:
    """Each prompt's greedy tokens and their log-probabilities, submitted in `order`, `groups` at a time."""
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=0, ignore_eos=True)
    out, at = {}, 0
    for size in groups:
        batch = order[at : at + size]
        for i, o in zip(batch, llm.generate([prompts[i] for i in batch], params), strict=True):
            assert o.error is None, o.error
            out[i] = (o.outputs[0].token_ids, o.outputs[0].logprobs)
        at += size
    return out


@pytest.mark.parametrize("isa", ["native", "haswell"])
@pytest.mark.parametrize("weights", ["float", "w4", "w4-exact"])
def test_fp32_results_do_not_depend_on_how_prompts_were_computed(tiny_llama, w4, monkeypatch, isa, weights):
    if isa == "haswell":
        haswell_library(monkeypatch)
    model = str(tiny_llama if weights == "float" else w4)
    activations = "exact" if weights == "w4-exact" else "auto"
    prompts = workload(0, LLM(model).engine.vocab_size)
    alone = LLM(model, dtype="float32", activations=activations, prefix_caching=False)
    expected = {i: results(alone, prompts, [i], [1])[i] for i in range(len(prompts))}
    g = random.Random(1)
    compared = 0
    for _ in range(ROUNDS):
        llm = LLM(
            model,
            dtype="float32",
            activations=activations,
            prefix_caching=g.random() < 0.75,
            max_num_batched_tokens=g.choice([16, 32, 48, 100, 512]),  # chunked prefill at these sizes
            max_num_seqs=g.choice([2, 5, 64]),
        )
        order = g.sample(range(len(prompts)), len(prompts))
        groups = []
        while sum(groups) < len(prompts):
            groups.append(min(g.randrange(1, 9), len(prompts) - sum(groups)))
        got = results(llm, prompts, order, groups)
        for i, want in expected.items():
            assert got[i] == want, f"prompt {i} ({len(prompts[i])} tokens)"
            compared += 1
    assert compared == ROUNDS * REQUESTS


def test_a_long_prompt_attends_in_parts_of_its_own_length_alone(tiny_llama):
    """The decode kernel splits a sequence into parts by its length, never by the batch: a 300-token sequence's
    next token has the same log-probability decoded alone and beside 40 short ones."""
    g = torch.Generator().manual_seed(0)
    vocab = LLM(str(tiny_llama)).engine.vocab_size
    long = torch.randint(3, vocab, (300,), generator=g).tolist()
    short = [torch.randint(3, vocab, (5,), generator=g).tolist() for _ in range(40)]
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=0, ignore_eos=True)
    alone = LLM(str(tiny_llama), dtype="float32").generate([long], params)[0].outputs[0]
    among = LLM(str(tiny_llama), dtype="float32").generate([long, *short], params)[0].outputs[0]
    assert (among.token_ids, among.logprobs) == (alone.token_ids, alone.logprobs)
