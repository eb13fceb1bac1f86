"""The sampler against its definition."""

import math

import pytest
import torch

from slimlm import SlimlmError
from slimlm.runtime.sampling import SamplingParams, filter_logits, sample, top_logprobs


def test_sampling_draws_the_filtered_distribution():
    """The on-device exponential race draws each token with its top-k/top-p filtered probability."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -5.0]]).repeat(4000, 1)
    for params in (SamplingParams(temperature=0.7), SamplingParams(top_k=3), SamplingParams(top_p=0.8)):
        expected = filter_logits(logits[:1], [params]).softmax(-1)[0]
        gens = [torch.Generator().manual_seed(i) for i in range(len(logits))]
        counts = torch.bincount(torch.tensor(sample(logits, [params] * len(logits), gens).tokens), minlength=8)
        observed = counts / counts.sum()
        assert (observed[expected == 0] == 0).all()
        # 4000 draws: a binomial standard error of at most 0.008; allow 4 of them
        assert (observed - expected).abs().max() < 0.032, (observed, expected)


def reference_probs(row: list[float], params: SamplingParams) -> list[float]:
    """The definitions, one row in plain Python: divide by the temperature; top-k keeps every token whose
    logit is at least the k-th largest (ties kept); top-p then keeps, in order of decreasing probability
    (renormalized over what top-k kept), each token while the mass before it is still below top_p."""
    logits = [x / params.temperature for x in row]
    kept = set(range(len(row)))
    if 0 < params.top_k < len(row):
        kth = sorted(logits, reverse=True)[params.top_k - 1]
        kept = {i for i in kept if logits[i] >= kth}

    def softmax(indices):
        top = max(logits[i] for i in indices)
        e = {i: math.exp(logits[i] - top) for i in indices}
        total = sum(e.values())
        return {i: e[i] / total for i in indices}

    probs = softmax(kept)
    if params.top_p < 1:
        mass, nucleus = 0.0, set()
        for i in sorted(kept, key=lambda i: -probs[i]):
            if mass >= params.top_p:
                break
            nucleus.add(i)
            mass += probs[i]
        kept = nucleus
    final = softmax(kept)
    return [final.get(i, 0.0) for i in range(len(row))]


def transformers_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores.softmax(-1)


SETTINGS = [
    SamplingParams(temperature=0.6),
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.7),
    SamplingParams(temperature=1.3, top_k=10, top_p=0.85),
    SamplingParams(top_k=1),
    SamplingParams(top_p=0.05),
    SamplingParams(temperature=0.3, top_p=0.95),
    SamplingParams(top_k=200),  # top_k above the vocabulary
]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_filtering_equals_the_definition_and_transformers_on_random_logits(params):
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = filter_logits(logits, [params] * len(logits)).softmax(-1)
    expected = torch.tensor([reference_probs(row, params) for row in logits.tolist()])
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours, transformers_probs(logits, params), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "row, params, expected",
    [
        ([20.0, 0, 0, 0, 0], SamplingParams(top_p=0.9), [1, 0, 0, 0, 0]),  # one dominant token
        ([20.0, 0, 0, 0, 0], SamplingParams(top_k=3, top_p=0.5), [1, 0, 0, 0, 0]),
        ([3.0, 2, 2, 2, 1], SamplingParams(top_k=2), "ties"),  # the k-th logit is tied: all ties stay
        ([0.0, 0, 0, 0], SamplingParams(top_p=0.5), [0.5, 0.5, 0, 0]),  # top_p exactly reached after 2 of 4
        ([0.0, 0, 0, 0], SamplingParams(top_p=0.51), [1 / 3, 1 / 3, 1 / 3, 0]),
        ([1.0, 2, 3], SamplingParams(top_k=3, top_p=1.0), "full"),  # top_k equal to the vocabulary: no filter
    ],
)
def test_filtering_on_adversarial_distributions(row, params, expected):
    logits = torch.tensor([row])
    ours = filter_logits(logits, [params]).softmax(-1)[0]
    if expected == "ties":
        e = math.exp(-1)
        expected = [1 / (1 + 3 * e)] + [e / (1 + 3 * e)] * 3 + [0]
    elif expected == "full":
        expected = torch.tensor(row).softmax(-1).tolist()
    # which of several tied tokens top-p keeps is arbitrary: compare the distributions as sorted values
    torch.testing.assert_close(ours.sort().values, torch.tensor(expected, dtype=torch.float32).sort().values)
    torch.testing.assert_close(ours.sort().values, transformers_probs(logits, params)[0].sort().values)
    assert sorted(reference_probs(row, params)) == pytest.approx(sorted(ours.tolist()), abs=1e-6)


def test_each_row_keeps_its_own_settings():
    logits = torch.randn(len(SETTINGS), 50, generator=torch.Generator().manual_seed(1)) * 3
    ours = filter_logits(logits, SETTINGS).softmax(-1)
    for row, params, got in zip(logits, SETTINGS, ours, strict=True):
        torch.testing.assert_close(got, transformers_probs(row[None], params)[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_tokens", 0, "max_tokens must be a positive integer, got 0"),
        ("max_tokens", 2.0, "max_tokens must be a positive integer, got 2.0"),
        ("temperature", -0.1, "temperature must be a finite number >= 0, got -0.1"),
        ("temperature", float("inf"), "temperature must be a finite number >= 0, got inf"),
        ("temperature", float("nan"), "temperature must be a finite number >= 0, got nan"),
        ("temperature", "1", "temperature must be a finite number >= 0, got '1'"),
        ("top_p", 0, "top_p must be in (0, 1], got 0"),
        ("top_p", 1.01, "top_p must be in (0, 1], got 1.01"),
        ("top_p", None, "top_p must be in (0, 1], got None"),
        ("top_k", -2, "top_k must be -1, 0 (off) or a positive integer, got -2"),
        ("top_k", True, "top_k must be -1, 0 (off) or a positive integer, got True"),
        ("n", 0, "n must be a positive integer, got 0"),
        ("seed", -1, "seed must be an integer in [0, 2^63), got -1"),
        ("seed", 2**63, f"seed must be an integer in [0, 2^63), got {2**63}"),
        ("stop", [""], "stop must be a list of non-empty strings"),
        ("stop", [3], "stop must be a list of non-empty strings"),
        ("stop", ("a",), "stop must be a list of non-empty strings"),
        ("stop_token_ids", [-1], "stop_token_ids must be a list of token ids (integers >= 0)"),
        ("stop_token_ids", (1,), "stop_token_ids must be a list of token ids (integers >= 0)"),
        ("logprobs", -1, "logprobs must be None or an integer in 0..20, got -1"),
        ("logprobs", 21, "logprobs must be None or an integer in 0..20, got 21"),
        ("prompt_logprobs", 21, "prompt_logprobs must be None or an integer in 0..20, got 21"),
        ("prompt_logprobs_from", 0, "prompt_logprobs_from must be an integer >= 1, got 0"),
    ],
)
def test_each_bad_parameter_is_named_exactly(field, value, message):
    with pytest.raises(SlimlmError) as e:
        SamplingParams(**{field: value})
    assert str(e.value) == f"invalid sampling parameters: {message}"


def test_every_problem_is_reported_at_once_and_boundaries_are_accepted():
    with pytest.raises(SlimlmError) as e:
        SamplingParams(max_tokens=0, n=0)
    assert str(e.value) == (
        "invalid sampling parameters: max_tokens must be a positive integer, got 0; n must be a positive integer, got 0"
    )
    ok = SamplingParams(
        max_tokens=1,
        temperature=0,
        top_p=1,
        top_k=-1,
        n=1,
        seed=2**63 - 1,
        stop="x",
        stop_token_ids=[0],
        logprobs=20,
        prompt_logprobs=0,
        prompt_logprobs_from=1,
    )
    assert ok.stop == ["x"] and ok.greedy
    assert SamplingParams(top_k=0, seed=0, logprobs=0, prompt_logprobs=20, temperature=1e-5).greedy is False
    assert SamplingParams(temperature=0.99e-5).greedy


def test_sampled_outputs_report_the_unmodified_model():
    """Greedy rows take the argmax; every row's logprob is its token's log-softmax under the raw logits
    (not after temperature or filtering); top-N lists are the N most likely tokens, best first."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3)) * 2
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, top_k=5, logprobs=3),
        SamplingParams(top_p=0.5, logprobs=0),
        SamplingParams(temperature=0, logprobs=1),
    ]
    out = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(4)])
    raw = torch.log_softmax(logits.double(), -1)
    assert out.tokens[0] == logits[0].argmax() and out.tokens[3] == logits[3].argmax()
    assert out.tokens[1] in logits[1].topk(5).indices.tolist()
    assert out.logprobs == pytest.approx([raw[i, t].item() for i, t in enumerate(out.tokens)], abs=1e-5)
    assert out.top[0] is None and out.top[2] == []
    for row, n in ((1, 3), (3, 1)):
        values, ids = raw[row].topk(n)
        assert [t for t, _ in out.top[row]] == ids.tolist()
        assert [v for _, v in out.top[row]] == pytest.approx(values.tolist(), abs=1e-5)
    assert all(type(t) is int for t in out.tokens) and all(type(v) is float for v in out.logprobs)


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    """Each row uses only its own generator: what other rows are in the batch, and where, does not matter."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=1.0)
    alone = [sample(logits[i : i + 1], [params], [torch.Generator().manual_seed(10 + i)]).tokens[0] for i in range(3)]
    greedy = SamplingParams(temperature=0)
    batch = torch.cat([logits[:1], logits])  # a greedy row first, then the three seeded ones
    gens = [torch.Generator().manual_seed(99)] + [torch.Generator().manual_seed(10 + i) for i in range(3)]
    together = sample(batch, [greedy, params, params, params], gens).tokens
    assert together[0] == logits[0].argmax()
    assert together[1:] == alone


def test_top_logprobs_when_no_row_asks_for_a_list():
    logprobs = torch.log_softmax(torch.randn(3, 10), -1)
    assert top_logprobs(logprobs, [None, 0, None]) == [None, [], None]
    got = top_logprobs(logprobs, [2, None, 5])
    assert got[1] is None and len(got[0]) == 2 and len(got[2]) == 5
    assert [t for t, _ in got[2]] == logprobs[2].topk(5).indices.tolist()


def test_top_p_of_one_keeps_a_tail_that_rounds_away():
    """A dominant token makes the fp32 cumulative mass reach exactly 1.0 before the tail: a row with top_p = 1
    must still keep every token (filtering runs here because the other row asks for top-k)."""
    row = torch.tensor([[30.0] + [0.0] * 20])
    out = filter_logits(row.repeat(2, 1), [SamplingParams(top_p=1.0), SamplingParams(top_k=2)])
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1]).sum() == 21  # the 20 tied tokens stay with the 2nd (ties kept)


@pytest.mark.parametrize("top_p", [1e-46, 1e-300, 1e-7])
def test_the_most_likely_token_survives_any_top_p(top_p):
    """A top_p below fp32's smallest number reads as 0 there; the top token must stay whatever the value."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    out = filter_logits(logits, [SamplingParams(top_p=top_p, temperature=1.0, top_k=k) for k in (0, 1, 5)])
    assert torch.isfinite(out).sum(-1).tolist() == [1, 1, 1]
    assert out.argmax(-1).tolist() == logits.argmax(-1).tolist()


def test_top_logprobs_of_one():
    logprobs = torch.log_softmax(torch.randn(2, 10), -1)
    got = top_logprobs(logprobs, [1, None])
    assert got[1] is None and got[0] == [(logprobs[0].argmax().item(), pytest.approx(logprobs[0].max().item()))]
