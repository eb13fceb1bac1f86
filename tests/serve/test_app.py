"""The server through the official `openai` client and plain HTTP: the same tokens as the offline API,
streaming equal to not streaming, seeds, stop strings, log-probabilities, and bad input as 4xx."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from slimlm.runtime.sampling import SamplingParams
from tests.serve.conftest import ENGINE, NAME, metric

PROMPTS = ["the city river", "music school team war", "the first new one two city", "game people world church"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def offline_texts(offline, prompts, **params) -> list[str]:
    return [o.outputs[0].text for o in offline.generate(prompts, SamplingParams(**params))]


def test_models_lists_the_served_name(client, offline):
    (card,) = client.models.list().data
    assert card.id == NAME and card.max_model_len == offline.engine.max_model_len


def test_greedy_completions_equal_the_offline_api_token_for_token(client, offline):
    r = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == offline_texts(
        offline, PROMPTS, max_tokens=12, temperature=0
    )
    ids = offline.tokenizer.encode(PROMPTS[0])
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    assert r.usage.completion_tokens == 12 * len(PROMPTS)
    assert r.usage.prompt_tokens == sum(len(offline.tokenizer.encode(p)) for p in PROMPTS)


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(client):
    whole = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=PROMPTS[1],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat_equals_the_offline_api_on_the_chat_template(client, offline):
    messages = [{"role": "user", "content": "the river"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    text = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = offline.tokenizer.encode(text, add_special_tokens=False)
    expected = offline_texts(offline, [ids], max_tokens=10, temperature=0)[0]
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_seeds_fix_the_samples_and_n_gives_distinct_choices(client):
    def texts(seed):
        r = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, n=4, seed=seed)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    a, b, c = texts(7), texts(7), texts(8)
    assert a == b and a != c and len(set(a)) > 1


def test_stop_strings_cut_the_text_streaming_or_not(client, offline):
    full = offline_texts(offline, [PROMPTS[0]], max_tokens=30, temperature=1.0, seed=3)[0]
    stop = full.split()[3]  # a word that appears in the text
    expected = full[: full.find(stop)]
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=30, temperature=1.0, seed=3, stop=[stop])
    r = client.completions.create(**kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == expected


def test_logprobs_and_echo_equal_the_offline_scores(client, offline):
    prompt = PROMPTS[3]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    (out,) = offline.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2))
    lp = r.choices[0].logprobs
    n_prompt = len(out.prompt_token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(out.prompt_logprobs, abs=1e-5)
    assert lp.token_logprobs[n_prompt:] == pytest.approx(out.outputs[0].logprobs, abs=1e-5)
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    assert r.choices[0].text.startswith(offline.tokenizer.decode(out.prompt_token_ids))
    greedy = r.choices[0].logprobs.top_logprobs[-1]
    assert max(greedy.values()) == pytest.approx(lp.token_logprobs[-1])  # greedy: the token is the top one


@pytest.mark.parametrize("logprobs", [0, 2])
def test_echo_of_a_one_token_prompt_has_a_null_first_logprob(client, logprobs):
    """As OpenAI and vLLM answer: the prompt's only token has nothing before it to be scored by."""
    r = client.completions.create(model=NAME, prompt=[42], max_tokens=1, logprobs=logprobs, echo=True)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == 2 and lp.tokens[0] is not None


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "war"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"prompt": "x", "model": "other"}, "model 'other' is not served here"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "n": 0}, "n:"),
        ({"prompt": [10**9]}, "is not a token id"),
        ({"prompt": ""}, "the prompt is empty"),
        ({"prompt": "x", "max_tokens": 100000}, "maximum context length is 512"),
        ({"prompt": "x", "stop": [""]}, "stop must be a list of non-empty strings"),
        ({"prompt": "x", "logprobs": 99}, "logprobs"),
        ({"max_tokens": 3}, "prompt: Field required"),
        ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty is not supported by this server"),
        ({"prompt": "x", "temperature": float("nan")}, "temperature: Input should be a finite number"),
        ({"prompt": "x", "top_p": float("inf")}, "top_p: Input should be a finite number"),
    ],
)
def test_bad_requests_get_400_with_an_openai_error_body(server, body, needle):
    r = httpx.post(f"{server}/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "route,extra,field",
    [
        ("chat", {"tools": [TOOL]}, "tools"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ("chat", {"functions": [TOOL["function"]]}, "functions"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format"),
        ("completions", {"suffix": "x"}, "suffix"),
        ("completions", {"best_of": 2}, "best_of"),
    ],
)
def test_a_field_the_server_would_ignore_is_a_400_naming_it(client, route, extra, field):
    """Tools, JSON output, suffix, best_of: not implemented, so refused by name rather than answered with plain
    text and a 200 (through the openai client, as its users send them)."""
    with pytest.raises(openai.BadRequestError, match=f"{field} is not supported by this server; leave it out"):
        if route == "chat":
            messages = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, extra_body=extra)
        else:
            client.completions.create(model=NAME, prompt="hi", max_tokens=2, extra_body=extra)


def test_the_no_op_values_of_those_fields_are_served(client):
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=2, tool_choice="none", response_format={"type": "text"}
    )
    assert r.choices[0].message.content is not None
    r = client.completions.create(model=NAME, prompt="hi", max_tokens=2, best_of=1, suffix="")
    assert len(r.choices) == 1


def test_malformed_json_and_unknown_routes(server):
    r = httpx.post(f"{server}/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert httpx.get(f"{server}/v1/nothing").status_code == 404
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=NAME, prompt="x" * 5, max_tokens=10**6)


def test_health_and_metrics(server):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server}/metrics").text
    assert metric(text, "slimlm_kv_blocks_free") == metric(text, "slimlm_kv_blocks_pool") > 0
    assert 'slimlm_time_to_first_token_seconds_bucket{le="+Inf"}' in text


def test_a_streaming_client_that_disconnects_frees_its_blocks(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    aborted = metric(httpx.get(f"{server}/metrics").text, "slimlm_requests_aborted_total")
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    _wait_idle(server, aborted + 1)


def test_a_waiting_client_that_disconnects_is_aborted(chat_llama):
    import time

    from slimlm.runtime.engine import Engine, EngineConfig
    from slimlm.serve.app import serve_in_thread

    # Each step made to last 20 ms, so that the request is still running when the client gives up whatever
    # the machine's speed (the tiny model decodes 480 tokens in under 0.3 s on a fast one).
    engine = Engine(str(chat_llama), EngineConfig(**ENGINE))
    step = engine.step
    engine.step = lambda *a, **k: (time.sleep(0.02), step(*a, **k))[1]
    body = {"prompt": PROMPTS[1], "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with serve_in_thread(engine, NAME) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.3))
        _wait_idle(server, 1)


def _wait_idle(server, aborted: float, seconds: float = 10.0) -> None:
    """The engine aborted the request (it did not run to its end), nothing is in flight, every KV block is free."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        text = httpx.get(f"{server}/metrics").text
        values = [
            metric(text, f"slimlm_{m}")
            for m in ("requests_in_flight", "requests_aborted_total", "kv_blocks_free", "kv_blocks_pool")
        ]
        if values[:2] == [0, aborted] and values[2] == values[3]:
            return
        time.sleep(0.02)
    raise AssertionError(f"still busy after {seconds} s:\n{text}")


def test_api_key_is_required_when_set(chat_llama):
    from slimlm.runtime.engine import Engine, EngineConfig
    from slimlm.serve.app import serve_in_thread

    engine = Engine(str(chat_llama), EngineConfig(kv_cache_memory=4 << 20))
    with serve_in_thread(engine, NAME, api_key="s3cret") as url:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        for wrong in ("Basic s3cret", "s3cret", "Bearer s3cret2", "Bearers3cret"):
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": wrong}).status_code == 401, wrong
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200  # RFC 7235
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert ok.models.list().data[0].id == NAME
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key


def test_a_full_waiting_queue_answers_503_with_retry_after(tiny_llama):
    import concurrent.futures
    import threading

    from slimlm.runtime.engine import Engine, EngineConfig
    from slimlm.serve.app import serve_in_thread

    # The engine's steps wait at a gate until the burst is answered, so no machine speed changes the outcome:
    # one request runs, two wait in the queue (max_waiting=2), the other nine are refused.
    engine = Engine(str(tiny_llama), EngineConfig(kv_cache_memory=8 << 20, max_num_seqs=1))
    stepping, release, step = threading.Event(), threading.Event(), engine.step

    def gated_step(**kwargs):
        stepping.set()
        assert release.wait(300)
        return step(**kwargs)

    engine.step = gated_step
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with serve_in_thread(engine, NAME, max_waiting=2) as url, concurrent.futures.ThreadPoolExecutor(12) as pool:
        post = lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=None)  # noqa: E731
        first = pool.submit(post)
        assert stepping.wait(300)  # the first request is in the engine
        burst = [pool.submit(post) for _ in range(11)]
        done: set = set()
        while len(done) < 9:  # the refusals come back while the gate is closed; the two queued cannot
            answered = concurrent.futures.wait(set(burst) - done, 60, "FIRST_COMPLETED").done
            assert answered, f"{len(done)} of the burst answered while the engine was busy; 9 should be refused"
            done |= answered
        release.set()
        responses = [f.result() for f in [first, *burst]]
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 3 + [503] * 9, codes
    assert all(f.result().status_code == 503 for f in done)
    rejected = next(r for r in responses if r.status_code == 503)
    assert rejected.headers["retry-after"] == "1" and "waiting queue is full" in rejected.json()["error"]["message"]
    texts = {r.json()["choices"][0]["text"] for r in responses if r.status_code == 200}
    assert len(texts) == 1  # the ones served are all the same greedy text


def test_speculative_serving_gives_the_same_text_and_reports_acceptance(chat_llama, offline):
    from slimlm.runtime.engine import Engine, EngineConfig
    from slimlm.serve.app import serve_in_thread

    engine = Engine(str(chat_llama), EngineConfig(kv_cache_memory=4 << 20, speculative="ngram"))
    prompt = "the city river the city river the city river"
    with serve_in_thread(engine, NAME) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0})
        text = httpx.get(f"{url}/metrics").text
    assert r.json()["choices"][0]["text"] == offline_texts(offline, [prompt], max_tokens=24, temperature=0)[0]
    drafted, accepted = (metric(text, f"slimlm_spec_decode_{m}_tokens_total") for m in ("draft", "accepted"))
    assert drafted > 0 and metric(text, "slimlm_spec_decode_acceptance_rate") == pytest.approx(accepted / drafted)
