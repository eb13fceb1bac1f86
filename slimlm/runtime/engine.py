"""The engine loop: requests in, one step() at a time, outputs out.

step() = schedule (scheduler) -> one forward pass over the packed batch (model_runner) -> sample the
sequences that reached their last token (sampling) -> append and check stop conditions -> outputs
(outputs.OutputProcessor: incremental text, stop strings, log-probabilities). Requests are validated when
they are added, so nothing that reaches step() can fail there because of what one request asked.
"""

from __future__ import annotations

import itertools
import time
import warnings
from dataclasses import dataclass, field

import torch

from slimlm import devices, kernels, models
from slimlm.errors import FieldError, SlimlmError
from slimlm.formats import kv_cache, manifest
from slimlm.formats.kv_cache import CACHE_DTYPES as KV_CACHE_DTYPES
from slimlm.kernels import ACTIVATIONS
from slimlm.runtime.block_manager import BlockManager
from slimlm.runtime.kv_policy import OBSERVATION, SINK_BLOCKS, KVPolicy, window_eviction
from slimlm.runtime.model_runner import CENTERED_KEYS, DTYPES, KEY_OFFSET_TEXT, ModelRunner
from slimlm.runtime.outputs import CompletionOutput, OutputProcessor, RequestOutput
from slimlm.runtime.sampling import SamplingParams, sample, top_logprobs
from slimlm.runtime.scheduler import Batch, Scheduler
from slimlm.runtime.sequence import Sequence
from slimlm.runtime.speculative import NgramProposer, Proposal, distributions, verify, verify_greedy

__all__ = ["CompletionOutput", "Engine", "EngineConfig", "EngineStats", "RequestOutput"]


def _positive_int(value) -> bool:
    return type(value) is int and value > 0


@dataclass
class EngineConfig:
    dtype: str = "auto"  # activations: auto (bf16 where the machine multiplies it fast, else fp32) or a dtype
    device: str | None = None  # default: cuda when available, else cpu
    kv_cache_memory: int = 512 << 20  # bytes for the KV block pool
    kv_cache_dtype: str = "auto"  # the checkpoint's kv_cache_scheme, else dtype; or fp8, int8, a float dtype
    block_size: int = 16
    max_num_seqs: int = 64
    # per step: decodes plus prefill chunks. Scoring too: on CPU, steps of 2048 tokens made evals and perplexity
    # 1.2x slower on the 1.5B (a step's MLP buffers then pass glibc's 32 MB mmap limit: fresh pages every layer)
    max_num_batched_tokens: int = 512
    prefix_caching: bool = True
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    speculative: str | None = None  # "ngram" (prompt lookup) or a draft model with the same tokenizer
    num_speculative_tokens: int = 4  # drafted tokens per verification pass, at most block_size
    kv_policy: str = "full"  # what a sequence keeps of its KV history: full, window or snapkv (kv_policy.py)
    kv_budget: int = 1024  # the tokens a window or snapkv sequence keeps; a request may ask for its own
    # how CPU kernels multiply: auto = the fastest loop (on AVX2, 4-bit linears take x rounded to int8, as
    # llama.cpp does); exact = the checkpoint's arithmetic, what transformers and vLLM compute
    activations: str = "auto"

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.activations not in ACTIVATIONS:
            problems.append(f"activations {self.activations!r} is not one of {', '.join(ACTIVATIONS)}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        for name in ("kv_cache_memory", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if not _positive_int(getattr(self, name)):
                problems.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if _positive_int(self.block_size) and self.block_size & (self.block_size - 1):
            problems.append(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and not _positive_int(self.max_model_len):
            problems.append(f"max_model_len must be a positive integer or None, got {self.max_model_len!r}")
        if self.speculative is not None and not (isinstance(self.speculative, str) and self.speculative):
            problems.append(f"speculative must be 'ngram', a draft model or None, got {self.speculative!r}")
        k = self.num_speculative_tokens
        drafting = self.speculative is not None  # without speculation the default 4 must not bound block_size
        if not _positive_int(k) or (drafting and _positive_int(self.block_size) and k > self.block_size):
            problems.append(
                f"num_speculative_tokens must be an integer in 1..block_size ({self.block_size}), got {k!r}"
            )
        try:
            policy = KVPolicy(self.kv_policy, self.kv_budget)
            if _positive_int(self.block_size):
                policy.check(self.block_size)
        except FieldError as e:
            if not problems:
                raise  # alone, it keeps its field: each front end names it its way
            problems.append(str(e))
        if problems:
            raise SlimlmError("invalid engine config: " + "; ".join(problems))


def activation_dtype(name: str, hf_config: dict, device: torch.device) -> torch.dtype:
    """EngineConfig.dtype as a torch dtype; auto is the machine's fast one (devices.fast_dtype). Measured on
    SmolLM2 on an AMX Xeon: wiki perplexity 29.269 in bf16 against 29.276 in fp32, scored 5.8x faster."""
    return DTYPES[name] or devices.fast_dtype(models.stored_dtype(hf_config), device)


@dataclass
class EngineStats:
    """What benchmarks and the server read about the engine's state."""

    waiting: int
    running: int
    prefilling: int  # sequences (waiting or running) with prompt tokens still to compute
    mean_context: float  # tokens per running sequence
    free_blocks: int
    total_blocks: int
    kv_bytes_per_token: int
    weight_bytes: int  # bytes a decode step reads for the weights (embeddings excluded)
    preemptions: int  # since start


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None


class Engine:
    def __init__(self, model: str, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.device = devices.resolve_device(config.device)
        self.model_dir = model_dir = models.resolve(model)
        hf = models.check(model_dir)
        self.tokenizer = models.load_tokenizer(model_dir)
        context = models.context_length(hf)
        if (config.max_model_len or 0) > context:  # before the weights load: positions past it have no RoPE
            raise SlimlmError(
                f"max_model_len {config.max_model_len} is past the model's context of {context} "
                f"tokens; give at most {context}"
            )
        self.max_model_len = config.max_model_len or context
        self.dtype = activation_dtype(config.dtype, hf, self.device)
        self.runner = ModelRunner(
            model_dir,
            self.dtype,
            str(self.device),
            config.kv_cache_memory,
            config.block_size,
            self.max_model_len,
            config.kv_cache_dtype,
            exact=config.activations == "exact",
        )
        if self.runner.kv_cache.dtype in CENTERED_KEYS:  # keys are stored less their mean (model_runner says why)
            layers, attn = self.model.model.layers, self.model.model.layers[0].self_attn
            meta = manifest.read(model_dir)
            stored = kv_cache.read_key_offsets(model_dir, meta, len(layers), attn.kv_heads, attn.head_dim)
            self.runner.set_key_offsets(self.tokenizer.encode(KEY_OFFSET_TEXT)[: self.max_model_len], stored)
        self.capacity = self.runner.num_blocks * config.block_size  # tokens the pool holds
        if self.capacity < self.max_model_len and config.max_model_len is None:
            # The model's own context would not fit one sequence (Qwen2.5's 32K in the default 512 MiB): serve
            # the context the pool holds, as vLLM does with the memory it is given, rather than refuse to start.
            warnings.warn(
                f"max_model_len {self.capacity} of the model's {self.max_model_len}: that is what the KV "
                f"cache pool ({config.kv_cache_memory / 2**20:.1f} MiB) holds; raise --kv-cache-memory "
                "for more",
                stacklevel=2,
            )
            self.max_model_len = self.capacity
        if self.capacity < self.max_model_len:
            need = self.max_model_len * self.runner.kv_bytes_per_token
            raise FieldError(  # {max_model_len}: a command that derives it from its own option says that one
                "kv_cache_memory",
                f"the KV cache pool ({config.kv_cache_memory / 2**20:.1f} MiB) holds {self.capacity} tokens, "
                f"fewer than one sequence of {self.max_model_len} tokens; give {{kv_cache_memory}} at least "
                f"{need / 2**20:.1f} MiB or lower {{max_model_len}}",
            )
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.prefix_caching)
        self._weight_bytes = self.runner.weight_bytes()  # walks every module: once, not per stats() call
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        eos = hf.get("eos_token_id", self.tokenizer.eos_token_id)
        self.eos_ids = {e for e in (eos if isinstance(eos, list) else [eos]) if type(e) is int}
        self.vocab_size = self.runner.model.config.vocab_size
        self.outputs = OutputProcessor(self.tokenizer, self.eos_ids)
        self.requests: dict[str, _Request] = {}
        self._finished_outside_step: list[RequestOutput] = []  # aborted requests, reported by the next step
        self._ids = itertools.count()
        self.proposer = self._proposer(config)
        self.kv_policy = KVPolicy(config.kv_policy, config.kv_budget)
        self._windows: dict[int, list[torch.Tensor]] = {}  # seq_id -> per layer, its observed queries (snapkv)

    def arithmetic(self) -> str:
        """What multiplies here, in a few words a command prints: the kernels, the activations' dtype, and
        whether any linear takes its x rounded to int8 (AVX2's 4-bit loop under activations=auto)."""
        backend = self.runner.model.backend_name
        with kernels.exact_activations(self.config.activations == "exact"):
            rounded = backend == "cpu" and kernels.cpu_gemm.quantizes_activations()
        how = "int8 activations in 4-bit linears (--activations exact: the checkpoint's)" if rounded else "exact"
        return f"{backend} kernels, {devices.dtype_name(self.dtype)}, {how}"

    def _proposer(self, config: EngineConfig):
        if config.speculative is None:
            return None
        if config.speculative == "ngram":
            return NgramProposer(config.num_speculative_tokens)
        from slimlm.runtime.draft import DraftProposer

        return DraftProposer(config.speculative, self, config.num_speculative_tokens)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; a SlimlmError names what is wrong with it (nothing is queued then)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise SlimlmError(f"sampling parameters must be a SamplingParams, got {type(params).__name__}")
        ids = self.prompt_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise SlimlmError(
                f"the prompt has {len(ids)} tokens; the model's context holds {self.max_model_len}, "
                "and one must be generated"
            )
        # from 1 (the default) a one-token prompt simply has nothing to score: its only token is null in an echo
        if params.prompt_logprobs is not None and 1 < params.prompt_logprobs_from >= len(ids):
            raise SlimlmError(
                f"prompt_logprobs_from {params.prompt_logprobs_from} is past the prompt's last token "
                f"(position {len(ids) - 1})"
            )
        if params.kv_policy is not None:
            params.kv_policy.check(self.config.block_size)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise SlimlmError(f"request id '{request_id}' is already in use")
        request = _Request(request_id, ids, params)
        seq = self._new_sequence(request, 0, list(ids))
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request_id

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids (a text is encoded, ids are checked); a SlimlmError names what is wrong."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise SlimlmError(f"the prompt is not valid text (character {e.start} is not UTF-8)") from None
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            bad = next((t for t in ids if type(t) is not int or not 0 <= t < self.vocab_size), None)
            if bad is not None or any(type(t) is not int for t in ids):
                raise SlimlmError(f"prompt token {bad!r} is not a token id in 0..{self.vocab_size - 1}")
        else:
            raise SlimlmError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise SlimlmError("the prompt is empty")
        return ids

    def _new_sequence(self, request: _Request, index: int, token_ids: list[int]) -> Sequence:
        seed = request.params.seed
        generator = torch.Generator(self.device)
        if seed is None:
            generator.seed()  # its own entropy: the caller's global torch RNG is left alone
        else:
            generator.manual_seed((seed + index) % 2**63)
        seq = Sequence(
            next(self._ids), request.request_id, token_ids, len(request.prompt_ids), request.params, generator
        )
        seq.kv_policy = request.params.kv_policy or self.kv_policy
        request.seqs.append(seq)
        return seq

    def abort(self, request_id: str, report: bool = True) -> None:
        """Stop a request now and free its blocks; with `report`, its final output (finish_reason "abort")
        comes from the next step(). Unknown or finished ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            self._windows.pop(seq.seq_id, None)
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        output = self.outputs.output(request, detokenize=True, finished=True)  # also forgets its text state
        if report:
            self._finished_outside_step.append(output)
        del self.requests[request_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._finished_outside_step)

    def stats(self) -> EngineStats:
        s = self.scheduler
        seqs = [*s.waiting, *s.running]
        return EngineStats(
            waiting=len(s.waiting),
            running=len(s.running),
            prefilling=sum(q.num_computed < q.num_tokens - 1 for q in seqs),
            mean_context=sum(q.num_tokens for q in s.running) / max(1, len(s.running)),
            free_blocks=self.blocks.num_free,
            total_blocks=self.runner.num_blocks,
            kv_bytes_per_token=self.runner.kv_bytes_per_token,
            weight_bytes=self._weight_bytes,
            preemptions=s.num_preemptions,
        )

    @property
    def model(self) -> torch.nn.Module:
        """The runtime model (slimlm.runtime.model.CausalLM), e.g. to swap its linears' weights in a benchmark."""
        return self.runner.model

    # ---- one step -------------------------------------------------------------------------------

    def step(self, detokenize: bool = True) -> list[RequestOutput]:
        """Run one batch; outputs of every request that produced a token or finished in it. Unfinished
        outputs carry their text so far only with `detokenize` (streaming); finished ones always do."""
        done, self._finished_outside_step = self._finished_outside_step, []
        batch = self.scheduler.schedule()
        for seq in batch.preempted:  # recomputed later, observation window and all
            self._windows.pop(seq.seq_id, None)
        if not batch.items:
            return done
        drafted = self._add_drafts(batch) if self.proposer is not None else {}
        # Logits are computed only for the rows that need them: a sampling row per sequence at the end of
        # its prompt or in decode, and the prompt positions whose log-probabilities were asked for.
        rows, prompt_rows, sample_row, offset = [], {}, {}, 0
        for item in batch.items:
            if id(item.seq) in drafted:  # the last token and its drafts: every position is scored
                sample_row[id(item)] = len(rows)
                rows += range(offset, offset + item.num_tokens)
                offset += item.num_tokens
                continue
            lo, hi = self._prompt_positions(item.seq, item.num_tokens)
            if lo < hi:
                prompt_rows[id(item)] = (len(rows), lo, hi)
                rows += range(offset + lo - item.seq.num_computed, offset + hi - item.seq.num_computed)
            if item.samples:
                sample_row[id(item)] = len(rows)
                rows.append(offset + item.num_tokens - 1)
            offset += item.num_tokens
        observed = self._observation_rows(batch)
        logits = self.runner.run(batch, rows, [r for span in observed.values() for r in span])  # rows or not: K/V
        self._keep_observed(batch, observed)
        now = time.perf_counter()
        touched: dict[str, None] = {}
        to_sample: list[tuple[Sequence, int]] = []
        for item in batch.items:
            if id(item.seq) in drafted:
                row = sample_row[id(item)]
                self._verify(item.seq, drafted[id(item.seq)], logits[row : row + item.num_tokens], now)
                if not item.seq.is_finished:
                    self._bound_history(item.seq)
                touched[item.seq.request_id] = None
                continue
            seq, samples = item.seq, item.samples  # `samples` reads num_computed: before it moves on
            seq.num_computed += item.num_tokens
            self.blocks.register_full_blocks(seq)
            if id(item) in prompt_rows:
                row, lo, hi = prompt_rows[id(item)]
                self._prompt_logprobs(seq, logits[row : row + hi - lo], lo, hi)
            if samples:
                self._bound_history(seq)  # before a fork: the children share what it keeps
                to_sample += [(s, sample_row[id(item)]) for s in self._fork_if_first(seq)]
        if to_sample:
            seqs = [s for s, _ in to_sample]
            picked = logits[torch.tensor([r for _, r in to_sample], device=logits.device)]
            result = sample(picked, [s.params for s in seqs], [s.generator for s in seqs])
            for i, seq in enumerate(seqs):
                self._append(seq, result.tokens[i], result.logprobs[i], result.top[i], now)
                touched[seq.request_id] = None
        for r in touched:
            finished = self._finished(r)
            done.append(self.outputs.output(self.requests[r], detokenize, finished))
            if finished:
                del self.requests[r]
        return done

    # ---- what a sequence keeps of its history (kv_policy.py) ------------------------------------------

    def _observation_rows(self, batch: Batch) -> dict[int, range]:
        """By item: the rows of this step holding a snapkv sequence's observation window (the queries of its
        prompt's last positions, before it evicted anything)."""
        rows, offset = {}, 0
        for item in batch.items:
            seq = item.seq
            first = seq.kv_policy.observed_from(seq.num_prompt_tokens) if not seq.num_evicted else None
            if first is not None:
                lo = max(seq.num_computed, first)
                hi = min(seq.num_computed + item.num_tokens, seq.num_prompt_tokens)
                if lo < hi:
                    rows[id(item)] = range(offset + lo - seq.num_computed, offset + hi - seq.num_computed)
            offset += item.num_tokens
        return rows

    def _keep_observed(self, batch: Batch, observed: dict[int, range]) -> None:
        at = 0
        for item in batch.items:
            if id(item) not in observed:
                continue
            n = len(observed[id(item)])
            got = [q[at : at + n] for q in self.runner.observed]
            before = self._windows.get(item.seq.seq_id)  # the window came in more than one prompt chunk
            if before is not None:
                got = [torch.cat(pair) for pair in zip(before, got, strict=True)]
            self._windows[item.seq.seq_id] = got
            at += n

    def _bound_history(self, seq: Sequence) -> None:
        """Evict what the sequence's policy does not keep, once its prompt is in: a window's oldest blocks after
        the sink; SnapKV's unselected prompt positions (the kept ones move to fresh blocks, once)."""
        policy, queries = seq.kv_policy, self._windows.get(seq.seq_id)
        if policy.kind == "window":
            n = window_eviction(policy.budget, seq.num_resident, self.config.block_size)
            if n:
                self.blocks.evict(seq, SINK_BLOCKS, n)
        elif queries is not None and len(queries[0]) == OBSERVATION:  # a snapkv prompt's whole window is in
            keep = self.runner.snapkv_keep(
                seq.block_table, seq.num_resident, seq.num_prompt_tokens, queries, policy.budget
            )
            tables = self.blocks.compact(seq, keep.shape[-1])
            if tables is not None:  # else the pool is short of blocks now: tried again at the next token
                self.runner.move_kv(*tables, keep)
                del self._windows[seq.seq_id]
        seq.kv_tokens = seq.num_resident  # what the next step reads, for the caller to see

    # ---- speculative decoding (speculative.py has the rule) ------------------------------------------

    def _add_drafts(self, batch: Batch) -> dict[int, Proposal]:
        """Drafts for the step's decoding sequences, scheduled with their last token from the budget the
        scheduler left: at most what the request may still emit, less the token verification always adds, and
        no more than its KV policy takes without evicting in between (so the output is plain decoding's)."""
        budget = self.scheduler.max_num_batched_tokens - sum(item.num_tokens for item in batch.items)
        items = [
            item
            for item in batch.items  # decoding: one token, the last (not a recomputation's chunk)
            if item.num_tokens == 1 and item.seq.output_ids and item.seq.num_computed == item.seq.num_tokens - 1
        ]
        if budget <= 0 or not items:
            return {}
        seqs = [item.seq for item in items]
        room = [
            s.kv_policy.drafts(
                s.num_resident, min(s.params.max_tokens - len(s.output_ids), self.max_model_len - s.num_tokens) - 1
            )
            for s in seqs
        ]
        drafted = {}
        for item, proposal in zip(items, self.proposer.propose(seqs, room), strict=True):
            k = min(len(proposal.tokens), budget)
            if k == 0 or not self.blocks.append(item.seq, 1 + k):  # no room in the pool: plain decode
                continue
            probs = None if proposal.probs is None else proposal.probs[:k]
            item.seq.token_ids += proposal.tokens[:k]
            item.num_tokens += k
            budget -= k
            drafted[id(item.seq)] = Proposal(proposal.tokens[:k], probs)
        batch.copies += self.blocks.pending_copies  # none expected: the block written next is already private
        self.blocks.pending_copies = []
        return drafted

    def _verify(self, seq: Sequence, proposal: Proposal, logits: torch.Tensor, now: float) -> None:
        """Accept or correct the drafts (logits [1 + k, V] at the last token and each draft), emit the
        tokens, and forget the rejected drafts' KV."""
        k = len(proposal.tokens)
        if seq.params.greedy:
            tokens, accepted = verify_greedy(logits, proposal.tokens)
        else:
            tokens, accepted = verify(distributions(logits, [seq.params] * (k + 1)), proposal, seq.generator)
        del seq.token_ids[-k:]
        seq.num_computed += k + 1
        self.blocks.release_last(seq, k - accepted)
        seq.num_drafted += k
        seq.num_accepted += accepted
        lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
        chosen = lp[torch.arange(len(tokens)), tokens].tolist()
        top = top_logprobs(lp, [seq.params.logprobs] * len(tokens))
        for i, token in enumerate(tokens):
            self._append(seq, token, chosen[i], top[i], now)
            if seq.is_finished:
                return
        self.blocks.register_full_blocks(seq)

    def _finished(self, request_id: str) -> bool:
        request = self.requests[request_id]
        return len(request.seqs) == request.params.n and all(s.is_finished for s in request.seqs)

    def _prompt_positions(self, seq: Sequence, num_tokens: int) -> tuple[int, int]:
        """Positions [lo, hi) of this chunk whose logits score a prompt token not scored yet (after a
        preemption the prompt is recomputed, but what was scored stays)."""
        if seq.params.prompt_logprobs is None:
            return 0, 0
        first_unscored = seq.params.prompt_logprobs_from - 1 + len(seq.prompt_logprobs)
        lo = max(seq.num_computed, first_unscored)
        hi = min(seq.num_computed + num_tokens, seq.num_prompt_tokens - 1)
        return lo, max(lo, hi)

    def _prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, lo: int, hi: int) -> None:
        targets = seq.token_ids[lo + 1 : hi + 1]
        k = seq.params.prompt_logprobs
        if k <= 1:  # evaluations' case (the target's, and whether it was the most likely): no log-softmax written
            chosen, best, best_ids = self.runner.model.row_logprobs(logits, torch.tensor(targets, device=logits.device))
            seq.prompt_logprobs += chosen.tolist()
            if k:
                seq.prompt_top_logprobs += [[pair] for pair in zip(best_ids.tolist(), best.tolist(), strict=True)]
            return
        lp = torch.log_softmax(logits.float(), dim=-1)
        seq.prompt_logprobs += lp[torch.arange(len(targets)), targets].tolist()
        seq.prompt_top_logprobs += top_logprobs(lp, [k] * len(targets))

    def _fork_if_first(self, seq: Sequence) -> list[Sequence]:
        """At the end of its prompt, a request with n > 1 splits into n sequences sharing the prompt's blocks."""
        request = self.requests[seq.request_id]
        if seq.params.n == 1 or seq.output_ids:  # forked already: every sequence has sampled since
            return [seq]
        children = [self._new_sequence(request, i, list(seq.token_ids)) for i in range(1, seq.params.n)]
        for child in children:
            self.scheduler.fork(seq, child)
        return [seq, *children]

    def _append(self, seq: Sequence, token: int, logprob: float, top, now: float) -> None:
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if top:
            seq.top_logprobs.append(top)
        seq.token_times.append(now)
        params = seq.params
        reason = None
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "stop"
        elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if params.stop and self.outputs.stop_string_hit(seq):
            reason = "stop"
        if reason:
            self._windows.pop(seq.seq_id, None)
            self.scheduler.finish(seq, reason)
