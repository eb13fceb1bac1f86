"""The lm-eval backend against lm-eval's own `hf` backend on the same model: the same scores request for
request (tiny random model), and the same per-document outcomes on the task pack (the real default model)."""

import math

import lm_eval
import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from slimlm import SlimlmError
from slimlm.eval import batch, harness, taskpack
from slimlm.eval.lm_eval_model import SlimlmLM
from slimlm.runtime.sequence import common_prefix


def instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def backends(tiny_llama):
    hf = HFLM(pretrained=str(tiny_llama), device="cpu", batch_size=3, dtype="float32")
    ours = SlimlmLM(pretrained=str(tiny_llama), progress=False, max_num_batched_tokens=64, block_size=16)
    return hf, ours


def test_loglikelihood_equals_the_hf_backend(backends):
    hf, ours = backends
    context = "the quick brown fox jumps over the lazy dog and then " * 3  # 2+ blocks, shared below
    args = [
        (context, "runs away"),
        (context, "sleeps"),
        (context, " eats a very small apple"),
        (context, " eats a very small pear"),  # its first scored tokens are the apple's: scored once
        (context, " eats a very"),  # all of its tokens but the last are the apple's
        (context, "runs away"),  # the very same request again
        ("", "alone"),
        ("a question ", "with a trailing space"),
        ("short", " one"),
    ]
    before = ours.tokens_computed
    mine = ours.loglikelihood(instances("loglikelihood", args))
    theirs = hf.loglikelihood(instances("loglikelihood", args))
    for (lp, greedy), (lp_hf, greedy_hf) in zip(mine, theirs, strict=True):
        assert lp == pytest.approx(lp_hf, abs=1e-4) and greedy == greedy_hf
    tokens = [len(ours.tok_encode(c + x)) for c, x in args]
    context_tokens = len(ours.tok_encode(context))
    # the context once, the continuations' own tokens, and one token more for each request that shares
    assert ours.tokens_computed - before < sum(tokens) - 5 * (context_tokens - 1)


def test_rolling_loglikelihood_equals_the_hf_backend(backends):
    hf, ours = backends
    texts = [("some words to score " * 12,), ("one line",)]
    mine = ours.loglikelihood_rolling(instances("loglikelihood_rolling", texts))
    theirs = hf.loglikelihood_rolling(instances("loglikelihood_rolling", texts))
    assert mine == pytest.approx(theirs, abs=1e-3)


def test_generate_until_equals_the_hf_backend(backends):
    hf, ours = backends
    args = [
        ("the quick brown", {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}),
        ("over the lazy dog", {"until": ["the"], "max_gen_toks": 20}),
        ("and then", {"max_gen_toks": 5}),
    ]
    mine = ours.generate_until(instances("generate_until", args))
    theirs = hf.generate_until(instances("generate_until", args))
    assert mine == theirs and any(mine)


def test_unknown_model_args_are_named(tiny_llama):
    with pytest.raises(SlimlmError, match="unknown slimlm model_args temperatur"):
        SlimlmLM(pretrained=str(tiny_llama), temperatur=0.5)


@pytest.mark.slow
def test_task_pack_outcomes_equal_the_hf_backend_on_the_default_model(smollm2):
    """Every document of a fixed subset of each task: same winner, near-identical log-likelihoods."""
    manager = harness.task_manager([taskpack.GROUP])
    runs = {}
    for name, lm in [
        ("slimlm", SlimlmLM(pretrained=str(smollm2), progress=False)),
        ("hf", HFLM(pretrained=str(smollm2), device="cpu", batch_size=16, dtype="float32")),
    ]:
        runs[name] = lm_eval.simple_evaluate(
            model=lm, tasks=[taskpack.GROUP], limit=6, task_manager=manager, log_samples=True, verbosity="ERROR"
        )
    for task, samples in runs["slimlm"]["samples"].items():
        theirs = runs["hf"]["samples"][task]
        assert [s["acc"] for s in samples] == [s["acc"] for s in theirs], task
        for mine, hf in zip(samples, theirs, strict=True):
            for x, y in zip(mine["resps"], hf["resps"], strict=True):
                assert math.isclose(x[0][0], y[0][0], abs_tol=2e-3), task
        for metric, value in runs["hf"]["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                assert runs["slimlm"]["results"][task][metric] == pytest.approx(value, abs=0.005)


def test_tokens_two_continuations_share_are_scored_once(backends, monkeypatch):
    """What the engine is asked to score: a continuation that begins as an earlier one does only from where
    they part (the scores before come from the earlier one), a repeated request only its last token."""
    _, ours = backends
    seen = []
    run = batch.run
    monkeypatch.setattr(
        batch, "run", lambda engine, prompts, params, *a: seen.append(params) or run(engine, prompts, params, *a)
    )
    context = "the quick brown fox jumps over the lazy dog and then " * 3
    args = [
        (context, " eats a very small apple"),
        (context, " eats a very small pear"),
        (context, " eats a very small apple"),
    ]
    ours.loglikelihood(instances("loglikelihood", args))
    prompts = [ours.tok_encode(c + x) for c, x in args]
    start, parted = len(ours.tok_encode(context)), common_prefix(prompts[0], prompts[1])
    assert parted > start + 2
    assert [p.prompt_logprobs_from for p in seen[0]] == [start, parted, len(prompts[2]) - 1]
