"""The speculative rule is exact: accepting and resampling reproduces the target's distribution (chi-square,
and a mutant residual is caught); prompt lookup proposes what followed the latest match. The engine side
is in test_engine_speculative.py."""

from __future__ import annotations

import pytest
import torch

from slimlm.runtime import speculative
from slimlm.runtime.sampling import SamplingParams
from slimlm.runtime.speculative import NgramProposer, Proposal, verify, verify_greedy


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; categories expected fewer than 5 times are pooled. A draw of a
    probability-0 category is a certain misfit (0.0); a single possible category fits if it got every draw."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    counts, probs = counts[probs > 0], probs[probs > 0]
    if len(probs) == 1:
        return 1.0
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _emitted_first(q: torch.Tensor, p: torch.Tensor, draws: int, seed: int = 0) -> torch.Tensor:
    """Counts of the first emitted token when x ~ p is drafted against target q."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(q.shape[-1])
    for _ in range(draws):
        x = int(torch.multinomial(p, 1, generator=g))
        tokens, _ = verify(torch.stack([q, q]), Proposal([x], p[None]), g)
        counts[tokens[0]] += 1
    return counts


def test_the_two_token_example_gives_the_target_distribution():
    p, q = torch.tensor([0.8, 0.2]), torch.tensor([0.5, 0.5])
    counts = _emitted_first(q, p, 20_000)
    assert chi_square_p(counts, q) > 0.001
    assert abs(counts[0] / 20_000 - 0.5) < 0.015


def test_a_residual_replaced_by_q_is_caught(monkeypatch):
    p, q = torch.tensor([0.8, 0.2]), torch.tensor([0.5, 0.5])
    monkeypatch.setattr(speculative, "residual", lambda q, p: q)
    counts = _emitted_first(q, p, 20_000)
    assert chi_square_p(counts, q) < 0.001  # accepting 0 w.p. 0.625, else q: P(0) = 0.8·0.625 + 0.5·0.5 = 0.6


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-model", "prompt-lookup"])
def test_every_emitted_position_follows_the_target(point_mass):
    """k = 3 drafts over 6 tokens: the first and second emitted tokens (where they exist) follow q."""
    g = torch.Generator().manual_seed(1)
    q = torch.softmax(torch.randn(4, 6, generator=g) * 1.5, -1)
    p = torch.softmax(torch.randn(3, 6, generator=g) * 1.5, -1)
    counts = torch.zeros(2, 6)
    seen_second = 0
    for _ in range(20_000):
        if point_mass:  # drafts from a lookup: fixed tokens, p(x) = 1; q at position 2 no longer depends on x
            drafts, proposal_p = [2, 4, 1], None
        else:
            drafts = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(3)]
            proposal_p = p
        tokens, _ = verify(q, Proposal(drafts, proposal_p), g)
        counts[0, tokens[0]] += 1
        if len(tokens) > 1:  # reached only when x_1 was accepted: then it follows q_2 (independent of x_1 here)
            counts[1, tokens[1]] += 1
            seen_second += 1
    assert chi_square_p(counts[0], q[0]) > 0.001
    assert chi_square_p(counts[1], q[1]) > 0.001
    assert seen_second > 2000


def test_greedy_drafts_are_accepted_iff_they_are_the_argmax():
    q = torch.zeros(4, 5)
    q[0, 3] = q[1, 1] = q[2, 4] = q[3, 0] = 1.0
    g = torch.Generator().manual_seed(0)
    assert verify(q, Proposal([3, 1, 4], None), g) == ([3, 1, 4, 0], 3)
    assert verify(q, Proposal([3, 2, 4], None), g) == ([3, 1], 1)
    assert verify(q, Proposal([0, 1, 4], None), g) == ([3], 0)
    logits = torch.randn(4, 5) + 8 * q  # greedy requests skip the distributions: the same rule on the argmax
    for drafts in ([3, 1, 4], [3, 2, 4], [0, 1, 4], [3, 1, 0]):
        assert verify_greedy(logits, drafts) == verify(q, Proposal(drafts, None), g)
    assert verify_greedy(logits[:1], []) == ([3], 0)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    ngram = NgramProposer(k=3, max_n=2)
    assert ngram._lookup([5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6], 3) == [9, 2, 5]  # "5 6" last seen before 9
    assert ngram._lookup([1, 2, 3, 4, 3], 3) == [4, 3]  # n = 1: "3" then 4 3, cut at the end
    assert ngram._lookup([1, 2, 3], 3) == []
    assert ngram._lookup([1, 2, 1], 0) == []


def test_prompt_lookup_proposals_respect_each_budget():
    from slimlm.runtime.sequence import Sequence

    def seq(tokens):
        return Sequence(0, "r", tokens, 2, SamplingParams(), torch.Generator())

    ngram = NgramProposer(k=4)
    out = ngram.propose([seq([1, 2, 3, 4, 5, 6, 1]), seq([1, 2, 3, 4, 5, 6, 1]), seq([7, 8])], [2, 9, 5])
    assert [p.tokens for p in out] == [[2, 3], [2, 3, 4, 5], []]
    assert all(p.probs is None for p in out)


def test_distributions_are_what_sampling_draws_from():
    from slimlm.runtime.sampling import filter_logits

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g) * 3
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0),
    ]
    probs = speculative.distributions(logits, params)
    for i in (0, 3):
        assert probs[i].sum() == 1 and probs[i, logits[i].argmax()] == 1
    for i in (1, 2):
        torch.testing.assert_close(probs[i], filter_logits(logits[i : i + 1], [params[i]]).softmax(-1)[0])
    assert (probs[2] > 0).sum() == 5


def test_prompt_lookup_edges():
    ngram = NgramProposer(k=4)  # the default max_n is 3: the latest 3-gram match wins over an older 4-gram one
    assert ngram._lookup([1, 2, 3, 4, 8, 9, 2, 3, 4, 6, 1, 2, 3, 4], 1) == [6]
    assert ngram._lookup([3, 3], 2) == [3]  # the match right before the tail counts
    assert ngram._lookup([1, 2, 3, 1], 2) == [2, 3]  # and so does one at the very start


def test_verify_draws_only_from_its_generator_and_accepts_every_draft_of_a_perfect_draft():
    g = torch.Generator().manual_seed(5)
    q = torch.softmax(torch.randn(4, 7, generator=g), -1)
    p = q[:3].clone()
    drafts = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(3)]

    def run(global_seed: int, proposal: Proposal):
        torch.manual_seed(global_seed)  # the global RNG must not matter: not to accept, not to resample
        gen = torch.Generator().manual_seed(11)
        return [verify(q, proposal, gen) for _ in range(50)]

    first = run(0, Proposal(drafts, p))
    assert first == run(1, Proposal(drafts, p))
    assert all(accepted == 3 for _, accepted in first)  # p = q: min(1, q/p) = 1 for every draft
    assert len({tuple(tokens) for tokens, _ in first}) > 1  # the bonus token is drawn, not fixed
    rejections = run(0, Proposal(drafts, None))
    assert rejections == run(1, Proposal(drafts, None))
    assert len({accepted for _, accepted in rejections}) > 1  # a point mass does reject, from its own draws
    assert len({tokens[accepted] for tokens, accepted in rejections if accepted < 3}) > 1  # resampled, not fixed


def test_the_residual_is_max_0_q_minus_p_and_q_where_that_is_empty():
    q, p = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(speculative.residual(q, p), torch.tensor([0.3, 0.0, 0.0]))
    assert torch.equal(speculative.residual(q, q.clone()), q)  # nothing to reject: never an all-zero row


def test_prompt_lookup_honours_min_n_and_one_budget_per_sequence():
    assert NgramProposer(k=2, max_n=3, min_n=2)._lookup([4, 1, 2, 9, 2], 2) == []  # only a 1-gram repeats
    assert NgramProposer(k=2, max_n=3, min_n=1)._lookup([4, 1, 2, 9, 2], 2) == [9, 2]
    with pytest.raises(ValueError):
        NgramProposer(k=2).propose([], [1])


def test_the_chi_square_helper_fails_a_draw_the_target_cannot_make():
    q = torch.tensor([0.5, 0.5, 0.0])
    assert chi_square_p(torch.tensor([500.0, 500.0, 1.0]), q) == 0.0
    assert chi_square_p(torch.tensor([500.0, 500.0, 0.0]), q) > 0.5
    assert chi_square_p(torch.tensor([0.0, 9.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])) == 1.0
