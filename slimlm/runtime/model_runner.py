"""Owns the model and the KV cache pool; turns a scheduled Batch into tensors and runs one forward pass."""

from __future__ import annotations

from pathlib import Path

import torch

from slimlm import kernels
from slimlm.devices import available_memory
from slimlm.errors import SlimlmError
from slimlm.formats import kv_int4
from slimlm.runtime import kv_policy
from slimlm.runtime.loader import load_model
from slimlm.runtime.model import StepInputs
from slimlm.runtime.scheduler import Batch

# Activation dtypes by name. auto: bf16 where bf16 products are fast (AVX-512 BF16, AMX, GPUs), fp32 elsewhere
# (devices.fast_dtype). On an AVX-512 BF16 CPU the W4 kernel computes an fp32 row as three bf16 rows (exact), so
# fp32 activations cost ~3x the products of bf16 ones: prefill, batches and speculative verification all pay it.
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The caches whose keys lose their mean before rounding: a 4-bit one (formats.kv_int4), and fp8, whose rounding
# error is relative, so a key channel at 350 (Qwen2's key biases) loses up to ±11 of it; less its mean, the same
# channel is ±1 and loses ±0.03. No softmax sees the mean: q·(k − μ) = q·k − q·μ shifts all keys of a query
# alike. int8's error is absolute (the scale's step), which centering would not change.
CENTERED_KEYS = (torch.uint8, torch.float8_e4m3fn)

# What the key offsets are measured on at load (set_key_offsets): any ordinary text does, since the
# offsets only need the part of each key channel that barely moves from token to token (a bias, in Qwen2 ±350
# with ±1 around it). Measured on Qwen2.5-Coder-1.5B: wiki perplexity +1.30% over a float cache with these ~190
# tokens, +1.67% for the simulated cache with means over 8,192 tokens of owt. Fixed: every load gets the same.
KEY_OFFSET_TEXT = (
    "The river rises in the hills north of the town and runs south through farmland for about forty miles "
    "before it reaches the sea. In the nineteenth century its banks were lined with mills, and the town grew "
    "around them; most were closed by 1950, and several now house a museum, a school and small workshops. "
    "The climate is mild, with wet winters and dry summers. The economy today rests on agriculture, tourism "
    "and a university founded in 1962, whose library holds one of the largest collections of maps in the "
    "country. def mean(values):\n    return sum(values) / len(values)\n\nprint(mean([3, 1, 4, 1, 5]))\n"
    "Visitors arrive by train from the capital, a journey of two hours, or by the coastal road. Each spring "
    "the town holds a festival of music and film that draws thousands of people to its streets and squares."
)


def step_inputs(batch: Batch, block_size: int, device: torch.device | str) -> tuple[torch.Tensor, StepInputs]:
    """The token ids and the packed varlen inputs of a scheduled batch: each item's tokens from its first
    uncomputed one, their positions and KV slots, and every sequence's block table (padded)."""
    ids, positions, slots, seq_lens, query_start = [], [], [], [], [0]
    for item in batch.items:
        seq, start = item.seq, item.seq.num_computed
        end = start + item.num_tokens
        ids += seq.token_ids[start:end]
        positions += range(start, end)  # a token's own position (its RoPE), whatever was evicted before it
        first, table = seq.num_resident, seq.block_table  # the new tokens' places among the resident ones
        slots += [table[r // block_size] * block_size + r % block_size for r in range(first, first + item.num_tokens)]
        seq_lens.append(first + item.num_tokens)
        query_start.append(query_start[-1] + item.num_tokens)
    width = max(len(item.seq.block_table) for item in batch.items)
    tables = [item.seq.block_table + [0] * (width - len(item.seq.block_table)) for item in batch.items]

    def tensor(values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    step = StepInputs(
        positions=tensor(positions, torch.int64),
        slots=tensor(slots, torch.int64),
        block_tables=tensor(tables, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        query_start=tensor(query_start, torch.int32),
        query_lens=[item.num_tokens for item in batch.items],
    )
    return tensor(ids, torch.int64), step


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        device: str,
        kv_cache_bytes: int,
        block_size: int,
        max_len: int,
        kv_cache_dtype: str = "auto",
        exact: bool = False,
    ) -> None:
        self.device = device
        self.exact = exact  # every step with exact activations (EngineConfig.activations)
        self.block_size = block_size
        self.model = load_model(model_dir, dtype, device, max_len, kv_cache_dtype)
        attn = self.model.model.layers[0].self_attn
        layers = len(self.model.model.layers)
        kv_dtype = self.model.kv_cache_dtype
        row = kv_int4.row_bytes(attn.head_dim) if kv_dtype == torch.uint8 else attn.head_dim  # a token's K of a head
        per_block = layers * 2 * block_size * attn.kv_heads * row * kv_dtype.itemsize
        self.num_blocks = kv_cache_bytes // per_block
        if self.num_blocks == 0:
            raise SlimlmError(
                f"a KV cache pool of {kv_cache_bytes} bytes holds less than one block ({per_block} "
                f"bytes, {block_size} tokens); give it at least {per_block} bytes "
                "(--kv-cache-memory)"
            )
        # one preallocated pool: [layer, K/V, block, offset, kv_head, head_dim (a 4-bit cache: row bytes)]
        shape = (layers, 2, self.num_blocks, block_size, attn.kv_heads, row)
        pool = self.num_blocks * per_block
        available = available_memory(device)
        if pool > available:
            raise SlimlmError(
                f"a KV cache pool of {pool / 2**30:.2f} GiB does not fit in the "
                f"{available / 2**30:.2f} GiB free on {device}; lower --kv-cache-memory"
            )
        self.kv_cache = torch.empty(shape, dtype=kv_dtype, device=device)
        self.observed: list[torch.Tensor] = []  # the last run's observed queries, per layer (run's `observe`)

    def set_key_offsets(self, ids: list[int], stored: list[torch.Tensor] | None = None) -> None:
        """Give each attention layer its key offsets (for a cache of CENTERED_KEYS): `stored` ([kv_heads,
        head_dim] per layer, compress kv's calibrated ones) when given, else the mean key (after RoPE) per KV
        head and channel over `ids`."""
        offsets = self._mean_keys(ids) if stored is None else stored
        for layer, offset in zip(self.model.model.layers, offsets, strict=True):
            layer.self_attn.k_offset = offset.to(self.device)

    @torch.inference_mode()
    def _mean_keys(self, ids: list[int]) -> torch.Tensor:
        """Each layer's mean key over `ids` [layers, kv_heads, head_dim], run once through a scratch float cache."""
        attns = [layer.self_attn for layer in self.model.model.layers]
        n, bs, dtype = len(ids), self.block_size, self.model.model.norm.weight.dtype
        blocks = -(-n // bs)
        scratch = torch.zeros(
            (len(attns), 2, blocks, bs, attns[0].kv_heads, attns[0].head_dim), dtype=dtype, device=self.device
        )
        step = StepInputs(
            positions=torch.arange(n, device=self.device),
            slots=torch.arange(n, device=self.device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None],
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            query_start=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            query_lens=[n],
        )
        scales = [(attn.k_scale, attn.v_scale) for attn in attns]
        for attn in attns:  # the scratch cache holds keys as they are, not divided by an 8-bit cache's scales
            attn.k_scale = attn.v_scale = None
        self.model(torch.tensor(ids, device=self.device), step, scratch)
        for attn, (k_scale, v_scale) in zip(attns, scales, strict=True):
            attn.k_scale, attn.v_scale = k_scale, v_scale
        return scratch[:, 0].flatten(1, 2)[:, :n].float().mean(1)

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads (the embedding table is gathered from, not read)."""
        dense = sum(p.numel() * p.element_size() for n, p in self.model.named_parameters() if "embed_tokens" not in n)
        return dense + sum(m.packed.nbytes() for m in self.model.modules() if getattr(m, "packed", None) is not None)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_cache[:, :, 0, 0].numel() * self.kv_cache.element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def inputs(self, batch: Batch) -> tuple[torch.Tensor, StepInputs]:
        return step_inputs(batch, self.block_size, self.device)

    def cached_keys(self, layer: int, block_table: list[int], length: int) -> torch.Tensor:
        """A sequence's first `length` resident keys in one layer, [length, kv_heads, D], as the cache holds them."""
        attn = self.model.model.layers[layer].self_attn
        table = torch.tensor(block_table, dtype=torch.int32, device=self.device)
        return kernels.reference.cached_kv(self.kv_cache[layer, 0], attn.k_scale, table, length, torch.float32)

    @torch.inference_mode()
    def snapkv_keep(self, block_table: list[int], length: int, prompt_len: int, queries, budget: int) -> torch.Tensor:
        """The positions each layer and KV head keeps of a sequence's `length` resident tokens, int64
        [layers, kv_heads, n] (kv_policy.snapkv_keep); queries: per layer, the prompt's last ones."""
        scale = self.model.model.layers[0].self_attn.scale
        return torch.stack(
            [
                kv_policy.snapkv_keep(q, self.cached_keys(layer, block_table, length), prompt_len, scale, budget)
                for layer, q in enumerate(queries)
            ]
        )

    @torch.inference_mode()
    def move_kv(self, old_table: list[int], new_table: list[int], keep: torch.Tensor) -> None:
        """Copy each layer and KV head's kept tokens (keep [layers, kv_heads, n]: positions in the old blocks)
        to positions 0..n-1 of the new blocks; K and V alike, as the cache stores them (bytes, scales and all)."""
        layers, _, blocks, size, kv_heads, row = self.kv_cache.shape
        pool = self.kv_cache.view(layers, 2, blocks * size, kv_heads, row)
        old = torch.tensor(old_table, device=self.device)
        new = torch.tensor(new_table, device=self.device)
        keep = keep.to(self.device)
        src = old[keep // size] * size + keep % size  # [layers, kv_heads, n]
        n = keep.shape[-1]
        dst = new[torch.arange(n, device=self.device) // size] * size + torch.arange(n, device=self.device) % size
        heads = torch.arange(kv_heads, device=self.device)[:, None]
        for layer in range(layers):
            pool[layer][:, dst.expand(kv_heads, n), heads] = pool[layer][:, src[layer], heads]

    @torch.inference_mode()
    def run(self, batch: Batch, logit_rows: list[int], observe: list[int] | None = None) -> torch.Tensor:
        """Forward pass over the batch; logits [len(logit_rows), vocab] in the model's dtype for the requested
        token rows (whoever reads them converts its own rows to fp32). A step with prompt tokens of a sequence
        that scores its prompt (prompt_logprobs: eval, echo) runs with exact activations, logits included, so
        those log-probabilities are transformers' on every CPU (kernels.exact_activations); every other step,
        prompts included, takes the kernels' fastest loop (on AVX2 x quantized to int8, as llama.cpp's prompt
        processing does too), unless the engine asked for exact activations everywhere. The queries of the
        `observe` rows are kept, per layer, in self.observed (a snapkv sequence's observation window)."""
        self.copy_blocks(batch.copies)
        ids, step = self.inputs(batch)
        if observe:
            step.observe = torch.tensor(observe, dtype=torch.long, device=self.device)
        scored = any(i.seq.scores_prompt and i.seq.num_computed < i.seq.num_prompt_tokens for i in batch.items)
        with kernels.exact_activations(scored or self.exact):
            hidden = self.model(ids, step, self.kv_cache)
            self.observed = step.observed  # per layer, the queries of the `observe` rows
            return self.model.logits(hidden[torch.tensor(logit_rows, dtype=torch.long, device=self.device)])
