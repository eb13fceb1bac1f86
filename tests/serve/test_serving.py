"""The endpoints' serving classes without HTTP: a request body in, the response model (or its chunks) out."""

import asyncio

import pytest

from slimlm.errors import SlimlmError
from slimlm.runtime.engine import Engine, EngineConfig
from slimlm.runtime.sampling import SamplingParams
from slimlm.serve import protocol as p
from slimlm.serve.async_engine import AsyncEngine
from slimlm.serve.chat import ChatServing
from slimlm.serve.completions import CompletionServing
from slimlm.serve.serving import ClientGone
from tests.serve.conftest import ENGINE, NAME


def serve(chat_llama, work):
    """Run `work(completions, chat)` on an event loop with the engine on its own thread."""

    async def main():
        aengine = AsyncEngine(Engine(str(chat_llama), EngineConfig(**ENGINE)))
        aengine.start()
        try:
            return await work(CompletionServing(aengine, NAME), ChatServing(aengine, NAME))
        finally:
            await aengine.stop()

    return asyncio.run(main())


def test_completions_and_chat_answer_as_the_offline_api(chat_llama, offline):
    greedy = dict(max_tokens=6, temperature=0, ignore_eos=True)

    async def work(completions, chat):
        whole = await completions.create(p.CompletionRequest(prompt=["a b c", "d e"], **greedy))
        chunks = [
            c
            async for c in await completions.create(
                p.CompletionRequest(prompt="a b c", stream=True, stream_options={"include_usage": True}, **greedy)
            )
        ]
        answer = await chat.create(p.ChatRequest(messages=[{"role": "user", "content": "hi"}], **greedy))
        return whole, chunks, answer

    whole, chunks, answer = serve(chat_llama, work)
    expected = [o.outputs[0].text for o in offline.generate(["a b c", "d e"], SamplingParams(**greedy))]
    assert isinstance(whole, p.CompletionResponse) and [c.text for c in whole.choices] == expected
    assert whole.usage.completion_tokens == 12 and whole.model == NAME
    assert all(isinstance(c, p.CompletionResponse) for c in chunks)
    assert "".join(c.choices[0].text for c in chunks[:-1]) == expected[0]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert "usage" not in chunks[0].model_dump(exclude_unset=True)  # a chunk's usage is sent only when set
    assert isinstance(answer, p.ChatResponse) and answer.choices[0].message.role == "assistant"
    assert answer.usage.completion_tokens == 6


def test_bad_input_is_refused_before_anything_is_queued(chat_llama):
    async def work(completions, chat):
        errors = []
        for call in (
            completions.create(p.CompletionRequest(prompt="x", model="other")),
            completions.create(p.CompletionRequest(prompt="x", max_tokens=10**6)),
        ):
            with pytest.raises(SlimlmError) as e:
                await call
            errors.append(str(e.value))
        return errors, completions.engine.in_flight

    errors, in_flight = serve(chat_llama, work)
    assert errors[0] == "model 'other' is not served here; this server serves 'tiny'"
    assert errors[1].startswith("this model's maximum context length is")
    assert in_flight == 0


def test_a_client_that_leaves_aborts_its_requests(chat_llama):
    async def work(completions, chat):
        with pytest.raises(ClientGone):
            await completions.create(
                p.CompletionRequest(prompt="a", max_tokens=200, ignore_eos=True), disconnected=lambda: asyncio.sleep(0)
            )
        for _ in range(200):  # the abort reaches the engine thread
            if completions.engine.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        return completions.engine.in_flight

    assert serve(chat_llama, work) == 0
