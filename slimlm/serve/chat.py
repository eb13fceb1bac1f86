"""POST /v1/chat/completions: messages through the model's chat template, n choices, logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, Request

from slimlm.errors import SlimlmError
from slimlm.serve import protocol as p
from slimlm.serve.serving import Serving, authorize, collect, disconnect_of, event_stream, merge, streamable, usage


class ChatServing(Serving):
    async def create(
        self, body: p.ChatRequest, disconnected: Callable[[], Awaitable[None]] | None = None
    ) -> p.ChatResponse | AsyncIterator[p.ChatChunk]:
        """The response, or with body.stream the chunks as they come. Bad input raises SlimlmError before
        anything is queued; a full queue raises Overloaded."""
        self.check_model(body.model)
        ids = self._prompt(body)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, self.max_model_len - len(ids))
        self.check_length(ids, max_tokens)
        top = body.top_logprobs or 0
        params = body.sampling_params(max_tokens, top if body.logprobs else None, None)
        self.engine.admit()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        header = {"id": rid, "created": int(time.time()), "model": self.served_model_name}
        gens = [self.engine.generate(ids, params, rid, body.stream)]
        if body.stream:
            return self._chunks(gens, body, {**header, "object": "chat.completion.chunk"})
        out = (await collect(gens, disconnected))[0]
        choices = []
        for choice in out.outputs:
            logprobs = None
            if body.logprobs:
                lps, tops = p.choice_logprobs(choice, 0, len(choice.token_ids), top)
                logprobs = p.chat_logprobs(self.tokenizer, choice.token_ids, lps, tops)
            choices.append(
                p.ChatChoice(
                    index=choice.index,
                    message=p.AssistantMessage(content=choice.text),
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                )
            )
        return p.ChatResponse(**header, object="chat.completion", choices=choices, usage=usage([out]))

    def _prompt(self, body: p.ChatRequest) -> list[int]:
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise SlimlmError(f"'{self.served_model_name}' has no chat template; use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # the template's own checks (roles, order) speak for themselves
            raise SlimlmError(f"the messages do not fit the model's chat template: {e}") from None
        return self.prompt_ids(tokenizer.encode(text, add_special_tokens=False))

    async def _chunks(self, gens, body: p.ChatRequest, header: dict) -> AsyncIterator[p.ChatChunk]:
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        top = body.top_logprobs or 0
        last = None
        async for _, out in merge(gens):
            last = out
            for choice in out.outputs:
                if choice.index not in sent_text:
                    sent_text[choice.index] = 0
                    first = p.ChatChunkChoice(
                        index=choice.index,
                        delta=p.ChatDelta(role="assistant", content=""),
                        logprobs=None,
                        finish_reason=None,
                    )
                    yield p.ChatChunk(**header, choices=[first])
                text = streamable(choice, body, out.finished)
                delta = text[sent_text[choice.index] :]
                start, end = sent_tokens.get(choice.index, 0), len(choice.token_ids)
                if not delta and choice.finish_reason is None:
                    continue
                logprobs = None
                if body.logprobs:
                    lps, tops = p.choice_logprobs(choice, start, end, top)
                    logprobs = p.chat_logprobs(self.tokenizer, choice.token_ids[start:end], lps, tops)
                sent_text[choice.index], sent_tokens[choice.index] = len(text), end
                message = p.ChatDelta(content=delta) if delta else p.ChatDelta()
                yield p.ChatChunk(
                    **header,
                    choices=[
                        p.ChatChunkChoice(
                            index=choice.index, delta=message, logprobs=logprobs, finish_reason=choice.finish_reason
                        )
                    ],
                )
        if body.include_usage and last is not None:
            yield p.ChatChunk(**header, choices=[], usage=usage([last]))


router = APIRouter()


@router.post(
    "/v1/chat/completions",
    dependencies=[Depends(authorize)],
    response_model=p.ChatResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def chat(body: p.ChatRequest, request: Request):
    result = await request.app.state.chat.create(body, disconnect_of(request))
    return event_stream(result) if body.stream else result
