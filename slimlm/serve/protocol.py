"""The OpenAI API's request bodies (pydantic: FastAPI validates them and publishes their schema) and the
pieces of its responses: SamplingParams from a request, legacy-completion and chat log-probabilities, usage.

Names, defaults and bounds follow OpenAI's API, with vLLM's extensions (top_k, ignore_eos, stop_token_ids).
Unknown fields are ignored, as OpenAI-compatible servers do, so newer clients keep working; the OpenAI fields this
server does not implement (penalties, logit_bias, tools, response_format, suffix, best_of) are a 400 naming them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from slimlm.errors import SlimlmError
from slimlm.runtime.outputs import CompletionOutput
from slimlm.runtime.sampling import MAX_LOGPROBS, SamplingParams

MAX_N = 32  # choices per prompt: each is a sequence in the batch
MAX_PROMPTS = 64  # prompts in one completions request


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN is "not a finite number", not "> 2"

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # OpenAI fields this server does not implement: accepted at their no-op values only, never ignored (a
    # client asking for JSON output or a tool call must not get plain text and a 200)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: dict | None = None

    def _unsupported(self) -> list[str]:
        """The fields set to something this server would have to ignore (a 400 names them)."""
        names = [name for name in ("presence_penalty", "frequency_penalty") if getattr(self, name)]
        names += ["logit_bias"] if self.logit_bias else []
        names += ["best_of"] if self.best_of not in (None, self.n) else []
        names += ["response_format"] if (self.response_format or {}).get("type", "text") != "text" else []
        return names

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """Raises SlimlmError (a 400) for what the field bounds above cannot express, e.g. an empty stop string."""
        unsupported = self._unsupported()
        if unsupported:
            raise SlimlmError(f"{', '.join(unsupported)} is not supported by this server; leave it out")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            n=self.n,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a text, a list of token ids, or a batch of either"
    )
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, description="return the prompt too (with its log-probabilities when logprobs is set)")
    suffix: str | None = None  # not implemented: accepted empty only

    def _unsupported(self) -> list[str]:
        return super()._unsupported() + (["suffix"] if self.suffix else [])


class TextPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: what the context leaves after the prompt")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # tool calling is not implemented: no tools, or a choice that calls none, only
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None

    def _unsupported(self) -> list[str]:
        names = [name for name in ("tools", "functions") if getattr(self, name)]
        calls = ("tool_choice", "function_call")
        names += [name for name in calls if getattr(self, name) not in (None, "none", "auto")]
        return super()._unsupported() + names


def prompt_batch(prompt) -> list[str | list[int]]:
    """A completions `prompt` as a list of prompts (text or token ids)."""
    if isinstance(prompt, str) or (prompt and all(type(t) is int for t in prompt)):
        return [prompt]
    return list(prompt)


def error_body(message: str, kind: str, status: int) -> dict:
    return {"object": "error", "error": {"message": message, "type": kind, "param": None, "code": status}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer, ids: list[int], lps: list[float | None], tops: list[list[tuple[int, float]] | None], offset: int
) -> dict:
    """Legacy completions' log-probabilities for tokens `ids`: per token its text, its log-probability, the top
    tokens' (with the token itself, as vLLM and OpenAI do) and its offset in the text, starting at `offset`."""
    texts = [token_text(tokenizer, t) for t in ids]
    top_dicts, offsets = [], []
    for lp, top, text in zip(lps, tops, texts, strict=True):
        offsets.append(offset)
        offset += len(text)
        if lp is None:  # the first prompt token: nothing before it to predict it from
            top_dicts.append(None)
            continue
        entries = {token_text(tokenizer, t): v for t, v in (top or [])}
        entries[text] = lp
        top_dicts.append(entries)
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": top_dicts, "text_offset": offsets}


def choice_logprobs(choice: CompletionOutput, start: int, end: int, want_top: int) -> tuple[list, list]:
    """The sampled tokens [start, end) of a choice: their log-probabilities and top lists (empty ones when
    no top tokens were asked for)."""
    lps = (choice.logprobs or [])[start:end]
    tops = (choice.top_logprobs or [])[start:end] if want_top else [[] for _ in lps]
    return lps, tops


def chat_logprobs(tokenizer, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]) -> dict:
    """Chat completions' log-probabilities: per token its text, bytes and log-probability, and the top ones."""

    def entry(token: int, lp: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for token, lp, top in zip(ids, lps, tops, strict=True):
        content.append({**entry(token, lp), "top_logprobs": [entry(t, v) for t, v in top]})
    return {"content": content}


# ---- responses: what /openapi.json publishes, and what each endpoint returns -------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    """A completion, or with stream=true each server-sent chunk of one (usage: in the last, if asked for)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None  # in a choice's first chunk only
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatChunk(BaseModel):
    """One server-sent chunk of a streamed chat completion (usage: in the last, if asked for)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    object: Literal["error"]
    error: ErrorDetail
