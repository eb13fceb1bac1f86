"""Output processing: what the engine's step loop hands back, kept apart from the loop itself.

Per sequence, text grows incrementally (only the newest tokens are decoded each step), stop strings are
searched only in the text the step added (plus a tail as long as the longest stop string), and outputs
carry token ids, log-probabilities and times. A finished request's text is decoded once from all of its
tokens, so it is exactly what a full decode gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slimlm.runtime.sequence import Sequence


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[float] | None  # each sampled token's log-probability, when asked for
    first_token_time: float | None
    token_times: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: the N most likely (id, logprob)
    num_drafted: int = 0  # speculative decoding: tokens proposed and verified
    num_accepted: int = 0  # of those, accepted
    kv_tokens: int = 0  # tokens whose K/V the sequence held after its last step (runtime.kv_policy)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    arrival: float
    finished: bool
    prompt_logprobs: list[float] | None = None  # of prompt tokens prompt_logprobs_from, ..., the last
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class Detokenizer:
    """Incremental decoding: tokens [prefix, read) were decoded last time as context for the next ones,
    so a multi-token character or a space that depends on the previous token comes out right."""

    prefix: int = 0
    read: int = 0
    text: str = ""
    stopped_at: int | None = None  # where a stop string cut the text

    def add(self, tokenizer, ids: list[int]) -> str:
        before = tokenizer.decode(ids[self.prefix : self.read], skip_special_tokens=True)
        after = tokenizer.decode(ids[self.prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):  # an incomplete character: wait for more
            return ""
        new = after[len(before) :]
        self.prefix, self.read = self.read, len(ids)
        self.text += new
        return new


@dataclass
class OutputProcessor:
    tokenizer: object
    eos_ids: set[int]
    detok: dict[int, Detokenizer] = field(default_factory=dict)  # by seq_id

    def _advance(self, seq: Sequence) -> tuple[Detokenizer, str]:
        """Decode the sequence's newest tokens; its detokenizer and the text they added."""
        d = self.detok.setdefault(seq.seq_id, Detokenizer())
        return d, d.add(self.tokenizer, self._visible_ids(seq))

    def stop_string_hit(self, seq: Sequence) -> bool:
        """Advance the sequence's text; True (and the text cut before it) when a stop string appeared."""
        d, new = self._advance(seq)
        if not new or not seq.params.stop:
            return False
        longest = max(map(len, seq.params.stop))
        start = max(0, len(d.text) - len(new) - longest + 1)
        hits = [i for i in (d.text.find(s, start) for s in seq.params.stop) if i >= 0]
        if hits:
            d.stopped_at = min(hits)
            d.text = d.text[: d.stopped_at]
        return bool(hits)

    def _visible_ids(self, seq: Sequence) -> list[int]:
        ids = seq.output_ids
        if ids and ids[-1] in self.eos_ids and not seq.params.ignore_eos:
            ids = ids[:-1]
        return ids

    def text(self, seq: Sequence, final: bool) -> str:
        d = self.detok.get(seq.seq_id)
        if final:
            if d is not None and d.stopped_at is not None:
                return d.text
            return self.tokenizer.decode(self._visible_ids(seq), skip_special_tokens=True)
        if d is None or d.read < len(self._visible_ids(seq)):  # streaming without stop strings
            d, _ = self._advance(seq)
        return d.text

    def output(self, request, detokenize: bool, finished: bool) -> RequestOutput:
        first = request.seqs[0]
        outputs = []
        for i, seq in enumerate(request.seqs):
            text = self.text(seq, final=seq.is_finished) if (detokenize or finished) else ""
            want = seq.params.logprobs is not None
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(seq.output_ids),
                    finish_reason=seq.finish_reason,
                    logprobs=list(seq.logprobs) if want else None,
                    first_token_time=seq.token_times[0] if seq.token_times else None,
                    token_times=list(seq.token_times),
                    top_logprobs=list(seq.top_logprobs) if want and seq.params.logprobs else None,
                    num_drafted=seq.num_drafted,
                    num_accepted=seq.num_accepted,
                    kv_tokens=seq.kv_tokens,
                )
            )
        if finished:
            for seq in request.seqs:
                self.detok.pop(seq.seq_id, None)
        prompt = first.params.prompt_logprobs is not None
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_ids,
            outputs=outputs,
            arrival=first.arrival,
            finished=finished,
            prompt_logprobs=list(first.prompt_logprobs) if prompt else None,
            num_cached_tokens=first.num_cached_tokens,
            error=request.error,
            prompt_top_logprobs=list(first.prompt_top_logprobs) if prompt and first.params.prompt_logprobs else None,
        )
