"""compressed-tensors `pack-quantized`: the layout vLLM and transformers' compressed-tensors loader expect.

Per quantized linear `name`:
    name.weight_packed      int32 [out, ceil(in·b/32)]  codes + 2^(b−1), a dense little-endian bit stream per row
    name.weight_scale       float [out, groups]
    name.weight_zero_point  int32 [ceil(out·b/32), groups]  asymmetric only; packed the same way along dim 0
    name.weight_shape       int64 [2]
    name.weight_g_idx       int32 [in]  act-order only
KV-cache scales, when present, are `k_scale`/`v_scale` tensors per attention module, described by the
config's `kv_cache_scheme` (formats/kv_cache.py); a checkpoint that quantizes only its KV cache has no
config groups and format "dense".
"""

from __future__ import annotations

import torch

from slimlm.errors import SlimlmError
from slimlm.formats.packing import pack_int32, packed_words, unpack_int32
from slimlm.formats.quantized import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, QuantArgs, QuantizedWeight

MARKER = "weight_packed"  # the tensor suffix that marks a quantized linear
KEYS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def quantization_config(
    args: QuantArgs | None,
    ignore: list[str],
    act_order: str | None = None,
    kv_cache_scheme: dict | None = None,
    named: dict[str, QuantArgs] | None = None,
    layers: dict[str, QuantArgs] | None = None,
) -> dict:
    """`args` None: float weights, only the KV cache quantized (format "dense", no config groups). `named`:
    modules with a scheme of their own rounded to nearest (an 8-bit lm_head); `layers`: linears the method
    quantized at another scheme than `args` (with its act-order). Each scheme is a group that targets its
    modules by their exact names, which compressed-tensors and vLLM both prefer over the "Linear" class target
    of the others."""
    groups = {}
    if args is not None:
        groups["group_0"] = _group(["Linear"], args, act_order)
        by_scheme: dict[tuple[QuantArgs, str | None], list[str]] = {}
        for names, order in ((layers or {}, act_order), (named or {}, None)):
            for name, own in sorted(names.items()):
                by_scheme.setdefault((own, order), []).append(name)
        for i, ((own, order), targets) in enumerate(by_scheme.items(), start=1):
            groups[f"group_{i}"] = _group(targets, own, order)
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized" if groups else "dense",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore if groups else [],
        "kv_cache_scheme": kv_cache_scheme,
    }


def _group(targets: list[str], args: QuantArgs, act_order: str | None) -> dict:
    weights = {
        "num_bits": args.bits,
        "type": "int",
        "symmetric": args.sym,
        "group_size": None if args.group_size == -1 else args.group_size,
        "strategy": "channel" if args.group_size == -1 else "group",
        "dynamic": False,
        "actorder": act_order,
        "observer": "minmax",
    }
    return {
        "targets": targets,
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
        "format": "pack-quantized",
    }


def args_from_config(qcfg: dict) -> QuantArgs | None:
    """The weight scheme of a checkpoint's quantization_config: the group that targets "Linear" (None: float
    weights, a quantized KV cache only); anything slimlm cannot serve is named."""
    if not qcfg.get("config_groups") and qcfg.get("kv_cache_scheme") is not None:
        return None
    if qcfg.get("format") != "pack-quantized":
        raise SlimlmError(
            f"compressed-tensors format '{qcfg.get('format')}' is not supported; slimlm reads pack-quantized"
        )
    return _weight_args(_main_and_named_groups(qcfg)[0])


def named_args(qcfg: dict) -> dict[str, QuantArgs]:
    """Modules whose own config group names them exactly (e.g. an 8-bit lm_head beside 4-bit layers)."""
    if not qcfg.get("config_groups"):
        return {}
    named = {}
    for group in _main_and_named_groups(qcfg)[1]:
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets:
            raise SlimlmError(f"config group targets {targets!r}: expected a list of module names")
        for target in targets:
            if not isinstance(target, str) or target.startswith("re:"):
                raise SlimlmError(
                    f"config group target {target!r}: slimlm reads targets that are exact module "
                    'names, besides the one "Linear" group'
                )
            named[target] = _weight_args(group)
    return named


def _main_and_named_groups(qcfg: dict) -> tuple[dict, list[dict]]:
    """A lone group is the scheme of every quantized linear; with several, one targets "Linear" and the
    others name their modules."""
    groups = qcfg.get("config_groups")
    groups = list(groups.values()) if isinstance(groups, dict) else []
    if not groups or not all(isinstance(g, dict) and isinstance(g.get("weights"), dict) for g in groups):
        raise SlimlmError("quantization_config must have config groups, each with a 'weights' scheme")
    if len(groups) == 1:
        return groups[0], []
    main = [g for g in groups if "Linear" in (g.get("targets") or [])]
    if len(main) != 1:
        raise SlimlmError(
            'with several config groups, exactly one must target "Linear"; slimlm reads the others '
            "as schemes for the modules they name"
        )
    return main[0], [g for g in groups if g is not main[0]]


def _weight_args(group: dict) -> QuantArgs:
    if group.get("input_activations"):
        raise SlimlmError("activation quantization (W·A· schemes) is not supported; slimlm serves weight-only schemes")
    w = group["weights"]
    if w.get("type", "int") != "int" or w.get("strategy") not in (None, "group", "channel"):
        raise SlimlmError(
            f"weight scheme type={w.get('type')} strategy={w.get('strategy')} is not supported; "
            "slimlm serves integer per-group or per-channel weights"
        )
    bits, group, sym = w.get("num_bits"), w.get("group_size"), w.get("symmetric", True)
    if type(bits) is not int or bits not in SUPPORTED_BITS:
        raise SlimlmError(f"weights.num_bits is {bits!r}; slimlm reads integers {SUPPORTED_BITS}")
    if w.get("strategy") == "channel" or group is None:
        group = -1
    if type(group) is not int or group not in SUPPORTED_GROUP_SIZES:
        raise SlimlmError(f"weights.group_size is {group!r}; slimlm reads {SUPPORTED_GROUP_SIZES[1:]} or null")
    if type(sym) is not bool:
        raise SlimlmError(f"weights.symmetric is {sym!r}; it must be true or false")
    return QuantArgs(bits=bits, group_size=group, sym=sym)


def to_tensors(q: QuantizedWeight) -> dict[str, torch.Tensor]:
    out = {
        "weight_packed": pack_int32(q.codes, q.args.bits, dim=1),
        "weight_scale": q.scale.contiguous(),
        "weight_shape": torch.tensor(q.codes.shape, dtype=torch.int64),
    }
    if q.zero is not None:
        out["weight_zero_point"] = pack_int32(q.zero, q.args.bits, dim=0)
    if q.g_idx is not None:
        out["weight_g_idx"] = q.g_idx.to(torch.int32).contiguous()
    return out


def from_tensors(t: dict[str, torch.Tensor], args: QuantArgs, name: str) -> QuantizedWeight:
    """One linear's tensors -> QuantizedWeight, every shape and dtype checked against `args` first."""
    shape_t = _need(t, "weight_shape", name)
    if shape_t.numel() != 2 or shape_t.is_floating_point() or (shape_t <= 0).any():
        raise SlimlmError(f"{name}.weight_shape is {shape_t.tolist()}; expected [out, in] with positive sizes")
    out_f, in_f = shape_t.tolist()
    groups = args.groups(in_f)
    if args.group_size != -1 and in_f % args.group_size:
        raise SlimlmError(f"{name}: group_size {args.group_size} does not divide its input dim {in_f}")
    packed = _check(t, "weight_packed", name, (out_f, packed_words(in_f, args.bits)), torch.int32)
    scale = _check(t, "weight_scale", name, (out_f, groups), None)
    if not scale.is_floating_point():
        raise SlimlmError(f"{name}.weight_scale has dtype {scale.dtype}; scales are floats")
    zero = None
    if not args.sym:
        zp = _check(t, "weight_zero_point", name, (packed_words(out_f, args.bits), groups), torch.int32)
        zero = unpack_int32(zp, args.bits, out_f, dim=0)
    elif "weight_zero_point" in t:
        raise SlimlmError(f"{name} has a weight_zero_point but the config says symmetric")
    g_idx = t.get("weight_g_idx")
    if g_idx is not None:
        g_idx = _check(t, "weight_g_idx", name, (in_f,), None)
        if g_idx.is_floating_point() or g_idx.min() < 0 or g_idx.max() >= groups:
            raise SlimlmError(f"{name}.weight_g_idx holds groups outside 0..{groups - 1}")
    codes = unpack_int32(packed, args.bits, in_f, dim=1)
    return QuantizedWeight(codes, scale, zero, args, g_idx)


def _need(t: dict[str, torch.Tensor], key: str, name: str) -> torch.Tensor:
    if key not in t:
        raise SlimlmError(f"the checkpoint has no {name}.{key}")
    return t[key]


def _check(t: dict, key: str, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    x = _need(t, key, name)
    if tuple(x.shape) != shape or (dtype is not None and x.dtype != dtype):
        want = f"{list(shape)}" + (f" {dtype}" if dtype else "")
        raise SlimlmError(f"{name}.{key} is {list(x.shape)} {x.dtype}, the quantization_config implies {want}")
    return x
