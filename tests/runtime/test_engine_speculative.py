"""Speculative decoding in the engine: greedy output equals non-speculative output for every proposer, and
sampled tokens follow the target's exact distribution (computed with transformers) for both proposers."""

from __future__ import annotations

import pytest
import torch

from slimlm import SlimlmError
from slimlm.runtime.engine import EngineConfig
from slimlm.runtime.kv_policy import KVPolicy
from slimlm.runtime.llm import LLM
from slimlm.runtime.sampling import SamplingParams
from tests.conftest import make_text, make_tiny_llama
from tests.runtime.test_speculative import chi_square_p


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
    # beside sampled requests in the same steps (the draft keeps distributions for those only)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    mixed = spec.generate(prompts, [params if i % 2 else sampled for i in range(len(prompts))])
    assert [o.outputs[0].token_ids for o in mixed[1::2]] == want[1::2]
    drafted = sum(o.outputs[0].num_drafted for o in outs)
    accepted = sum(o.outputs[0].num_accepted for o in outs)
    assert drafted > 0
    if proposer == "self":
        assert accepted == drafted  # the target drafting for itself is always right
    assert spec.engine.blocks.num_free == spec.engine.runner.num_blocks  # every block came back


def test_a_draft_that_takes_cached_blocks_to_the_token_copies_them_first(sharp_pair, monkeypatch):
    """The same prompts again: the draft's shadows take their blocks from its prefix cache, the last, partial
    ones too, copied before they are written. The target drafting for itself stays always right."""
    target = str(sharp_pair[0])
    spec = LLM(target, speculative=target, num_speculative_tokens=3, max_num_batched_tokens=64)
    prompts = _prompts(spec, 6)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = spec.generate(prompts, params)
    runner, copies = spec.engine.proposer.runner, []
    run = runner.run
    monkeypatch.setattr(runner, "run", lambda batch, *a: copies.extend(batch.copies) or run(batch, *a))
    again = spec.generate(prompts, params)
    assert copies and spec.engine.proposer.blocks.pending_copies == []  # every copy went to the draft's runner
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    drafted = sum(o.outputs[0].num_drafted for o in again)
    assert drafted > 0 and sum(o.outputs[0].num_accepted for o in again) == drafted


@pytest.mark.parametrize("policy", [KVPolicy("window", 40), KVPolicy("snapkv", 64)])
@pytest.mark.parametrize("proposer", ["ngram", "self"])
def test_greedy_output_equals_non_speculative_greedy_under_a_kv_policy(sharp_pair, proposer, policy):
    """Drafts never cross a point where the window would have evicted, and roll-backs touch only the newest
    tokens: the output is plain decoding's under the same policy, token for token."""
    target, _ = sharp_pair
    base = LLM(str(target), max_num_batched_tokens=64, block_size=8)
    spec = LLM(
        str(target),
        speculative=proposer if proposer == "ngram" else str(target),
        block_size=8,
        num_speculative_tokens=4,
        max_num_batched_tokens=64,
    )
    prompts = [p for p in _prompts(base, 20) if len(p) > 70][:6]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0, kv_policy=policy)
    want = base.generate(prompts, params)
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    # the log-probabilities too: a step that read a resident set plain decoding never had would show here
    lps = [torch.tensor(o.outputs[0].logprobs) for o in (*outs, *want)]
    torch.testing.assert_close(torch.cat(lps[: len(outs)]), torch.cat(lps[len(outs) :]), atol=1e-5, rtol=0)
    assert sum(o.outputs[0].num_drafted for o in outs) > 0
    assert spec.engine.blocks.num_free == spec.engine.runner.num_blocks


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
    llm = LLM(
        str(target),
        speculative="ngram" if proposer == "ngram" else str(other),
        num_speculative_tokens=2,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
    )
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


def test_greedy_speculation_is_exact_under_preemption_and_parallel_samples(sharp_pair, monkeypatch):
    target, other = sharp_pair
    small = dict(kv_cache_memory=512 * 16 * 12, max_model_len=128, max_num_batched_tokens=64)  # 12 blocks
    base = LLM(str(target), **small)
    spec = LLM(str(target), speculative=str(other), num_speculative_tokens=3, **small)
    preemptions = []
    preempt = spec.engine.scheduler._preempt
    monkeypatch.setattr(spec.engine.scheduler, "_preempt", lambda seq: (preemptions.append(seq), preempt(seq)))
    prompts = _prompts(base, 8)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, n=2)
    want = [[c.token_ids for c in o.outputs] for o in base.generate(prompts, params)]
    outs = spec.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == want
    assert preemptions and sum(c.num_accepted for o in outs for c in o.outputs) > 0
    assert spec.engine.blocks.num_free == spec.engine.runner.num_blocks
    draft = spec.engine.proposer  # its pool: every block is free or held by a shadow still alive
    held = {b for shadow in draft.shadows.values() for b in shadow.block_table}
    assert draft.blocks.num_free + len(held) == draft.runner.num_blocks


def test_drafts_respect_the_token_budget_max_tokens_and_the_context(sharp_pair, monkeypatch):
    """Self-drafting (every draft accepted) under a tight step budget, short max_tokens and a context the
    prompts nearly fill: each step stays within the budget, no output passes max_tokens or the context, and
    the tokens equal plain greedy decoding."""
    target = str(sharp_pair[0])
    spec = LLM(target, speculative=target, num_speculative_tokens=4, max_num_batched_tokens=8, max_model_len=40)
    base = LLM(target, max_model_len=40)
    step_tokens = []
    run = spec.engine.runner.run
    monkeypatch.setattr(
        spec.engine.runner,
        "run",
        lambda batch, *args: step_tokens.append(sum(item.num_tokens for item in batch.items)) or run(batch, *args),
    )
    asked = spy_on_proposals(spec, monkeypatch)
    prompts = [p[:30] for p in _prompts(base, 4)]
    for max_tokens in (1, 5, 20):  # 20: the 40-token context ends generation first
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
        outs = spec.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == want
        for o, p in zip(outs, prompts, strict=True):
            c = o.outputs[0]
            assert len(c.token_ids) == min(max_tokens, 40 - len(p))
            assert c.num_accepted == c.num_drafted <= len(c.token_ids) - 1  # the first token is never drafted
    assert max(step_tokens) <= 8 and spec.engine.blocks.num_free == spec.engine.runner.num_blocks
    # as many drafts as can be emitted, no more: verification adds one token of its own after the drafts
    assert asked and all(k == max(0, min(4, most - out - 1, 40 - tokens - 1)) for tokens, _, out, most, k in asked)
    assert all(out >= 1 and computed == tokens - 1 for tokens, computed, out, _, _ in asked)  # decoding ones only
    assert sum(o.outputs[0].num_drafted for o in outs) > 0
    asked.clear()
    prompt = (prompts[0] * 2)[:17]  # prefilled in chunks of 8, 8 and 1: the last chunk is not a decode
    spec.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert asked and all(out >= 1 for _, _, out, _, _ in asked)
    tight = LLM(target, speculative=target, num_speculative_tokens=4, max_num_batched_tokens=2, max_model_len=40)
    out = tight.generate([prompts[0][:5]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].num_drafted > 0  # one token of budget left beside the decode: one draft
    # sampling: the sequence's own generator decides, so a seed reproduces whatever the global RNG did
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    torch.manual_seed(0)
    first = spec.generate(prompts[:2], params)
    torch.manual_seed(1)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts[:2], params)] == [
        o.outputs[0].token_ids for o in first
    ]
    # the target drafting for itself, sampled: min(1, q/p) = 1, so every draft is accepted (a rule that took
    # the drafts as certain would still be exact, but accept each with probability q only)
    assert all(o.outputs[0].num_accepted == o.outputs[0].num_drafted > 0 for o in first)


def spy_on_proposals(llm: LLM, monkeypatch) -> list[tuple[int, int, int, int, int]]:
    """(tokens, computed tokens, outputs, max_tokens, tokens drafted) of every proposal, as it is asked."""
    asked = []
    propose = llm.engine.proposer.propose
    monkeypatch.setattr(
        llm.engine.proposer,
        "propose",
        lambda seqs, room: [
            asked.append((s.num_tokens, s.num_computed, len(s.output_ids), s.params.max_tokens, len(p.tokens))) or p
            for s, p in zip(seqs, propose(seqs, room), strict=True)
        ],
    )
    return asked


@pytest.mark.parametrize("draft", ["target", "other"])  # every draft accepted; some rejected
def test_after_each_speculative_step_the_cache_holds_every_token_but_the_last(sharp_pair, draft, monkeypatch):
    """and just the blocks those need; the tokens' log-probabilities are the target's (plain decoding's)."""
    target = str(sharp_pair[0])
    base = LLM(target)
    spec = LLM(target, speculative=str(sharp_pair[draft == "other"]), num_speculative_tokens=3)
    engine, block_size = spec.engine, spec.engine.config.block_size
    step = engine.step

    def checked_step(*args, **kwargs):
        outputs = step(*args, **kwargs)
        for seq in engine.scheduler.running:
            if seq.output_ids:
                assert seq.num_computed == seq.num_tokens - 1
                assert len(seq.block_table) == -(-seq.num_computed // block_size)
        return outputs

    monkeypatch.setattr(engine, "step", checked_step)
    prompts = _prompts(base, 4)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    want, got = base.generate(prompts, params), spec.generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        a, b = w.outputs[0], g.outputs[0]
        assert a.token_ids == b.token_ids and torch.allclose(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4
        )
        assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]
        assert all(isinstance(t, float) for t in b.token_times) and b.token_times == sorted(b.token_times)
    assert sum(o.outputs[0].num_drafted for o in got) > 0
