"""The offline part: prefill and decode steps timed on the engine's model runner, every sequence resident in
the KV cache at the bench's context, the inputs built by the runner itself."""

from __future__ import annotations

import statistics
import time

import torch

from slimlm import kernels
from slimlm.errors import FieldError
from slimlm.perf.config import BenchConfig, engine_for, pool_bytes
from slimlm.perf.load import peak_reset, status
from slimlm.runtime.model import StepInputs
from slimlm.runtime.model_runner import step_inputs
from slimlm.runtime.sampling import SamplingParams
from slimlm.runtime.scheduler import Batch, ScheduledSeq
from slimlm.runtime.sequence import Sequence


def resident_batch(
    batch: int, context: int, block_size: int, new_tokens: int = 1, vocab: int = 100, seed: int = 0
) -> Batch:
    """`batch` sequences, each with `context` tokens already in the cache (in its own consecutive blocks) and
    `new_tokens` random ones to compute: the batch a decode step (or a prompt chunk) is scheduled as."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-(context + new_tokens) // block_size)
    items = []
    for b in range(batch):
        ids = torch.randint(0, vocab, (context + new_tokens,), generator=g).tolist()
        seq = Sequence(
            b,
            f"bench-{b}",
            ids,
            len(ids),
            SamplingParams(),
            g,
            num_computed=context,
            block_table=list(range(b * per_seq, (b + 1) * per_seq)),
        )
        items.append(ScheduledSeq(seq, new_tokens))
    return Batch(items)


def decode_inputs(
    batch: int,
    context: int,
    block_size: int,
    new_tokens: int = 1,
    vocab: int = 100,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, StepInputs]:
    """The token ids and step inputs of resident_batch(...), as the model runner builds them."""
    return step_inputs(resident_batch(batch, context, block_size, new_tokens, vocab, seed), block_size, device)


@torch.inference_mode()
def offline(model: str, config: BenchConfig, bandwidth: float) -> dict:
    """Prefill, decode steps at each batch size against the bandwidth floor, and memory, for one model."""
    before = peak_reset()
    engine = engine_for(model, config, max(config.context + 1, config.prefill_len))
    runner = engine.runner
    bs = engine.config.block_size
    largest = max(config.batch)
    if runner.num_blocks < largest * -(-(config.context + 1) // bs):
        raise FieldError(
            "kv_cache_memory",
            f"the KV pool ({pool_bytes(model, config) >> 20} MiB) cannot hold batch {largest} at context "
            f"{config.context}; raise {{kv_cache_memory}} or lower {{batch}}",
        )
    cache = runner.kv_cache
    if cache.dtype.itemsize == 1:  # random finite bytes: fp8 codes below its NaN pattern, int8 anything
        cache.view(torch.uint8).random_(0, 120)
    else:
        cache.normal_()
    vocab = runner.model.config.vocab_size
    cuda = str(runner.device).startswith("cuda")

    def forward(batch: int, context: int, new: int) -> float:
        ids, step = decode_inputs(batch, context, bs, new, vocab, runner.device)
        start = time.perf_counter()
        with kernels.exact_activations(runner.exact):  # as ModelRunner.run multiplies an unscored step
            hidden = runner.model(ids, step, cache)
            runner.model.logits(hidden[step.query_start[1:].long() - 1])
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    forward(1, 0, config.prefill_len)  # warm-up: first calls at a shape pay one-time costs
    prefill_s = min(forward(1, 0, config.prefill_len) for _ in range(2))
    weights, per_token = runner.weight_bytes(), runner.kv_bytes_per_token
    decode = []
    for batch in config.batch:
        forward(batch, config.context, 1)
        step_s = statistics.median(forward(batch, config.context, 1) for _ in range(config.steps))
        floor = (weights + batch * config.context * per_token) / bandwidth
        decode.append(
            {
                "batch": batch,
                "step_ms": 1e3 * step_s,
                "tok_s": batch / step_s,
                "floor_ms": 1e3 * floor,
                "floor_ratio": step_s / floor,
            }
        )
    result = {
        "arithmetic": engine.arithmetic(),
        "prefill_tok_s": config.prefill_len / prefill_s,
        "decode": decode,
        "weight_bytes": weights,
        "kv_bytes_per_token": per_token,
        "max_batch": runner.num_blocks * bs // config.context,
        "peak_rss_bytes": max(0, status("VmHWM") - before) or None,
    }
    return result
