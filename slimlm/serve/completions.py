"""POST /v1/completions: the legacy completions endpoint (several prompts, n choices each, echo, logprobs)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, Request

from slimlm.errors import SlimlmError
from slimlm.runtime.engine import RequestOutput
from slimlm.serve import protocol as p
from slimlm.serve.serving import (
    Serving,
    authorize,
    collect,
    disconnect_of,
    event_stream,
    merge,
    streamable,
    usage,
)


class CompletionServing(Serving):
    async def create(
        self, body: p.CompletionRequest, disconnected: Callable[[], Awaitable[None]] | None = None
    ) -> p.CompletionResponse | AsyncIterator[p.CompletionResponse]:
        """The response, or with body.stream the chunks as they come. Bad input raises SlimlmError before
        anything is queued; a full queue raises Overloaded."""
        self.check_model(body.model)
        prompts = p.prompt_batch(body.prompt)
        if not prompts or len(prompts) > p.MAX_PROMPTS:
            raise SlimlmError(f"a request takes 1 to {p.MAX_PROMPTS} prompts, got {len(prompts)}")
        prompt_ids = [self.prompt_ids(x) for x in prompts]
        for ids in prompt_ids:
            self.check_length(ids, body.max_tokens)
        echo_logprobs = body.logprobs if body.echo else None
        params = body.sampling_params(body.max_tokens, body.logprobs, echo_logprobs)
        self.engine.admit()
        rid = f"cmpl-{uuid.uuid4().hex}"
        gens = [self.engine.generate(ids, params, f"{rid}-{i}", body.stream) for i, ids in enumerate(prompt_ids)]
        header = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.served_model_name}
        if body.stream:
            return self._chunks(gens, body, header)
        outs = await collect(gens, disconnected)
        choices = []
        for i, out in enumerate(outs):
            prompt_text = self.tokenizer.decode(out.prompt_token_ids) if body.echo else ""  # once for its n choices
            choices += [self._choice(out, c, body, i * body.n + c.index, prompt_text) for c in out.outputs]
        return p.CompletionResponse(**header, choices=choices, usage=usage(outs))

    def _choice(
        self, out: RequestOutput, choice, body: p.CompletionRequest, index: int, prompt_text: str
    ) -> p.CompletionChoice:
        logprobs = None
        if body.logprobs is not None:
            ids, lps, tops = self._tokens(out, choice, body, 0, len(choice.token_ids), first=True)
            logprobs = p.completion_logprobs(self.tokenizer, ids, lps, tops, 0)
        return p.CompletionChoice(
            index=index, text=prompt_text + choice.text, logprobs=logprobs, finish_reason=choice.finish_reason
        )

    def _tokens(self, out, choice, body, start: int, end: int, first: bool):
        """Token ids, log-probabilities and top lists of a choice's tokens [start, end), and with echo in the
        first piece, of the prompt before them."""
        lps, tops = p.choice_logprobs(choice, start, end, body.logprobs)
        ids = choice.token_ids[start:end]
        if body.echo and first:
            prompt_tops = out.prompt_top_logprobs or [[] for _ in out.prompt_logprobs]
            ids = out.prompt_token_ids + ids
            lps = [None, *out.prompt_logprobs, *lps]
            tops = [None, *prompt_tops, *tops]
        return ids, lps, tops

    async def _chunks(self, gens, body: p.CompletionRequest, header: dict) -> AsyncIterator[p.CompletionResponse]:
        sent_text: dict[int, int] = {}  # per choice: characters sent
        sent_tokens: dict[int, int] = {}  # tokens whose log-probabilities were sent
        offsets: dict[int, int] = {}  # text_offset of the next token
        prompt_texts: dict[int, str] = {}  # echo: per prompt
        finals = []
        async for i, out in merge(gens):
            finals += [out] if out.finished else []
            for choice in out.outputs:
                index = i * body.n + choice.index
                first = index not in sent_text
                text = streamable(choice, body, out.finished)
                delta = text[sent_text.get(index, 0) :]
                if first and body.echo:
                    if i not in prompt_texts:  # once for the prompt's n choices
                        prompt_texts[i] = self.tokenizer.decode(out.prompt_token_ids)
                    delta = prompt_texts[i] + delta
                elif not delta and choice.finish_reason is None:
                    continue
                logprobs = None
                if body.logprobs is not None:
                    start, end = sent_tokens.get(index, 0), len(choice.token_ids)
                    ids, lps, tops = self._tokens(out, choice, body, start, end, first)
                    logprobs = p.completion_logprobs(self.tokenizer, ids, lps, tops, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
                    sent_tokens[index] = end
                sent_text[index] = len(text)
                choices = [
                    p.CompletionChoice(index=index, text=delta, logprobs=logprobs, finish_reason=choice.finish_reason)
                ]
                yield p.CompletionResponse(**header, choices=choices)
        if body.include_usage:
            yield p.CompletionResponse(**header, choices=[], usage=usage(finals))


router = APIRouter()


@router.post(
    "/v1/completions",
    dependencies=[Depends(authorize)],
    response_model=p.CompletionResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def completions(body: p.CompletionRequest, request: Request):
    result = await request.app.state.completions.create(body, disconnect_of(request))
    return event_stream(result) if body.stream else result
