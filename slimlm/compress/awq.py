"""AWQ (Lin et al., 2023): protect the weights that meet large activations by scaling them up before
rounding, and fold the inverse scale into the op that produces those activations.

Per decoder layer, for each (previous op → linears that read its output) pair:
  s_x = mean |x| per input channel;  search α ∈ {0, 1/n, …, (n−1)/n} (n = 20, the paper's grid), s = s_x^α
  (normalised), for the α whose fake-quantized linears Q(W·s)/s give the smallest output error of the
  enclosing block on calibration data;
  then W ← W·s and the previous op's output ← /s, which leaves the float model's function unchanged.
After scaling, a clipping search shrinks each group's range where that lowers the output error.

AWQ is a transform: it leaves float weights that are easier to quantize, and the next step quantizes them
(`compress awq` = AWQ + RTN, the paper's method; `compress awq --then gptq` = AWQ + GPTQ).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slimlm import arch, devices
from slimlm.arch import Mapping
from slimlm.compress.pipeline import StepResult, cast_floats, in_dtype
from slimlm.compress.quantize import fake_quantize
from slimlm.errors import FieldError
from slimlm.formats.quantized import QuantArgs

GRID = 20
CLIP_GRID = 20
CLIP_MAX_SHRINK = 0.5
CLIP_TOKENS = 1024
# Every SAMPLE_STRIDE-th token of a batch goes to the clipping search's sample. Odd, so that it is coprime with
# any window length: a stride of 16 took position 0 of every window, whose massive activations (Qwen2.5's first
# token) then made 1 in 8 of the clipping sample instead of 1 in 512. On the 1.5B's first 4 layers (W4 g128,
# 128x512 tokens, 4 wiki windows through transformers): NLL increase over float 0.050 -> 0.022 nats, KL 0.105
# -> 0.103 (llm-compressor's AWQ: 0.018, 0.102).
SAMPLE_STRIDE = 17
CLIP_CHUNK_ELEMENTS = 64 * 1024 * 1024  # bounds the [rows, tokens, groups] products of the clipping search


def layer_mappings(layer: nn.Module) -> list[Mapping]:
    return arch.awq_mappings(gqa=layer.self_attn.v_proj.weight.shape != layer.self_attn.o_proj.weight.shape)


@torch.no_grad()
def fold_scales(layer: nn.Module, mapping: Mapping, s: torch.Tensor) -> None:
    """W ← W·diag(s) for the balanced linears and prev ← prev/s: the layer computes the same function."""
    prev = layer.get_submodule(mapping.prev)
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s[:, None].to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    else:  # RMSNorm: output = weight ⊙ normalised input
        prev.weight.div_(s.to(prev.weight.dtype))
    for name in mapping.linears:
        lin = layer.get_submodule(name)
        lin.weight.mul_(s[None, :].to(lin.weight.dtype))


@dataclass
class _Stats:
    abs_sum: torch.Tensor | None = None
    tokens: int = 0
    samples: list[torch.Tensor] = field(default_factory=list)  # a token subsample, for the clipping search

    def add(self, x: torch.Tensor, stride: int) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        a = x.abs().sum(0)
        self.abs_sum = a if self.abs_sum is None else self.abs_sum + a
        self.tokens += x.shape[0]
        self.samples.append(x[::stride].clone())

    def clip_sample(self) -> torch.Tensor:
        """CLIP_TOKENS of the sampled tokens, evenly spread over them."""
        x = torch.cat(self.samples)
        return x[torch.linspace(0, len(x) - 1, min(CLIP_TOKENS, len(x)), device=x.device).long()]


class AWQ:
    """The scale search and clipping; `args` is the quantization the search optimises for."""

    needs_data = True
    changes_layer = True
    float_target = 0.0  # the pipeline's float chain: not wanted (pipeline.Step)

    def __init__(
        self, args: QuantArgs, search_batches: int = 2, clip: bool = True, grid: int = GRID, search_dtype: str = "auto"
    ):
        if search_dtype not in devices.COMPUTE_DTYPES:
            raise FieldError("search_dtype", f"{search_dtype!r} is not one of {', '.join(devices.COMPUTE_DTYPES)}")
        if not (type(search_batches) is int and search_batches > 0):
            raise FieldError("search_batches", f"{search_batches!r} must be a positive integer (2 is the default)")
        if not (type(grid) is int and grid > 0):
            raise FieldError("grid", f"{grid!r} must be a positive integer ({GRID} is the default)")
        self.args, self.search_batches, self.clip, self.grid = args, search_batches, clip, grid
        self.schemes: dict[str, QuantArgs] = {}  # by full name; the search and clipping use each linear's own
        self.search_dtype = search_dtype
        self.stats: dict[str, _Stats] = {}
        self.block_inputs: dict[str, list[tuple[tuple, dict]]] = {}

    def arguments(self) -> dict[str, Any]:
        return {
            "search_batches": self.search_batches,
            "clip": self.clip,
            "grid": self.grid,
            "search_dtype": self.search_dtype,
        }

    def observe(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> list[Any]:
        self.stats = {}
        self.block_inputs = {}
        handles = []
        for local in {lin for m in layer_mappings(layer) for lin in m.linears}:
            stats = self.stats[local] = _Stats()
            mod = layer.get_submodule(local)
            handles.append(mod.register_forward_pre_hook(lambda _m, a, st=stats: st.add(a[0], stride=SAMPLE_STRIDE)))
        for m in layer_mappings(layer):
            store = self.block_inputs.setdefault(m.block, [])

            def keep(_mod, args, kwargs, store=store):
                if len(store) < self.search_batches:
                    store.append((args, kwargs))

            handles.append(layer.get_submodule(m.block).register_forward_pre_hook(keep, with_kwargs=True))
        return handles

    @torch.no_grad()
    def apply(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> StepResult:
        prefix = next(iter(linears)).rsplit(".", 2)[0] + "." if linears else ""
        local_to_full = {n[len(prefix) :]: n for n in linears}
        for m in layer_mappings(layer):
            if not all(lin in local_to_full for lin in m.linears):
                continue  # some of these linears are --ignore'd: leave the group alone
            s = self._search_scale(layer, m, self.schemes.get(local_to_full[m.linears[0]], self.args))
            fold_scales(layer, m, s)
            for lin in m.linears:  # the stored inputs now reach the linears divided by s
                self.stats[lin].samples = [x / s for x in self.stats[lin].samples]
        for local in local_to_full:
            weight = layer.get_submodule(local).weight
            if self.clip and local in self.stats and not local.endswith(("q_proj", "k_proj")):
                args = self.schemes.get(local_to_full[local], self.args)
                weight.data = self._clip(weight.data, self.stats[local].clip_sample(), args)
        self.stats, self.block_inputs = {}, {}
        return StepResult()

    def _block_output(self, block: nn.Module, inputs: list[tuple[tuple, dict]]) -> list[torch.Tensor]:
        outs = []
        for args, kwargs in inputs:
            y = block(*args, **kwargs)
            outs.append(y[0] if isinstance(y, tuple) else y)
        return outs

    def _dtype_for_search(self, weight: torch.Tensor) -> torch.dtype:
        """The search only ranks the α, so auto runs it in bf16 where that is fast; the fold, the clipping and
        the quantization stay in the layer's dtype."""
        return devices.compute_dtype(self.search_dtype, weight.dtype, weight.device)

    def _search_scale(self, layer: nn.Module, m: Mapping, args: QuantArgs) -> torch.Tensor:
        originals = [layer.get_submodule(n).weight.data.clone() for n in m.linears]
        dtype = self._dtype_for_search(originals[0])
        block = in_dtype(layer.get_submodule(m.block), dtype)
        mods = [block.get_submodule(n[len(m.block) + 1 :]) for n in m.linears]
        inputs = cast_floats(self.block_inputs[m.block], dtype)
        stats = self.stats[m.linears[0]]
        x_mean = stats.abs_sum / stats.tokens
        ref = self._block_output(block, inputs)
        best, best_s = float("inf"), torch.ones_like(x_mean)
        for i in range(self.grid):
            s = x_mean.pow(i / self.grid).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            for mod, w in zip(mods, originals, strict=True):
                scaled = w.float() * s[None, :]
                mod.weight.data = (fake_quantize(scaled, args) / s[None, :]).to(dtype)
            out = self._block_output(block, inputs)
            loss = sum(((o - r).float().pow(2).mean() for o, r in zip(out, ref, strict=True)), 0.0)
            if loss.item() < best:
                best, best_s = loss.item(), s
        for name, w in zip(m.linears, originals, strict=True):  # the layer's own weights, as they were
            layer.get_submodule(name).weight.data = w
        return best_s.to(originals[0].dtype)

    def _clip(self, w: torch.Tensor, x: torch.Tensor, args: QuantArgs) -> torch.Tensor:
        """Per group, the shrink of the weight range (1.0 … 0.5) that best preserves x·wᵀ within the group."""
        tokens, gs = x.shape[0], w.shape[1] if args.group_size == -1 else args.group_size
        xg = x.float().reshape(tokens, -1, gs)
        if gs < tokens:
            # mean_t (x_tg·d_og)² = d_og C_g d_ogᵀ with C_g the group's input covariance: out·in·gs products per
            # shrink in place of out·in·tokens (8× fewer at g128 over 1024 tokens), and no [out, tokens, groups]
            # intermediate (a Qwen2.5-1.5B layer's clipping took 60 s the other way on 2 AVX2 cores).
            cov = torch.einsum("tgk,tgl->gkl", xg, xg) / tokens

            def error(d: torch.Tensor) -> torch.Tensor:
                return (torch.einsum("ogk,gkl->ogl", d, cov) * d).sum(-1)

            rows = max(1, CLIP_CHUNK_ELEMENTS // w.shape[1])
        else:
            # Per-channel groups wider than the token sample: the products themselves, in the search dtype (they
            # only rank the shrinks); x·(ŵ − w)ᵀ rather than x·ŵᵀ − x·wᵀ, so bf16 has no cancellation to lose.
            xs = xg.to(self._dtype_for_search(w))

            def error(d: torch.Tensor) -> torch.Tensor:
                return torch.einsum("ogk,tgk->otg", d.to(xs.dtype), xs).float().pow(2).mean(dim=1)

            rows = max(1, CLIP_CHUNK_ELEMENTS // (tokens * w.shape[1]))
        return torch.cat([self._clip_rows(w[r : r + rows], gs, error, args) for r in range(0, w.shape[0], rows)])

    def _clip_rows(self, w: torch.Tensor, gs: int, error, args: QuantArgs) -> torch.Tensor:
        """`error(ŵ − w)`: the mean squared output error per row and group, [out, G], of grouped differences."""
        out_f, in_f = w.shape
        wg = w.float().reshape(out_f, -1, gs)  # [out, G, gs]
        amax = wg.abs().amax(dim=-1, keepdim=True)
        best_err = torch.full((out_f, wg.shape[1]), float("inf"), device=w.device)
        best_max = amax.clone()
        for i in range(int(CLIP_MAX_SHRINK * CLIP_GRID) + 1):
            cur = amax * (1 - i / CLIP_GRID)
            clipped = wg.clamp(-cur, cur).reshape(out_f, in_f)
            deq = fake_quantize(clipped, args).reshape(out_f, -1, gs)
            err = error(deq - wg)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better[..., None], cur, best_max)
        return wg.clamp(-best_max, best_max).reshape(out_f, in_f).to(w.dtype)
