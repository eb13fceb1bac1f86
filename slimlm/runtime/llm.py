"""The offline API, vLLM's shape: LLM(model).generate(prompts, SamplingParams) and a streaming variant."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from slimlm.errors import SlimlmError
from slimlm.runtime.engine import Engine, EngineConfig, RequestOutput
from slimlm.runtime.sampling import SamplingParams

Prompts = str | Sequence[str] | Sequence[Sequence[int]]


class LLM:
    _streaming = False  # a stream() iterator has started and not ended: its requests are in the engine

    def __init__(self, model: str, **config) -> None:
        """`model`: a bundled asset, a local directory or a hub id; keyword arguments: EngineConfig fields."""
        self.engine = Engine(model, EngineConfig(**config))
        self.tokenizer = self.engine.tokenizer

    def _check_idle(self) -> None:
        # generate() would step the stream's requests to completion and swallow their outputs
        if self._streaming:
            raise SlimlmError(
                "an LLM.stream() iterator is still open on this LLM; exhaust or close() it first (or use another LLM)"
            )

    def _submit(self, prompts: Prompts, params: SamplingParams | Sequence[SamplingParams] | None) -> list:
        """Queue every prompt; a prompt that cannot be served becomes an error output, the rest still run."""
        if isinstance(prompts, str) or (prompts and all(type(t) is int for t in prompts)):
            prompts = [prompts]  # one prompt: a text, or a flat list of token ids
        if not isinstance(prompts, (list, tuple)):
            raise SlimlmError(f"prompts must be a string, a list of token ids or a list of those, not {prompts!r:.40}")
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise SlimlmError(f"{len(prompts)} prompts but {len(params_list)} sampling parameter sets")
        submitted = []
        for prompt, p in zip(prompts, params_list, strict=True):
            try:
                submitted.append(self.engine.add_request(prompt, p))
            except SlimlmError as e:  # this prompt only; the others run
                submitted.append(RequestOutput("rejected", [], [], 0.0, finished=True, error=str(e)))
        return submitted

    def generate(
        self, prompts: Prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run all prompts to completion in one continuous batch; outputs in prompt order."""
        self._check_idle()
        submitted = self._submit(prompts, params)
        done: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step(detokenize=False):
                    if out.finished:
                        done[out.request_id] = out
        finally:  # an exception (or Ctrl-C) leaves nothing of this call queued in the engine
            for s in submitted:
                if isinstance(s, str) and s not in done:
                    self.engine.abort(s, report=False)
        return [s if isinstance(s, RequestOutput) else done[s] for s in submitted]

    def stream(
        self, prompts: Prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[RequestOutput]:
        """Yield each request's output every time it grows, and a last time when it finishes."""
        self._check_idle()
        submitted = self._submit(prompts, params)
        finished: set[str] = set()
        self._streaming = True
        try:
            for s in submitted:
                if isinstance(s, RequestOutput):
                    yield s
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    finished.update([out.request_id] if out.finished else [])
                    yield out
        finally:  # the consumer stopped early: its requests must not linger in the engine
            self._streaming = False
            for s in submitted:
                if isinstance(s, str) and s not in finished:
                    self.engine.abort(s, report=False)
