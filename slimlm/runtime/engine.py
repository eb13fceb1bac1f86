"""The engine loop: requests in, one step() at a time, outputs out.

step() = schedule (scheduler) -> one forward pass over the packed batch (model_runner) -> sample the
sequences that reached their last token (sampling) -> append, check stop conditions, release finished
sequences' blocks. Everything a request needs to report (tokens, log-probabilities, times) is kept on
its Sequence; outputs are built from there.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from slimlm import SlimlmError, models
from slimlm.runtime.block_manager import BlockManager
from slimlm.runtime.model_runner import ModelRunner
from slimlm.runtime.sampling import SamplingParams, sample
from slimlm.runtime.scheduler import Scheduler
from slimlm.runtime.sequence import Sequence, Status

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    dtype: str = "float32"
    device: str = "cpu"
    kv_cache_memory: int = 512 << 20  # bytes for the KV block pool
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per step: decodes plus prefill chunks
    prefix_caching: bool = True
    max_model_len: int | None = None  # default: the model's max_position_embeddings


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[float] | None
    first_token_time: float | None
    token_times: list[float]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    arrival: float
    finished: bool
    prompt_logprobs: list[float] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)


class Engine:
    def __init__(self, model: str, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.dtype not in DTYPES:
            raise SlimlmError(f"unknown dtype '{config.dtype}'; use one of {', '.join(DTYPES)}")
        model_dir = models.resolve(model)
        models.check(model_dir)
        self.tokenizer = models.load_tokenizer(model_dir)
        hf = models.read_config(model_dir)
        context = hf.get("max_position_embeddings", 2048)
        if hf.get("sliding_window") and hf.get("use_sliding_window", True):
            context = min(context, hf["sliding_window"])  # within the window, sliding attention is full attention
        self.max_model_len = min(config.max_model_len or context, context)
        self.runner = ModelRunner(
            model_dir, DTYPES[config.dtype], config.device, config.kv_cache_memory, config.block_size,
            self.max_model_len,
        )  # fmt: skip
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.capacity = self.runner.num_blocks * config.block_size  # tokens the pool holds
        eos = hf.get("eos_token_id", self.tokenizer.eos_token_id)
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; a SlimlmError names what is wrong with it (nothing is queued then)."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise SlimlmError("the prompt is empty")
        limit = min(self.max_model_len, self.capacity)
        if len(ids) >= limit:
            where = "model's context" if limit == self.max_model_len else "KV cache pool (raise --kv-cache-memory)"
            raise SlimlmError(f"the prompt has {len(ids)} tokens; the {where} holds {limit}, and one must be generated")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise SlimlmError(f"request id '{request_id}' is already in use")
        request = _Request(request_id, ids, params)
        seq = self._new_sequence(request, 0, list(ids))
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request_id

    def _new_sequence(self, request: _Request, index: int, token_ids: list[int]) -> Sequence:
        seed = request.params.seed
        generator = torch.Generator().manual_seed(seed + index if seed is not None else torch.seed())
        seq = Sequence(
            next(self._ids), request.request_id, token_ids, len(request.prompt_ids), request.params, generator
        )
        request.seqs.append(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        for seq in request.seqs if request else []:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step -------------------------------------------------------------------------------

    def step(self, detokenize: bool = True) -> list[RequestOutput]:
        """Run one batch; outputs of every request that produced a token or finished in it. Unfinished
        outputs carry their text so far only with `detokenize` (streaming); finished ones always do."""
        batch = self.scheduler.schedule()
        if not batch.items:
            return []
        rows, row_of, offset = [], {}, 0
        for item in batch.items:
            if item.seq.params.prompt_logprobs and item.seq.num_computed < item.seq.num_prompt_tokens:
                row_of[id(item)] = len(rows)
                rows += range(offset, offset + item.num_tokens)
            elif item.samples:
                row_of[id(item)] = len(rows)
                rows.append(offset + item.num_tokens - 1)
            offset += item.num_tokens
        logits = self.runner.run(batch, rows) if rows else None
        now = time.perf_counter()
        touched: dict[str, None] = {}
        to_sample: list[tuple[Sequence, torch.Tensor]] = []
        for item in batch.items:
            seq, samples = item.seq, item.samples
            first, last = seq.num_computed, seq.num_computed + item.num_tokens
            seq.num_computed = last
            self.blocks.register_full_blocks(seq)
            if id(item) not in row_of:
                continue
            row = row_of[id(item)]
            if seq.params.prompt_logprobs and first < seq.num_prompt_tokens:
                if first == len(seq.prompt_logprobs):  # not a recomputation after preemption
                    targets = seq.token_ids[first + 1 : min(last + 1, seq.num_prompt_tokens)]
                    lp = torch.log_softmax(logits[row : row + len(targets)], dim=-1)
                    seq.prompt_logprobs += lp[torch.arange(len(targets)), targets].tolist()
                row += item.num_tokens - 1
            if samples:
                to_sample += [(s, logits[row]) for s in self._fork_if_first(seq)]
        if to_sample:
            stacked = torch.stack([lg for _, lg in to_sample])
            seqs = [s for s, _ in to_sample]
            tokens, logprobs = sample(stacked, [s.params for s in seqs], [s.generator for s in seqs])
            for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
                self._append(seq, token, logprob, now)
                touched[seq.request_id] = None
        return [self._output(self.requests[r], detokenize) for r in touched]

    def _fork_if_first(self, seq: Sequence) -> list[Sequence]:
        """At the end of its prompt, a request with n > 1 splits into n sequences sharing the prompt's blocks."""
        request = self.requests[seq.request_id]
        if seq.params.n == 1 or seq.output_ids or len(request.seqs) > 1:
            return [seq]
        children = []
        for index in range(1, seq.params.n):
            child = self._new_sequence(request, index, list(seq.token_ids))
            self.blocks.fork(seq, child)
            child.status = Status.RUNNING
            self.scheduler.running.append(child)
            children.append(child)
        return [seq, *children]

    def _append(self, seq: Sequence, token: int, logprob: float, now: float) -> None:
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        seq.token_times.append(now)
        params = seq.params
        reason = None
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "stop"
        elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= min(self.max_model_len, self.capacity):
            reason = "length"
        if params.stop:
            seq.text = self._text(seq)
            cut = min((i for i in (seq.text.find(s) for s in params.stop) if i >= 0), default=-1)
            if cut >= 0:
                seq.text, reason = seq.text[:cut], "stop"
        if reason:
            self.scheduler.finish(seq, reason)

    def _text(self, seq: Sequence) -> str:
        ids = seq.output_ids
        if seq.finish_reason == "stop" and ids and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _output(self, request: _Request, detokenize: bool) -> RequestOutput:
        first = request.seqs[0]
        finished = len(request.seqs) == first.params.n and all(s.is_finished for s in request.seqs)
        outputs = []
        for i, seq in enumerate(request.seqs):
            # with stop strings _append already decoded (and cut) the text this step
            text = seq.text if seq.params.stop else self._text(seq) if (detokenize or finished) else ""
            outputs.append(CompletionOutput(
                index=i, text=text, token_ids=list(seq.output_ids), finish_reason=seq.finish_reason,
                logprobs=list(seq.logprobs) if seq.params.logprobs else None,
                first_token_time=seq.token_times[0] if seq.token_times else None, token_times=list(seq.token_times),
            ))  # fmt: skip
        if finished:
            del self.requests[request.request_id]
        return RequestOutput(
            request_id=request.request_id, prompt_token_ids=request.prompt_ids, outputs=outputs,
            arrival=first.arrival, finished=finished,
            prompt_logprobs=list(first.prompt_logprobs) if first.params.prompt_logprobs else None,
            num_cached_tokens=first.num_cached_tokens,
        )  # fmt: skip
