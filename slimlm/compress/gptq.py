"""GPTQ (Frantar et al., 2022): quantize one column at a time and push each column's rounding error onto
the columns not yet quantized, weighted by the inverse Hessian of the layer's reconstruction loss.

For a linear layer with inputs X, the loss ||WX − ŴX||² has Hessian H = 2XXᵀ (one per layer, shared by all
output rows). With U the upper Cholesky factor of H⁻¹, quantizing column j with error e = (w_j − q_j)/U_jj
is compensated exactly by W[:, j:] −= e·U[j, j:]. Columns are processed in blocks of 128 so that the
update to the remaining columns is one matrix product per block ("lazy batch updates").

The float target (after GPTAQ, Li et al. 2025): the inputs X a layer sees in calibration carry the earlier
layers' error, while the float model's own inputs X̃ do not. Fitting ||W X̃ − Ŵ X||² instead of ||WX − ŴX||²
makes each layer undo some of what came before. Its least-squares solution is W* = W + G H⁻¹ with
G = 2/n Σ (W x̃ − W x)xᵀ, and ||W X̃ − Ŵ X||² = ||(W* − Ŵ)X||² + const, so GPTQ quantizes W* with the same H.
The whole step overfits the calibration tokens (SmolLM2-135M W4 g64, 32×512 tokens: wiki ppl 2,948 against
plain GPTQ's 38.8), so the step moves only a fraction α of the way: W + αG(H + λI)⁻¹.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from slimlm.compress.pipeline import StepResult
from slimlm.compress.quantize import OBSERVERS, compute_qparams
from slimlm.errors import FieldError, SlimlmError
from slimlm.formats.quantized import QuantArgs, QuantizedWeight, stored_scale
from slimlm.kernels import cpu_gram

BLOCK = 128
ACT_ORDERS = (None, "weight", "group")
# The float target α, the best measured: on SmolLM2-135M W4 g64 wiki ppl +18.2% against plain GPTQ's +32.6%
# (0.1: +23.6%, 0.5: +39.0%; benchmarks/results/gptq-float-target-*). The defaults here are the command's.
FLOAT_TARGET = 0.25


class HessianAccumulator:
    """Running H = 2/n · Σ xxᵀ over every calibration token a linear layer sees.

    Summed in fp32 whatever the activations' dtype: a bf16 product rounds every entry of H to 8 bits, which hurt
    (wiki ppl +1.3% on average, worse on each of three calibration seeds; see
    benchmarks/results/gptq-hessian-dtype-2026-12-02.md). H is symmetric, so a batch adds only the 16×16 tiles on
    and above the diagonal, and the rest is mirrored once when H is read:
    - bf16 activations on a CPU with AVX-512 BF16: cpu_gram.c, exact products on the bf16 dot-product unit, or on
      the AMX tile unit where there is one;
    - otherwise fp32 products, one per block row (eight of them: 56% of the full product's arithmetic).
    A Qwen2.5-1.5B down_proj's 8960² from 4096 bf16 tokens, same run on 2 EPYC cores: full fp32 product 3.3 s,
    block rows 1.9 s, cpu_gram 0.9 s; on one Sapphire Rapids core, cpu_gram 3.7 s on the dot-product unit and
    0.6 s on the tiles. The 2/n scale is applied to the sums, never to x, which stays exact."""

    def __init__(self, in_features: int, device: torch.device):
        self._H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self._block = max(384, -(-in_features // 8 // cpu_gram.TILE) * cpu_gram.TILE)  # whole tiles
        self._mirrored = True
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        n, d = x.shape
        self.tokens += n
        keep, scale = (self.tokens - n) / self.tokens, 2 / self.tokens
        if cpu_gram.applies(x):
            cpu_gram.add_gram(self._H, x, scale, keep)
        else:
            x = x.float()
            for i in range(0, d, self._block):
                rows = self._H[i : i + self._block, i:]
                rows.addmm_(x[:, i : i + self._block].T, x[:, i:], beta=keep, alpha=scale)
        self._mirrored = False

    @property
    def H(self) -> torch.Tensor:
        if not self._mirrored:
            t = cpu_gram.TILE
            for i in range(t, self._H.shape[0], t):
                self._H[i : i + t, :i] = self._H[:i, i : i + t].T
            self._mirrored = True
        return self._H


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    args: QuantArgs,
    damp: float = 0.01,
    act_order: str | None = None,
    name: str = "layer",
    observer: str = "minmax",
    shift: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Quantize W [out, in] given its Hessian H [in, in]. Returns codes and qparams in W's column order.

    act_order: None (columns left to right), "weight" (columns by decreasing Hessian diagonal, groups and
    their qparams fixed up front in the original column order: the checkpoint looks like plain GPTQ) or
    "group" (groups formed in processing order: more accurate, needs a g_idx to read back).
    observer: how each group's qparams are chosen (quantize.compute_qparams).
    shift [out, in]: quantize W + shift·(H + λI)⁻¹ instead (the float target's G, times α).
    """
    if act_order not in ACT_ORDERS:
        raise FieldError("act_order", f"{act_order} is not supported; use one of {', '.join(ACT_ORDERS[1:])}")
    W = W.detach().clone().float()
    out_features, in_features = W.shape
    gs = in_features if args.group_size == -1 else args.group_size
    if not torch.isfinite(W).all() or not torch.isfinite(H).all():
        raise SlimlmError(f"non-finite values (NaN/Inf) in the weights or calibration activations of {name}")

    # Inputs that were always zero carry no information: fix their weights to 0, and H (its copy) takes a 1 there.
    diag = torch.diag(H).float()
    W[:, diag == 0] = 0
    diag[diag == 0] = 1

    perm = torch.argsort(diag, descending=True) if act_order else torch.arange(in_features, device=W.device)
    U = _inverse_hessian_factor(H, perm, damp, name)
    if shift is not None:
        # The float model's outputs as the target: W + G(H + λI)⁻¹ is the least-squares map from the inputs
        # this layer sees to the outputs the float model's layer gives on its own inputs.
        Wp = W[:, perm]
        Wp += (shift.float()[:, perm] @ U.T) @ U
        W[:, perm] = Wp  # a dead input's column stays 0: H⁻¹ does not couple it, and its G column is 0
    # Static qparams come from the original weights, decided before any error is propagated; otherwise
    # each group's qparams come from its (already updated) columns when the group is reached.
    static = compute_qparams(W, args, observer, diag) if act_order == "weight" or args.group_size == -1 else None

    W = W[:, perm]
    # Group of each column in processing order: by original position for static groups, by processing
    # position otherwise (act-order then needs g_idx to say which group each original column fell in).
    group_of = perm // gs if static is not None else torch.arange(in_features, device=W.device) // gs

    n_groups = args.groups(in_features)
    scale = torch.zeros(out_features, n_groups, dtype=W.dtype, device=W.device)
    zero = None if args.sym else torch.zeros(out_features, n_groups, dtype=torch.int8, device=W.device)
    if static is not None:
        scale, zero = static[0].clone(), None if static[1] is None else static[1].clone()
    codes = _quantize_columns(
        W, U, group_of.tolist(), args, scale, zero, observer if static is None else None, diag[perm]
    )

    inv = torch.argsort(perm)
    g_idx = group_of[inv].to(torch.int32) if act_order == "group" and static is None else None
    result = QuantizedWeight(codes[inv].T.contiguous(), scale, zero, args, g_idx)
    if not torch.isfinite(result.dequantize()).all():
        raise FieldError("damp", f"GPTQ produced non-finite weights for {name}; try a larger {{damp}}")
    return result


def _quantize_columns(
    W: torch.Tensor,
    U: torch.Tensor,
    group_list: list[int],
    args: QuantArgs,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    observer: str | None,
    importance: torch.Tensor,
) -> torch.Tensor:
    """GPTQ's column loop over W [out, in] (columns in processing order), U the upper Cholesky factor of the
    inverse Hessian: each column rounded, its error spread over the columns after it, 128 columns per block.
    `observer`: each group's qparams are set (in scale, zero) from its columns when the group is reached, by
    that observer, weighing each column's error by its `importance` (H's diagonal, in processing order);
    None: they are given (static).
    Returns the codes [in, out]; W is updated in place."""
    # The block's columns are worked on as rows ([columns, out]): each column GPTQ reads, rounds and updates
    # is contiguous, and so is each column of codes written.
    in_features, out_features = W.shape[1], W.shape[0]
    gs = in_features if args.group_size == -1 else args.group_size
    codes = torch.zeros(in_features, out_features, dtype=torch.int8, device=W.device)
    for i1 in range(0, in_features, BLOCK):
        i2 = min(i1 + BLOCK, in_features)
        W1 = W[:, i1:i2].T.contiguous()
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        diag = U1.diagonal().tolist()
        for i in range(i2 - i1):
            j = i1 + i
            g = group_list[j]
            if observer and j % gs == 0:
                # A group never straddles blocks (128 is a multiple of every group size); W1 holds its
                # columns with all the error compensation applied so far.
                part = QuantArgs(args.bits, -1, args.sym)
                s, z = compute_qparams(W1[i : i + gs].T, part, observer, importance[j : j + gs])
                scale[:, g] = s[:, 0]
                if zero is not None:
                    zero[:, g] = z[:, 0]
            if j == 0 or g != group_list[j - 1]:  # static qparams never change; dynamic ones were just set
                sg = scale[:, g].contiguous()  # the qparams of the column's group, read once per group
                zg = None if zero is None else zero[:, g].float()
            w = W1[i]
            c = torch.round(w / sg)
            if zg is not None:
                c += zg
            c.clamp_(args.qmin, args.qmax)
            codes[j] = c
            q = (c if zg is None else c - zg) * sg
            err = (w - q) / diag[i]
            W1[i:] -= U1[i, i:, None] * err[None, :]
            E1[i] = err
        W[:, i2:] -= E1.T @ U[i1:i2, i2:]
    return codes


def _inverse_hessian_factor(H: torch.Tensor, order: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """Upper triangular U with UᵀU = (H' + λI)⁻¹ for H' = H[order][:, order] (a zero on its diagonal taken as 1),
    raising λ if H' is not positive definite.

    With H' = RRᵀ and R upper triangular (the Cholesky factor of H' with its rows and columns reversed,
    reversed), U = R⁻¹: one factorization and one triangular inverse. Factoring H', inverting it and factoring
    the inverse costs half as much again (at n = 8960, a Qwen2.5-1.5B down_proj: 5.9 s against 8.6 s on 2 AVX2
    cores). H is the largest thing GPTQ holds (that down_proj's: 321 MB), so its copies set a job's peak
    memory: H' is gathered reversed in one copy and damped in place, and each copy goes as soon as the next is
    made (GPTQ on that down_proj: 2.0 → 1.0 GB over the start, 6.3 → 3.2 times H, results bit for bit)."""
    back = order.flip(0)
    reversed_h = H[back[:, None], back].float()
    diag = reversed_h.diagonal()
    diag[diag == 0] = 1
    mean_diag = diag.flip(0).mean().item()  # summed in H' order: the same λ to the last bit whichever way H' lies
    added = 0.0
    for attempt in range(6):
        lam = damp * (10**attempt) * mean_diag
        diag.add_(lam - added)
        added = lam
        L, info = torch.linalg.cholesky_ex(reversed_h)
        # A positive semi-definite H gives pivots² ≥ λ; smaller ones mean H is indefinite or singular and
        # rounding let the factorization through.
        if info == 0 and L.diagonal().min().item() ** 2 >= lam / 2:
            if attempt:
                message = f"{name}: Hessian not positive definite; used damping {damp * 10**attempt:g}"
                warnings.warn(message, stacklevel=2)
            del reversed_h, diag
            R = L.flip(0, 1)
            del L
            return _upper_triangular_inverse(R)
    raise SlimlmError(f"{name}: the Hessian stays singular even with damping {damp * 10**5:g}; check the data")


def _upper_triangular_inverse(R: torch.Tensor) -> torch.Tensor:
    """R⁻¹ by halves, [[A, B], [0, D]]⁻¹ = [[A⁻¹, −A⁻¹BD⁻¹], [0, D⁻¹]]: the work is matrix products, which run
    at the machine's matmul rate, where a triangular solve against the identity runs at two thirds of it."""
    n = R.shape[0]
    if n <= 256:
        return torch.linalg.solve_triangular(R, torch.eye(n, dtype=R.dtype, device=R.device), upper=True)
    h = n // 2
    A, D = _upper_triangular_inverse(R[:h, :h]), _upper_triangular_inverse(R[h:, h:])
    out = torch.zeros_like(R)
    out[:h, :h], out[h:, h:] = A, D
    out[:h, h:] = -(A @ R[:h, h:]) @ D
    return out


class GPTQ:
    needs_data = True
    changes_layer = True

    def __init__(
        self,
        args: QuantArgs,
        damp: float = 0.01,
        act_order: str | None = "weight",
        observer: str = "minmax",
        float_target: float = FLOAT_TARGET,
    ):
        if not 0 < damp < 1:
            raise FieldError("damp", f"{damp} must be in (0, 1); 0.01 is the usual value")
        if act_order not in ACT_ORDERS:
            raise FieldError("act_order", f"{act_order} is not supported; use one of {', '.join(ACT_ORDERS[1:])}")
        if not 0 <= float_target <= 1:
            raise FieldError("float_target", f"{float_target} must be in [0, 1] (0: plain GPTQ)")
        if observer not in OBSERVERS:
            raise FieldError("observer", f"{observer} is not supported; use one of {', '.join(OBSERVERS)}")
        self.args, self.damp, self.act_order, self.observer = args, damp, act_order, observer
        self.float_target = float_target
        self.schemes: dict[str, QuantArgs] = {}
        self.reference = False  # set by the pipeline while the float model's inputs go through the layer
        self.hessians: dict[str, HessianAccumulator] = {}
        self._sums: dict[str, torch.Tensor] = {}  # the float target's, by linear (see _shift_hook)
        self._float: dict[str, torch.Tensor] = {}  # a batch's reference input or output, until its twin comes
        self._wide: set[str] = set()  # linears whose sum is over inputs
        self._last: dict[str, Any] = {"x": None, "name": None}
        self.warned = False

    def arguments(self) -> dict[str, Any]:
        return {
            "damp": self.damp,
            "act_order": self.act_order,
            "observer": self.observer,
            "float_target": self.float_target,
        }

    def observe(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> list[Any]:
        # Linears fed the very same tensor (q/k/v, gate/up) share one Hessian: it is computed once.
        self.hessians, shared = {}, set()
        last = self._last = {"x": None, "name": None}

        def make_hook(name: str, m: nn.Linear):
            def hook(_m, a):
                x = a[0]
                if self.reference or name in shared:
                    return
                if name not in self.hessians:
                    if x is last["x"]:
                        self.hessians[name] = self.hessians[last["name"]]
                        shared.add(name)
                        return
                    self.hessians[name] = HessianAccumulator(m.in_features, m.weight.device)
                self.hessians[name].add(x)
                last.update(x=x, name=name)

            return hook

        handles = [m.register_forward_pre_hook(make_hook(n, m)) for n, m in linears.items()]
        if self.float_target:
            self._sums, self._float, self._wide = {}, {}, set()
            last_wide: dict[str, Any] = {"x": None, "name": None}
            handles += [m.register_forward_hook(self._shift_hook(n, last_wide)) for n, m in linears.items()]
        return handles

    def _shift_hook(self, name: str, last_wide: dict[str, Any]):
        """Sums Σ(ỹ − y)xᵀ over the tokens, ỹ this linear's output on the float model's inputs, y its output
        on the compressed layers' (G is that sum times 2/n). For a linear wider than its input (gate/up) it
        sums Σ(x̃ − x)xᵀ instead, shared with the linears reading the same x, and G = W·that: the 1.5B's
        gate/up pair then costs 1536² products a token, not 17,920 × 1536."""

        def hook(m: nn.Linear, a: tuple, y: torch.Tensor) -> None:
            x, wide = a[0], m.out_features > m.in_features
            if self.reference:
                self._float[name] = x if wide else y
                return
            ours = self._float.pop(name)
            if wide:
                if x is last_wide["x"]:  # a linear before read this very x (gate before up): one sum for both
                    self._sums.setdefault(name, self._sums[last_wide["name"]])
                    self._wide.add(name)
                    return
                last_wide.update(x=x, name=name)
                self._wide.add(name)
            d = (ours - x if wide else ours - y).reshape(-1, (x if wide else y).shape[-1])
            prod = (d.T @ x.reshape(-1, x.shape[-1])).float()
            if name in self._sums:
                self._sums[name].add_(prod)
            else:
                self._sums[name] = prod

        return hook

    def _shift(self, name: str, m: nn.Linear) -> torch.Tensor:
        """α·G for one linear, from its sum (see _shift_hook)."""
        total = self._sums.pop(name)
        if name in self._wide:
            total = m.weight.float() @ total
        return total.mul_(self.float_target * 2 / self.hessians[name].tokens)

    def apply(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> StepResult:
        self._last["x"] = None  # the float pass is over: stop holding its last activation
        # Linears that share a Hessian (q/k/v, gate/up) are quantized as one stacked matrix: GPTQ treats
        # every output row on its own given H, so the codes are the same and the column loop runs once.
        sharing: dict[int, list[str]] = {}
        for name in linears:
            sharing.setdefault(id(self.hessians[name]), []).append(name)
        out = {}
        for names in sharing.values():
            acc, mods = self.hessians[names[0]], [linears[n] for n in names]
            if acc.tokens < mods[0].in_features and not self.warned:
                warnings.warn(
                    f"GPTQ: {acc.tokens} calibration tokens for {mods[0].in_features} input features: the Hessian "
                    "is rank-deficient and error compensation is unreliable; use more --num-samples or --seq-len",
                    stacklevel=2,
                )
                self.warned = True
            for name, m in zip(names, mods, strict=True):
                if not torch.isfinite(m.weight).all():
                    raise SlimlmError(f"non-finite values (NaN/Inf) in the weights of {name}")
            W = torch.cat([m.weight.data for m in mods])
            shift = (
                torch.cat([self._shift(n, m) for n, m in zip(names, mods, strict=True)]) if self.float_target else None
            )
            args = self.schemes.get(names[0], self.args)  # linears sharing an input share a scheme (budget.UNITS)
            q = gptq_quantize(W, acc.H, args, self.damp, self.act_order, ", ".join(names), self.observer, shift)
            parts = _split_rows(q, [m.out_features for m in mods])
            for name, m, part in zip(names, mods, parts, strict=True):
                part.scale = stored_scale(part.scale, m.weight.dtype)
                out[name] = part
        self.hessians = {}
        return StepResult(quantized={name: out[name] for name in linears})


def _split_rows(q: QuantizedWeight, sizes: list[int]) -> list[QuantizedWeight]:
    """The stacked result cut back into each linear's rows, each in storage of its own (safetensors refuses
    tensors that share memory)."""
    zeros = [None] * len(sizes) if q.zero is None else [z.clone() for z in q.zero.split(sizes)]
    return [
        QuantizedWeight(c.clone(), s.clone(), z, q.args, None if q.g_idx is None else q.g_idx.clone())
        for c, s, z in zip(q.codes.split(sizes), q.scale.split(sizes), zeros, strict=True)
    ]
