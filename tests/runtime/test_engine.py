"""The engine on a tiny random Llama: parity with transformers, batching, prefix sharing, bad input."""

import json
import re
import shutil
import time

import pytest
import torch

from slimlm import SlimlmError
from slimlm.runtime.engine import Engine, EngineConfig
from slimlm.runtime.llm import LLM
from slimlm.runtime.sampling import SamplingParams
from tests.conftest import make_text
from tests.runtime.conftest import model_logprobs

GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(
        tiny_llama
    )


@pytest.fixture(scope="module")
def prompts(hf) -> list[list[int]]:
    _, tok = hf
    words = make_text(40, seed=3).split()
    lengths = [3, 7, 16, 17, 31, 45, 60, 90]
    return [tok.encode(" ".join(words[i * 5 : i * 5 + n])) for i, n in enumerate(lengths)]


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    model, _ = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    return model_logprobs(hf[0], ids)


def test_greedy_equals_transformers_one_by_one_and_in_one_batch(tiny_llama, hf, prompts):
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(str(tiny_llama))
    assert [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts] == expected
    # all at once, prompts cut into 16-token chunks, and a pool so small that sequences get preempted
    small = LLM(
        str(tiny_llama), max_num_batched_tokens=16, kv_cache_memory=12 * 16 * 2 * 2 * 2 * 16 * 4, max_model_len=192
    )
    outs = small.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert small.engine.blocks.num_free == small.engine.runner.num_blocks


def test_preemption_really_happens_with_a_tiny_pool(tiny_llama, prompts):
    llm = LLM(
        str(tiny_llama), max_num_batched_tokens=16, kv_cache_memory=12 * 16 * 2 * 2 * 2 * 16 * 4, max_model_len=192
    )
    engine = llm.engine
    for p in prompts:  # prompt log-probabilities too: a preempted prompt is recomputed, not scored again
        engine.add_request(p, SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=0))
    preempted, outputs = 0, []
    while engine.has_unfinished():
        seqs = [s for r in engine.requests.values() for s in r.seqs]
        outputs += engine.step()
        preempted = max(preempted, sum(s.num_preemptions for s in seqs))
    assert preempted > 0
    assert engine.blocks.num_free == engine.runner.num_blocks
    finished = [o for o in outputs if o.finished]
    assert len(finished) == len(prompts)
    assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) - 1 for o in finished)


def test_prompt_logprobs_equal_transformers(tiny_llama, hf, prompts):
    llm = LLM(str(tiny_llama), max_num_batched_tokens=16)
    out = llm.generate([prompts[6]], SamplingParams(max_tokens=1, prompt_logprobs=0, logprobs=0))[0]
    expected = hf_logprobs(hf, prompts[6])
    assert torch.allclose(torch.tensor(out.prompt_logprobs), expected, atol=1e-5)
    full = prompts[6] + out.outputs[0].token_ids
    assert out.outputs[0].logprobs[0] == pytest.approx(float(hf_logprobs(hf, full)[-1]), abs=1e-5)


def test_a_lone_prompt_longer_than_the_token_budget_is_computed_whole(tiny_llama, hf, prompts):
    """A step holding only a middle prefill chunk needs no logits, but its K/V must still be written."""
    llm = LLM(str(tiny_llama), max_num_batched_tokens=16)
    out = llm.generate([prompts[7]], SamplingParams(max_tokens=2, temperature=0, logprobs=0))[0].outputs[0]
    expected = hf_logprobs(hf, prompts[7] + out.token_ids)[-2:]
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-5)


def test_scoring_continuations_reuses_the_context_and_matches_transformers(tiny_llama, hf, prompts):
    """lm-eval's pattern: one context, several continuations, only the continuations scored. The context's
    blocks come from the prefix cache, its partial last one too (copied before each continuation is written
    into it); the scores equal transformers' on the whole sequence."""
    context = prompts[7][:70]  # 4 full blocks of 16 and a partial one
    conts = [prompts[6][:5], prompts[5][:9], prompts[4][:3]]
    llm = LLM(str(tiny_llama), max_num_batched_tokens=32)
    for i, cont in enumerate(conts):
        params = SamplingParams(max_tokens=1, prompt_logprobs=1, prompt_logprobs_from=len(context))
        out = llm.generate([context + cont], params)[0]
        expected = hf_logprobs(hf, context + cont)[len(context) - 1 :]
        assert torch.allclose(torch.tensor(out.prompt_logprobs), expected, atol=1e-5)
        assert len(out.prompt_top_logprobs) == len(cont)
        assert out.num_cached_tokens == (0 if i == 0 else 69)  # the context less its last token (it scores)
    # scoring the whole prompt again must compute it all, although its blocks are cached
    again = llm.generate([context + conts[0]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert again.num_cached_tokens == 0
    assert torch.allclose(torch.tensor(again.prompt_logprobs), hf_logprobs(hf, context + conts[0]), atol=1e-5)
    with pytest.raises(SlimlmError, match="prompt_logprobs_from"):
        llm.engine.add_request(context, SamplingParams(prompt_logprobs=0, prompt_logprobs_from=len(context)))


def test_an_equal_block_after_different_prefixes_is_not_shared(tiny_llama):
    """Blocks are cached by their whole prefix, not their own tokens: the same 16 tokens after two different
    first blocks hold different K/V (attention saw different pasts), so the second prompt reuses nothing and
    each prompt's logits are those of a fresh engine."""
    same = list(range(100, 116))  # one full block, identical in both prompts
    a, b = list(range(20, 36)) + same + [7, 8, 9], list(range(40, 56)) + same + [7, 8, 9]
    # the tail's log-probabilities (scoring from 33 leaves the first two blocks free to be reused) and greedy text
    params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0, prompt_logprobs_from=33)
    fresh = [LLM(str(tiny_llama), prefix_caching=False).generate([p], params)[0] for p in (a, b)]
    llm = LLM(str(tiny_llama))
    first = llm.generate([a], params)[0]
    second = llm.generate([b], params)[0]
    assert second.num_cached_tokens == 0
    for got, want in zip((first, second), fresh, strict=True):
        assert torch.allclose(torch.tensor(got.prompt_logprobs), torch.tensor(want.prompt_logprobs), atol=1e-6)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    again = llm.generate([b], params)[0]  # b's own blocks are cached now, under b's prefix
    assert again.num_cached_tokens == 32 and again.prompt_logprobs == pytest.approx(second.prompt_logprobs, abs=1e-6)


def test_shared_prefix_blocks_are_reused_and_change_nothing(tiny_llama, hf):
    _, tok = hf
    words = make_text(60, seed=5).split()
    prefix = tok.encode(" ".join(words[:400]))[:200]
    a, b = prefix + tok.encode(" river music"), prefix + tok.encode(" school team war")
    alone = LLM(str(tiny_llama), prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in alone.generate([a, b], GREEDY)]

    llm = LLM(str(tiny_llama))
    engine = llm.engine
    engine.add_request(a, GREEDY, "a")
    engine.step()  # a's whole prompt (one chunk of up to 512 tokens): its 12 full blocks are now cached
    seq_a = engine.requests["a"].seqs[0]
    free_before = engine.blocks.num_free
    engine.add_request(b, GREEDY, "b")
    seq_b = engine.requests["b"].seqs[0]
    engine.step()  # a decodes one token (no new block: 203 tokens fit its 13 blocks), b prefills
    assert seq_b.block_table[:12] == seq_a.block_table[:12]
    assert all(engine.blocks.blocks[i].ref_count == 2 for i in seq_a.block_table[:12])
    assert free_before - engine.blocks.num_free == len(seq_b.block_table) - 12 == 1  # only b's own tail block
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outputs["b"].num_cached_tokens == 12 * 16
    assert [outputs["a"].outputs[0].token_ids, outputs["b"].outputs[0].token_ids] == expected


def test_parallel_samples_share_the_prompt_and_diverge_safely(tiny_llama, hf, prompts):
    params = SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=11, logprobs=0)
    llm = LLM(str(tiny_llama))
    prompt = prompts[6][:30]  # the samples share its partial second block, copied when each writes into it
    out = llm.generate([prompt], params)[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    # each sample's log-probabilities are transformers' on that sample's own text: one sample writing into
    # another's KV (a copy-on-write bug) would break this
    for c in out.outputs:
        expected = hf_logprobs(hf, prompt + c.token_ids)[-len(c.token_ids) :]
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-5)
    assert llm.engine.blocks.num_free == llm.engine.runner.num_blocks


def test_same_seed_same_sample(tiny_llama, prompts):
    llm = LLM(str(tiny_llama))
    p = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=3)
    first = llm.generate(prompts[:3], p)
    again = llm.generate(prompts[:3], p)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]


def test_stop_conditions(tiny_llama, prompts):
    llm = LLM(str(tiny_llama))
    base = llm.generate([prompts[2]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    stop_id = base.token_ids[5]
    out = llm.generate([prompts[2]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id]))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    word = base.text.split()[3]
    c = llm.generate([prompts[2]], SamplingParams(max_tokens=12, temperature=0, stop=[word]))[0].outputs[0]
    assert c.finish_reason == "stop" and word not in c.text and base.text.startswith(c.text)


def test_timings_and_streaming(tiny_llama, prompts):
    llm = LLM(str(tiny_llama))
    events = list(llm.stream(prompts[:2], SamplingParams(max_tokens=5, temperature=0)))
    final = [e for e in events if e.finished]
    assert len(final) == 2 and len(events) >= 10
    for out in final:
        c = out.outputs[0]
        assert out.arrival <= c.first_token_time == c.token_times[0]
        assert c.token_times == sorted(c.token_times) and len(c.token_times) == 5


def test_bad_requests_are_rejected_one_by_one(tiny_llama, prompts):
    llm = LLM(str(tiny_llama), kv_cache_memory=8 * 16 * 2 * 2 * 2 * 16 * 4, max_model_len=128)  # 8 blocks
    outs = llm.generate([[], prompts[0], [5 + i % 150 for i in range(200)], prompts[1]], GREEDY)
    assert "empty" in outs[0].error
    assert "model's context holds 128" in outs[2].error
    assert outs[1].outputs[0].token_ids and outs[3].outputs[0].token_ids
    too_long = LLM(str(tiny_llama)).generate([[5 + i % 150 for i in range(600)]], GREEDY)[0]
    assert "model's context holds 512" in too_long.error
    with pytest.raises(SlimlmError, match="holds 128 tokens, fewer than one sequence of 512 tokens"):
        LLM(str(tiny_llama), kv_cache_memory=8 * 16 * 2 * 2 * 2 * 16 * 4, max_model_len=512)
    with pytest.warns(UserWarning, match=r"max_model_len 128 of the model's 512: .* \(0\.1 MiB\) holds"):
        capped = LLM(str(tiny_llama), kv_cache_memory=8 * 16 * 2 * 2 * 2 * 16 * 4)  # no max_model_len asked for
    assert capped.engine.max_model_len == 128
    assert "model's context holds 128" in capped.generate([[5 + i % 150 for i in range(200)]], GREEDY)[0].error
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0), dict(n=0)):
        with pytest.raises(SlimlmError, match="invalid sampling parameters"):
            SamplingParams(**bad)


def test_abort_frees_everything(tiny_llama, prompts):
    llm = LLM(str(tiny_llama), max_num_batched_tokens=16)
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)) for p in prompts]
    for _ in range(4):
        engine.step()
    for r in ids[::2]:
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_free == engine.runner.num_blocks


def test_unseeded_sampling_leaves_the_global_rng_alone(tiny_llama, prompts):
    llm = LLM(str(tiny_llama))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=1.0))
    assert torch.equal(torch.rand(3), expected)


def test_incremental_text_equals_a_full_decode_and_stop_strings_cut_it(tiny_llama, prompts):
    llm = LLM(str(tiny_llama))
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)
    streamed = {}
    for out in llm.stream(prompts[:3], params):
        streamed[out.request_id] = out
    for out in streamed.values():
        full = llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        assert out.outputs[0].text == full
    text = next(iter(streamed.values())).outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = llm.generate(
        [prompts[0]], SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]


def test_a_new_request_is_waiting_prefilling_and_stamped_on_arrival(tiny_llama, prompts):
    engine = LLM(str(tiny_llama), prefix_caching=False).engine
    before = time.perf_counter()
    engine.add_request(prompts[0][:2], SamplingParams(max_tokens=2, temperature=0))
    stats = engine.stats()
    assert (stats.waiting, stats.running, stats.prefilling) == (1, 0, 1)  # its first token is still to compute
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    final = outputs[-1]
    assert before <= final.arrival <= final.outputs[0].first_token_time
    assert final.num_cached_tokens == 0  # no prefix cache: nothing was served from it


def test_abort_reports_once_with_the_text_so_far_and_frees_the_blocks(tiny_llama, prompts):
    engine = LLM(str(tiny_llama)).engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    reported = engine.add_request(prompts[1], params)
    silent = engine.add_request(prompts[2], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, n=2))
    waiting = engine.add_request(prompts[3], params)
    for _ in range(3):
        engine.step()
    engine.abort(waiting)  # still in the queue or running: either way gone
    engine.abort(reported)
    engine.abort(silent, report=False)
    engine.abort("no-such-request")  # ignored
    assert engine.requests == {} and engine.blocks.num_free == engine.runner.num_blocks
    assert engine.has_unfinished()  # the reports are still to come
    outputs = engine.step()
    assert [o.request_id for o in outputs] == [waiting, reported] and all(o.finished for o in outputs)
    done = outputs[1].outputs[0]
    assert done.finish_reason == "abort" and len(done.token_ids) >= 1
    assert done.text == engine.tokenizer.decode(done.token_ids, skip_special_tokens=True)
    assert not engine.has_unfinished() and engine.step() == []
    engine.abort(reported)  # a finished request: nothing more to report
    assert engine.step() == []


def test_stats_describe_the_queue_and_the_pool(tiny_llama, prompts):
    engine = LLM(str(tiny_llama), max_num_batched_tokens=16).engine
    empty = engine.stats()
    assert (empty.waiting, empty.running, empty.prefilling, empty.mean_context) == (0, 0, 0, 0.0)
    assert empty.free_blocks == empty.total_blocks == engine.runner.num_blocks
    assert empty.kv_bytes_per_token == engine.runner.kv_bytes_per_token > 0
    assert empty.weight_bytes == engine.runner.weight_bytes() > 0
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request(prompts[0], params)  # 3 tokens: one step computes it
    engine.step()
    one = engine.stats()
    assert (one.running, one.mean_context) == (1, engine.scheduler.running[0].num_tokens)
    engine.add_request(prompts[4], params)  # 31 tokens: in 16-token chunks, beside the first one's decode
    engine.step()
    s = engine.stats()
    seqs = [*engine.scheduler.waiting, *engine.scheduler.running]
    assert (s.waiting, s.running) == (len(engine.scheduler.waiting), len(engine.scheduler.running)) and s.running >= 1
    assert s.prefilling == sum(q.num_computed < q.num_tokens - 1 for q in seqs) >= 1  # the long prompt is not done
    running = engine.scheduler.running
    assert s.mean_context == sum(q.num_tokens for q in running) / len(running)
    assert s.free_blocks == engine.blocks.num_free < s.total_blocks


def test_each_bad_request_is_refused_with_what_is_wrong(tiny_llama, prompts):
    engine = LLM(str(tiny_llama), max_model_len=64).engine
    vocab = engine.vocab_size
    cases = [
        ([], {}, "the prompt is empty"),
        ("", {}, "the prompt is empty"),
        ([1, vocab], {}, f"prompt token {vocab} is not a token id in 0..{vocab - 1}"),
        ([1, -1], {}, f"prompt token -1 is not a token id in 0..{vocab - 1}"),
        ([1, 2.0], {}, f"prompt token 2.0 is not a token id in 0..{vocab - 1}"),
        ([1, True], {}, f"prompt token True is not a token id in 0..{vocab - 1}"),
        (3, {}, "a prompt is a string or a list of token ids, got int"),
        ("caf\udce9", {}, "the prompt is not valid text (character 3 is not UTF-8)"),
        ([5] * 64, {}, "the prompt has 64 tokens; the model's context holds 64, and one must be generated"),
        (
            [5] * 4,
            {"params": SamplingParams(prompt_logprobs=0, prompt_logprobs_from=4)},
            "prompt_logprobs_from 4 is past the prompt's last token (position 3)",
        ),
        ([5] * 4, {"params": {"temperature": 0}}, "sampling parameters must be a SamplingParams, got dict"),
    ]
    for prompt, kwargs, message in cases:
        with pytest.raises(SlimlmError) as e:
            engine.add_request(prompt, **kwargs)
        assert str(e.value) == message
    assert not engine.has_unfinished()  # nothing refused was queued
    engine.add_request([0, vocab - 1] + [5] * 61, request_id="r")  # the extreme ids and 63 tokens: accepted
    with pytest.raises(SlimlmError) as e:
        engine.add_request([5], request_id="r")
    assert str(e.value) == "request id 'r' is already in use"
    text = " ".join(make_text(1).split()[:6])
    engine.add_request(text, request_id="text")  # a text prompt is its tokenizer's ids
    assert engine.requests["text"].prompt_ids == engine.tokenizer.encode(text)


def test_the_samples_of_one_seeded_request_are_not_copies(tiny_llama, prompts):
    llm = LLM(str(tiny_llama))
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3)
    samples = [c.token_ids for c in llm.generate([prompts[2]], params)[0].outputs]
    assert len({tuple(s) for s in samples}) == 3  # each sample has its own stream of the seed
    again = [c.token_ids for c in llm.generate([prompts[2]], params)[0].outputs]
    assert again == samples
    lone = llm.generate([prompts[2]], SamplingParams(max_tokens=12, temperature=1.0, seed=7))[0].outputs[0]
    assert lone.token_ids == samples[0]  # the first sample is the request's seed itself


def test_prompt_top_logprobs_gather_over_every_chunk(tiny_llama, hf, prompts):
    llm = LLM(str(tiny_llama), max_num_batched_tokens=16)  # a 60-token prompt: four chunks
    out = llm.generate([prompts[6]], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == len(prompts[6]) - 1
    expected = hf_logprobs(hf, prompts[6])
    assert torch.allclose(torch.tensor(out.prompt_logprobs), expected, atol=1e-4)
    assert all(len(top) == 2 and top[0][1] >= top[1][1] for top in out.prompt_top_logprobs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dtype="fp64"), "dtype 'fp64' is not one of auto, float32, bfloat16, float16"),
        (dict(kv_cache_dtype=8), "kv_cache_dtype 8 is not one of auto, fp8, int8, int4, float32, bfloat16, float16"),
        (
            dict(kv_cache_dtype="fp4"),
            "kv_cache_dtype 'fp4' is not one of auto, fp8, int8, int4, float32, bfloat16, float16",
        ),
        (dict(block_size=24), "block_size must be a power of two, got 24"),
        (dict(block_size=0), "block_size must be a positive integer, got 0"),
        (dict(speculative=""), "speculative must be 'ngram', a draft model or None, got ''"),
        (dict(speculative=3), "speculative must be 'ngram', a draft model or None, got 3"),
        (
            dict(num_speculative_tokens=17, speculative="ngram"),
            "num_speculative_tokens must be an integer in 1..block_size (16), got 17",
        ),
        (
            dict(max_model_len=0, max_num_seqs=-1),
            "max_num_seqs must be a positive integer, got -1; max_model_len must be a positive integer or None, got 0",
        ),
    ],
)
def test_engine_config_refusals_name_every_problem(kwargs, message):
    with pytest.raises(SlimlmError) as e:
        EngineConfig(**kwargs)
    assert str(e.value) == "invalid engine config: " + message


def test_engine_config_limits_are_inclusive():
    EngineConfig(block_size=4, num_speculative_tokens=4, max_num_seqs=1, max_num_batched_tokens=1)
    EngineConfig(block_size=1, num_speculative_tokens=1, speculative="ngram")


def edited_model(tiny_llama, tmp_path, **changes):
    d = tmp_path / "edited"
    shutil.copytree(tiny_llama, d)
    config = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_the_engine_reads_context_and_eos_from_the_config(tiny_llama, tmp_path):
    window = edited_model(tiny_llama, tmp_path, sliding_window=64)
    assert Engine(str(window)).max_model_len == 64  # within the window, attention is full attention
    shutil.rmtree(window)
    off = edited_model(tiny_llama, tmp_path, sliding_window=64, use_sliding_window=False)
    assert Engine(str(off)).max_model_len == 512
    shutil.rmtree(off)
    eos = edited_model(tiny_llama, tmp_path, eos_token_id=[1, 2], max_position_embeddings=None)
    engine = Engine(str(eos))
    assert engine.eos_ids == {1, 2} and engine.max_model_len == 2048  # transformers' default context
    shutil.rmtree(eos)
    none = edited_model(tiny_llama, tmp_path, eos_token_id=None)
    assert Engine(str(none)).eos_ids == {Engine(str(tiny_llama)).tokenizer.eos_token_id}


@pytest.mark.parametrize("fast", [True, False])
def test_auto_runs_bf16_where_the_machine_multiplies_it_fast(tiny_llama, monkeypatch, machine_auto_dtype, fast):
    from slimlm import devices

    monkeypatch.setattr(devices, "fast_bf16_matmul", lambda _dev: fast)
    llm = LLM(str(tiny_llama), max_model_len=64)  # an fp32 checkpoint
    engine, want = llm.engine, torch.bfloat16 if fast else torch.float32
    assert engine.dtype == want and engine.runner.model.model.norm.weight.dtype == want
    assert engine.runner.kv_cache.dtype == want  # the KV cache's auto follows the activations
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    assert Engine(str(tiny_llama), EngineConfig(dtype="float32", max_model_len=64)).dtype == torch.float32


def test_the_engine_builds_what_its_config_asks(tiny_llama):
    engine = Engine(
        str(tiny_llama),
        EngineConfig(dtype="bfloat16", prefix_caching=False, max_model_len=100, kv_cache_dtype="float32"),
    )
    assert engine.runner.model.model.norm.weight.dtype == torch.bfloat16
    assert engine.runner.kv_cache.dtype == torch.float32
    assert engine.blocks.prefix_caching is False and engine.max_model_len == 100
    assert engine.capacity == engine.runner.num_blocks * 16
    per_token = Engine(str(tiny_llama), EngineConfig(max_model_len=100)).runner.kv_bytes_per_token  # fp32
    with pytest.raises(SlimlmError) as e:
        Engine(str(tiny_llama), EngineConfig(kv_cache_memory=200_000, max_model_len=512))
    pool, need = 200_000 / 2**20, 512 * per_token / 2**20
    assert re.fullmatch(
        rf"the KV cache pool \({pool:.1f} MiB\) holds \d+ tokens, fewer than one sequence of "
        rf"512 tokens; give kv_cache_memory at least {need:.1f} MiB or lower max_model_len",
        str(e.value),
    ), str(e.value)


def test_each_sample_of_a_seeded_request_is_the_lone_request_of_seed_plus_its_index(tiny_llama, prompts):
    llm = LLM(str(tiny_llama))

    def sample(seed: int, n: int = 1) -> list[list[int]]:
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed, n=n)
        return [c.token_ids for c in llm.generate([prompts[1]], params)[0].outputs]

    assert sample(5, n=3) == [sample(5)[0], sample(6)[0], sample(7)[0]]
    assert sample(2**63 - 1, n=2)[1] == sample(0)[0]  # seeds wrap at 2^63


def test_streamed_steps_carry_text_token_times_and_top_logprobs(tiny_llama, prompts):
    engine = LLM(str(tiny_llama)).engine
    engine.add_request(prompts[2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    partial = [o for o in outputs if not o.finished and len(o.outputs[0].token_ids) >= 3]
    assert partial and all(o.outputs[0].text for o in partial)  # unfinished outputs carry their text so far
    c = outputs[-1].outputs[0]
    assert len(c.top_logprobs) == len(c.token_ids) == len(c.token_times) == 6
    assert all(isinstance(t, float) for t in c.token_times) and c.token_times == sorted(c.token_times)
    assert all(top[0][0] == token for top, token in zip(c.top_logprobs, c.token_ids, strict=True))  # greedy


def test_an_eos_token_stops_the_sequence_unless_ignored(tiny_llama, prompts):
    engine = LLM(str(tiny_llama)).engine
    free = LLM(str(tiny_llama)).generate([prompts[0]], GREEDY)[0].outputs[0].token_ids
    engine.eos_ids = {free[2]}
    first = free.index(free[2])
    out = LLM.__new__(LLM)
    out.engine = engine
    stopped = out.generate([prompts[0]], GREEDY)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free[: first + 1]
    ignored = out.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == free


def test_every_step_leaves_each_sequence_with_its_tokens_but_the_last_in_the_cache(tiny_llama, prompts, monkeypatch):
    engine = LLM(str(tiny_llama), max_num_batched_tokens=16).engine
    step = engine.step

    def checked_step(*args, **kwargs):
        outputs = step(*args, **kwargs)
        for seq in engine.scheduler.running:
            assert seq.num_computed == seq.num_tokens - 1 if seq.output_ids else seq.num_computed < seq.num_tokens
            assert len(seq.block_table) == -(-seq.num_computed // 16)
        return outputs

    monkeypatch.setattr(engine, "step", checked_step)
    for p in prompts[:5]:
        engine.add_request(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    finished = {o.request_id: o for o in outputs if o.finished}
    assert len(finished) == 5 and all(len(o.prompt_logprobs) == len(o.prompt_token_ids) - 1 for o in finished.values())
