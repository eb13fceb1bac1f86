import json
import shutil

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from slimlm import SlimlmError, models
from slimlm.compress.quantize import quantize_rtn
from slimlm.compress.rtn import RTN
from slimlm.formats import atomic, reader
from slimlm.formats.packing import pack_int32, unpack_int32
from slimlm.formats.quantized import QuantArgs, stored_scale
from tests.conftest import transformers_logits_error


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", [(5, 64), (7, 37), (96, 33)])
@pytest.mark.parametrize("dim", [0, 1])
def test_packing_is_bit_exact_with_compressed_tensors(bits, shape, dim):
    """The bit widths every compressed-tensors version packs alike (3 bits: the next test)."""
    codes = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), shape, dtype=torch.int8)
    packed = pack_int32(codes, bits, dim)
    assert torch.equal(packed, pack_to_int32(codes, bits, packed_dim=dim))
    assert torch.equal(unpack_int32(packed, bits, shape[dim], dim), codes)


@pytest.mark.parametrize("shape", [(5, 64), (7, 37), (96, 33)])
@pytest.mark.parametrize("dim", [0, 1])
def test_3bit_codes_are_one_dense_bit_stream(shape, dim):
    """3 bits as vLLM's loader and compressed-tensors >= 0.18 read them: element i at bits [3i, 3i + 3) of its
    row's little-endian stream, ceil(3n/32) words (compressed-tensors < 0.18 put ten in a word instead)."""
    codes = torch.randint(-4, 4, shape, dtype=torch.int8)
    packed = pack_int32(codes, 3, dim)
    rows = codes.transpose(0, 1) if dim == 0 else codes
    words = packed.transpose(0, 1) if dim == 0 else packed
    for row, got in zip(rows.tolist(), words.tolist(), strict=True):
        stream = sum((c + 4) << (3 * i) for i, c in enumerate(row))
        expected = [(stream >> (32 * w)) & 0xFFFFFFFF for w in range(-(-3 * len(row) // 32))]
        assert [w & 0xFFFFFFFF for w in got] == expected
    assert torch.equal(unpack_int32(packed, 3, shape[dim], dim), codes)


def quantize_tiny(tiny_llama, out, args, overwrite=False):
    from slimlm.compress.job import CalibData, Quantization, quantize_weights

    calib = CalibData(str(tiny_llama.parent.parent / "calib.txt"), 4, 32)
    return quantize_weights(
        Quantization("rtn", [RTN(args)], args, str(tiny_llama), out, calib, overwrite=overwrite), progress=False
    )


@pytest.fixture(scope="module")
def tiny_with_text(tiny_llama):
    from tests.conftest import make_text

    (tiny_llama.parent.parent / "calib.txt").write_text(make_text(100))
    return tiny_llama


# 3 bits are left out: compressed-tensors < 0.18 (what pyproject allows, for asymmetric checkpoints:
# docs/limits.md) packs them another way (test_3bit_codes_are_one_dense_bit_stream).
@pytest.mark.parametrize(
    "args", [QuantArgs(4, 32, True), QuantArgs(4, 32, False), QuantArgs(2, -1, False), QuantArgs(8, 32, True)], ids=str
)
def test_transformers_loads_our_checkpoint(tiny_with_text, tmp_path, args):

    out = quantize_tiny(tiny_with_text, tmp_path / "q", args)
    assert transformers_logits_error(out) < 1e-4
    meta = json.loads((out / "slimlm.json").read_text())
    assert meta["method"] == "rtn" and meta["arguments"]["bits"] == args.bits
    assert len(meta["layers"]) == 2 and meta["source_model"]["sha256"]


@pytest.mark.parametrize("args", [QuantArgs(4, 64, False), QuantArgs(8, -1, False), QuantArgs(2, 32, False)], ids=str)
def test_asymmetric_tensors_match_the_compressed_tensors_compressor(args):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from slimlm.formats.compressed_tensors import quantization_config, to_tensors

    w = torch.randn(40, 128)
    q = quantize_rtn(w, args)
    ours = to_tensors(q)
    scheme = QuantizationScheme(**quantization_config(args, [])["config_groups"]["group_0"])
    theirs = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": q.scale, "weight_zero_point": q.zero}, scheme
    )
    for key in ("weight_packed", "weight_zero_point", "weight_scale", "weight_shape"):
        assert torch.equal(ours[key], theirs[key]), key
    back = PackedQuantizationCompressor.decompress(ours, scheme)["weight"]
    torch.testing.assert_close(back, q.dequantize(), rtol=0, atol=0)


def test_read_back_equals_what_was_written(tiny_with_text, tmp_path):
    from transformers import AutoModelForCausalLM

    args = QuantArgs(4, 32, False)
    out = quantize_tiny(tiny_with_text, tmp_path / "q", args)
    quantized, rest = reader.read_checkpoint(out)
    source = AutoModelForCausalLM.from_pretrained(tiny_with_text, dtype=torch.float32)
    assert len(quantized) == 14  # 7 linears × 2 layers
    for name, q in quantized.items():
        expected = quantize_rtn(source.get_submodule(name).weight.data, args)
        assert torch.equal(q.codes, expected.codes) and torch.equal(q.zero, expected.zero)
        assert torch.equal(q.scale, stored_scale(expected.scale, torch.float32))
    assert "model.embed_tokens.weight" in rest and "lm_head.weight" not in rest  # tied: stored once


def test_existing_output_is_refused_then_replaced(tiny_with_text, tmp_path):
    out = tmp_path / "q"
    quantize_tiny(tiny_with_text, out, QuantArgs(4, 32))
    with pytest.raises(SlimlmError, match="exists; pass overwrite"):
        quantize_tiny(tiny_with_text, out, QuantArgs(4, 32))
    (out / "slimlm.json").write_text("{}")
    quantize_tiny(tiny_with_text, out, QuantArgs(4, 32), overwrite=True)
    assert json.loads((out / "slimlm.json").read_text())["method"] == "rtn"
    assert [p.name for p in tmp_path.iterdir()] == ["q"]  # no temp dirs left beside it


def test_overwrite_never_replaces_a_directory_that_is_not_a_checkpoint(tiny_with_text, tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(SlimlmError, match="not a checkpoint"):
        quantize_tiny(tiny_with_text, out, QuantArgs(4, 32), overwrite=True)
    assert (out / "keep.txt").exists()


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic.atomic_dir(tmp_path / "out", overwrite=False) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def checkpoint_copy(tiny_with_text, tmp_path):
    out = quantize_tiny(tiny_with_text, tmp_path / "src", QuantArgs(4, 32))
    return out


def test_truncated_checkpoint_is_reported(checkpoint_copy):
    f = checkpoint_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(SlimlmError, match="model.safetensors is truncated or corrupt"):
        models.load(str(checkpoint_copy))


def test_corrupted_checkpoint_is_reported(checkpoint_copy):
    f = checkpoint_copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(SlimlmError, match="does not match the sha256 in slimlm.json"):
        models.load(str(checkpoint_copy))


def test_garbage_header_is_reported(tiny_llama, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(SlimlmError, match="unreadable header"):
        models.load(str(d))


def _config(**groups) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": groups}


def _group(targets, bits: int) -> dict:
    return {
        "targets": targets,
        "weights": {"num_bits": bits, "type": "int", "symmetric": True, "group_size": 32, "strategy": "group"},
    }


def test_a_module_named_by_a_group_of_its_own_reads_with_that_scheme():
    from slimlm.formats import compressed_tensors

    qcfg = compressed_tensors.quantization_config(QuantArgs(4, 32), ["x"], named={"lm_head": QuantArgs(8, 32)})
    assert [g["targets"] for g in qcfg["config_groups"].values()] == [["Linear"], ["lm_head"]]
    assert compressed_tensors.args_from_config(qcfg) == QuantArgs(4, 32)
    assert compressed_tensors.named_args(qcfg) == {"lm_head": QuantArgs(8, 32)}
    # the order of the groups does not matter, and a lone group is every linear's whatever it targets
    swapped = _config(a=_group(["lm_head"], 8), b=_group(["Linear"], 4))
    assert compressed_tensors.args_from_config(swapped).bits == 4
    assert compressed_tensors.named_args(swapped) == {"lm_head": QuantArgs(8, 32, True)}
    assert compressed_tensors.named_args(_config(only=_group(["re:.*proj"], 4))) == {}


@pytest.mark.parametrize(
    "groups,fragment",
    [
        (
            dict(a=_group(["lm_head"], 8), b=_group(["re:.*"], 4)),
            '^with several config groups, exactly one must target "Linear"; slimlm reads the others as schemes for '
            "the modules they name$",
        ),
        (
            dict(a=_group(["Linear"], 4), b=_group(["re:.*lm_head"], 8)),
            """^config group target 're:.\\*lm_head': slimlm reads targets that are exact module names, besides the """
            'one "Linear" group$',
        ),
        (dict(a=_group(["Linear"], 4), b=_group("lm_head", 8)), "expected a list of module names"),
        (dict(a=_group(["Linear"], 4), b=_group(["lm_head"], 5)), "weights.num_bits is 5"),
    ],
)
def test_config_groups_slimlm_cannot_read_are_named(groups, fragment):
    from slimlm.formats import compressed_tensors

    with pytest.raises(SlimlmError, match=fragment):
        compressed_tensors.args_from_config(_config(**groups))
        compressed_tensors.named_args(_config(**groups))


def test_the_config_we_write_is_the_scheme_compressed_tensors_documents():
    from slimlm.formats import compressed_tensors

    own_args = {"model.x": QuantArgs(8, 32, False)}
    qcfg = compressed_tensors.quantization_config(QuantArgs(4, -1), ["lm_head"], "group", {"num_bits": 8}, own_args)
    assert qcfg["format"] == "pack-quantized" and qcfg["ignore"] == ["lm_head"]
    assert qcfg["kv_cache_scheme"] == {"num_bits": 8} and qcfg["quant_method"] == "compressed-tensors"
    main, own = qcfg["config_groups"]["group_0"], qcfg["config_groups"]["group_1"]
    assert main["weights"] == {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "group_size": None,
        "strategy": "channel",
        "dynamic": False,
        "actorder": "group",
        "observer": "minmax",
    }
    assert own["targets"] == ["model.x"] and own["weights"]["actorder"] is None  # act-order is GPTQ's, not RTN's
    assert own["weights"]["group_size"] == 32 and own["weights"]["strategy"] == "group"
    kv_only = compressed_tensors.quantization_config(None, ["x"], kv_cache_scheme={"num_bits": 8})
    assert kv_only["format"] == "dense" and kv_only["config_groups"] == {} and kv_only["ignore"] == []
    assert compressed_tensors.args_from_config(kv_only) is None and compressed_tensors.named_args(kv_only) == {}


@pytest.mark.parametrize(
    "weights,expected",
    [
        ({"num_bits": 4}, QuantArgs(4, -1, True)),  # type int, symmetric and per channel by default
        ({"num_bits": 8, "strategy": "channel", "group_size": 64}, QuantArgs(8, -1, True)),
        (
            {"num_bits": 3, "strategy": "group", "group_size": 32, "symmetric": False, "type": "int"},
            QuantArgs(3, 32, False),
        ),
        ({"num_bits": 4, "input_activations": None}, QuantArgs(4, -1, True)),
    ],
)
def test_weight_schemes_are_read_with_their_defaults(weights, expected):
    from slimlm.formats import compressed_tensors

    group = {"targets": ["Linear"], "weights": weights}
    assert compressed_tensors.args_from_config(_config(group_0=group)) == expected


@pytest.mark.parametrize(
    "group,fragment",
    [
        (
            {"input_activations": {"num_bits": 8}},
            r"^activation quantization \(W·A· schemes\) is not supported; slimlm serves weight-only schemes$",
        ),
        (
            {"weights": {"num_bits": 4, "type": "float"}},
            "^weight scheme type=float strategy=None is not supported; slimlm serves integer per-group or "
            "per-channel weights$",
        ),
        ({"weights": {"num_bits": 4, "strategy": "tensor"}}, "type=None strategy=tensor is not supported"),
        ({"weights": {"num_bits": True}}, r"weights.num_bits is True; slimlm reads integers \(2, 3, 4, 8\)"),
        (
            {"weights": {"num_bits": 4, "strategy": "group", "group_size": 16}},
            r"^weights.group_size is 16; slimlm reads \(32, 64, 128\) or null$",
        ),
        ({"weights": {"num_bits": 4, "strategy": "group", "group_size": 64.0}}, "weights.group_size is 64.0"),
        ({"weights": {"num_bits": 4, "symmetric": "yes"}}, "weights.symmetric is 'yes'; it must be true or false"),
        ({"weights": "int4"}, "^quantization_config must have config groups, each with a 'weights' scheme$"),
    ],
)
def test_weight_schemes_slimlm_cannot_serve_are_named(group, fragment):
    from slimlm.formats import compressed_tensors

    group = {"targets": ["Linear"], "weights": {"num_bits": 4}, **group}
    with pytest.raises(SlimlmError, match=fragment):
        compressed_tensors.args_from_config(_config(group_0=group))


def test_a_config_with_groups_reads_them_even_beside_a_kv_scheme():
    from slimlm.formats import compressed_tensors

    qcfg = {**_config(a=_group(["Linear"], 4)), "kv_cache_scheme": {"num_bits": 8}}
    assert compressed_tensors.args_from_config(qcfg) == QuantArgs(4, 32, True)
    with pytest.raises(SlimlmError, match="format 'dense' is not supported; slimlm reads pack-quantized"):
        compressed_tensors.args_from_config({**qcfg, "format": "dense"})
    with pytest.raises(SlimlmError, match="must have config groups"):
        compressed_tensors.args_from_config({**qcfg, "config_groups": ["x"]})


@pytest.mark.parametrize(
    "args,shape",
    [(QuantArgs(4, 32, False), (264, 64)), (QuantArgs(3, -1, True), (5, 264)), (QuantArgs(8, 32, True), (1, 96))],
    ids=str,
)
def test_tensors_round_trip_with_their_dtypes(args, shape):
    """Sizes whose packed widths need ceil(·/32) (264 = 8.25 words of 4-bit codes) and one output row."""
    from slimlm.formats import compressed_tensors

    q = quantize_rtn(torch.randn(*shape), args)
    g = torch.Generator().manual_seed(0)
    q.g_idx = (torch.arange(shape[1]) // (shape[1] if args.group_size == -1 else args.group_size))[
        torch.randperm(shape[1], generator=g)
    ]  # int64: written as int32
    t = compressed_tensors.to_tensors(q)
    assert t["weight_packed"].dtype == torch.int32 and t["weight_shape"].dtype == torch.int64
    assert t["weight_g_idx"].dtype == torch.int32 and torch.equal(t["weight_g_idx"].long(), q.g_idx)
    back = compressed_tensors.from_tensors(t, args, "w")
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scale, q.scale)
    assert torch.equal(back.g_idx.long(), q.g_idx)
    assert (back.zero is None) == args.sym and (args.sym or torch.equal(back.zero, q.zero))


def _tensors(args: QuantArgs | None = None) -> dict:
    from slimlm.formats import compressed_tensors

    args = args or QuantArgs(4, 32, False)
    q = quantize_rtn(torch.randn(16, 64), args)
    q.g_idx = (torch.arange(64) // 32).flip(0).int()
    return compressed_tensors.to_tensors(q)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.pop("weight_shape"), "the checkpoint has no w.weight_shape"),
        (lambda t: t.pop("weight_packed"), "the checkpoint has no w.weight_packed"),
        (
            lambda t: t.update(weight_shape=torch.tensor([16, 64, 1])),
            r"w.weight_shape is \[16, 64, 1\]; expected \[out, in\] with positive sizes",
        ),
        (lambda t: t.update(weight_shape=torch.tensor([16.0, 64.0])), r"w.weight_shape is \[16.0, 64.0\]; expected"),
        (lambda t: t.update(weight_shape=torch.tensor([0, 64])), r"w.weight_shape is \[0, 64\]; expected"),
        (lambda t: t.update(weight_shape=torch.tensor([16, 48])), "w: group_size 32 does not divide its input dim 48"),
        (
            lambda t: t.update(weight_packed=t["weight_packed"].long()),
            r"w.weight_packed is \[16, 8\] torch.int64, the quantization_config implies \[16, 8\] torch.int32",
        ),
        (
            lambda t: t.update(weight_scale=t["weight_scale"][:, :1]),
            r"w.weight_scale is \[16, 1\] torch.float32, the quantization_config implies \[16, 2\]$",
        ),
        (
            lambda t: t.update(weight_scale=t["weight_scale"].int()),
            "w.weight_scale has dtype torch.int32; scales are floats",
        ),
        (
            lambda t: t.update(weight_zero_point=t["weight_zero_point"].long()),
            r"w.weight_zero_point is \[2, 2\] torch.int64, the quantization_config implies \[2, 2\] torch.int32",
        ),
        (lambda t: t.update(weight_g_idx=t["weight_g_idx"].float()), r"w.weight_g_idx holds groups outside 0..1$"),
        (lambda t: t.update(weight_g_idx=t["weight_g_idx"] + 1), r"w.weight_g_idx holds groups outside 0..1$"),
        (lambda t: t.update(weight_g_idx=t["weight_g_idx"] - 1), r"w.weight_g_idx holds groups outside 0..1$"),
        (
            lambda t: t.update(weight_g_idx=t["weight_g_idx"][:63]),
            r"w.weight_g_idx is \[63\] torch.int32, the quantization_config implies \[64\]$",
        ),
    ],
)
def test_broken_tensors_are_named(change, message):
    from slimlm.formats import compressed_tensors

    t = _tensors()
    change(t)
    with pytest.raises(SlimlmError, match=f"^{message}"):
        compressed_tensors.from_tensors(t, QuantArgs(4, 32, False), "w")


def test_a_zero_point_beside_a_symmetric_config_is_refused():
    from slimlm.formats import compressed_tensors

    t = _tensors(QuantArgs(4, 32, False))
    with pytest.raises(SlimlmError, match="^w has a weight_zero_point but the config says symmetric$"):
        compressed_tensors.from_tensors(t, QuantArgs(4, 32, True), "w")
    t.pop("weight_zero_point")
    assert compressed_tensors.from_tensors(t, QuantArgs(4, 32, True), "w").zero is None
    t = _tensors(QuantArgs(4, -1, True))  # per channel: any input dim
    t["weight_g_idx"] = torch.zeros(64, dtype=torch.int32)
    assert compressed_tensors.from_tensors(t, QuantArgs(4, -1, True), "w").g_idx is not None
