"""Speculative decoding is exact: the accept/resample rule reproduces the target's distribution (chi-square,
and a mutant residual is caught), greedy output equals non-speculative output, and in the engine the
sampled tokens follow the target's distribution for both proposers."""

from __future__ import annotations

import pytest
import torch

from slimlm import SlimlmError
from slimlm.runtime import speculative
from slimlm.runtime.engine import EngineConfig
from slimlm.runtime.llm import LLM
from slimlm.runtime.sampling import SamplingParams
from slimlm.runtime.speculative import NgramProposer, Proposal, verify
from tests.conftest import make_text, make_tiny_llama


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; categories expected fewer than 5 times are pooled."""
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


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    ngram = NgramProposer(k=3, max_n=2)
    assert ngram._lookup([5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6], 3) == [9, 2, 5]  # "5 6" last seen before 9
    assert ngram._lookup([1, 2, 3, 4, 3], 3) == [4, 3]  # n = 1: "3" then 4 3, cut at the end
    assert ngram._lookup([1, 2, 3], 3) == []
    assert ngram._lookup([1, 2, 1], 0) == []


# ---- in the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharp_pair(tmp_path_factory):
    """Two tiny Llamas with the same tokenizer whose next-token distributions are far from uniform (their
    embeddings, tied to the head, scaled up), so a wrong rule would show in the counts."""
    from safetensors.torch import load_file, save_file

    paths = []
    for seed in (0, 1):
        path = make_tiny_llama(tmp_path_factory.mktemp("sharp") / f"m{seed}", seed=seed)
        tensors = load_file(path / "model.safetensors")
        tensors["model.embed_tokens.weight"] *= 4
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        paths.append(path)
    return paths


def _prompts(llm: LLM, n: int) -> list[list[int]]:
    return [llm.tokenizer.encode(" ".join(make_text(10, seed=s).split()[: 12 + 5 * s])) for s in range(n)]


@pytest.mark.parametrize("proposer", ["ngram", "draft", "self"])
def test_greedy_output_equals_non_speculative_greedy(sharp_pair, proposer):
    target, other = sharp_pair
    draft = {"ngram": "ngram", "draft": str(other), "self": str(target)}[proposer]
    base = LLM(str(target), max_num_batched_tokens=64)
    spec = LLM(str(target), speculative=draft, num_speculative_tokens=3, max_num_batched_tokens=64)
    prompts = _prompts(base, 20)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted = sum(o.outputs[0].num_drafted for o in outs)
    accepted = sum(o.outputs[0].num_accepted for o in outs)
    assert drafted > 0
    if proposer == "self":
        assert accepted == drafted  # the target drafting for itself is always right
    assert spec.engine.blocks.num_free == spec.engine.runner.num_blocks  # every block came back


def _exact_second_token(model_dir, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(second generated token) under the target alone: Σ_t1 q(t1) q(t2 | t1), from transformers."""
    from transformers import AutoModelForCausalLM

    from slimlm.runtime.speculative import distributions

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    with torch.no_grad():
        q1 = distributions(model(torch.tensor([prompt])).logits[0, -1:], [params])[0]
        batch = torch.cat([torch.tensor(prompt).expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        q2 = distributions(model(batch).logits[:, -1], [params] * vocab)
    return q1 @ q2


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_second_tokens_follow_the_target(sharp_pair, proposer, top_p):
    target, other = sharp_pair
    llm = LLM(str(target), speculative="ngram" if proposer == "ngram" else str(other), num_speculative_tokens=2,
              max_num_seqs=256, max_num_batched_tokens=2048)  # fmt: skip
    prompt = llm.tokenizer.encode(make_text(3, seed=11))  # long enough that prompt lookup matches most tokens
    draws = 10_000  # 20,000 on the real model: benchmarks/speculative.py
    # max_tokens 3: the first token comes from the prompt's last position, the second from a verification
    # with one draft (the rule leaves room for the token verification always adds)
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_p=top_p, seed=i, ignore_eos=True) for i in range(draws)]
    outs = llm.generate([prompt] * draws, params)
    second = torch.tensor([o.outputs[0].token_ids[1] for o in outs])
    assert sum(o.outputs[0].num_drafted for o in outs) > draws // 2  # most second tokens went through verify
    exact = _exact_second_token(target, prompt, params[0])
    assert chi_square_p(torch.bincount(second, minlength=len(exact)).float(), exact) > 0.001


def test_bad_speculative_settings_are_named(tiny_llama, tmp_path):
    with pytest.raises(SlimlmError, match=r"num_speculative_tokens must be an integer in 1..block_size \(16\)"):
        EngineConfig(speculative="ngram", num_speculative_tokens=17)
    with pytest.raises(SlimlmError, match="num_speculative_tokens must be an integer"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
    other = make_tiny_llama(tmp_path / "other-vocab", seed=0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    with pytest.raises(SlimlmError, match="does not share the target .* tokenizer"):
        LLM(str(tiny_llama), speculative=str(other))
