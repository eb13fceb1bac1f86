import json

import pytest
import torch

from slimlm import SlimlmError, models
from slimlm.compress.gptq import GPTQ, gptq_quantize
from slimlm.compress.job import CalibData, Quantization, quantize_weights
from slimlm.compress.quantize import quantize_rtn
from slimlm.formats import gptq_v1, reader
from slimlm.formats.quantized import QuantArgs, QuantizedWeight


def unpack_documented(t: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """Dequantize v1 tensors element by element, exactly as the format is documented (zeros stored minus one)."""
    per_word = 32 // bits
    mask = (1 << bits) - 1
    qweight = t["qweight"].to(torch.int64) & 0xFFFFFFFF
    qzeros = t["qzeros"].to(torch.int64) & 0xFFFFFFFF
    scales, g_idx = t["scales"].float(), t["g_idx"].long()
    in_f, out_f = g_idx.numel(), scales.shape[1]
    w = torch.empty(out_f, in_f)
    for i in range(in_f):
        u = (qweight[i // per_word] >> (bits * (i % per_word))) & mask  # [out]
        g = g_idx[i]
        j = torch.arange(out_f)
        z = ((qzeros[g, j // per_word] >> (bits * (j % per_word))) & mask) + 1
        w[:, i] = scales[g] * (u - z).float()
    return w


@pytest.mark.parametrize("bits,group", [(4, 32), (4, -1), (8, 64)])
def test_v1_tensors_unpack_to_our_weights(bits, group):
    args = QuantArgs(bits, group, True)
    q = quantize_rtn(torch.randn(24, 128), args)
    t = gptq_v1.to_tensors(q)
    assert t["qweight"].shape == (128 * bits // 32, 24) and t["scales"].dtype == torch.float16
    ours = QuantizedWeight(q.codes, q.scale.half().float(), None, args).dequantize()  # v1 stores fp16 scales
    assert torch.equal(unpack_documented(t, bits), ours)
    assert t["g_idx"].dtype == torch.int32 and t["qzeros"].shape == (args.groups(128), 24 * bits // 32)
    back = gptq_v1.from_tensors(t, args, "w")
    assert torch.equal(back.codes, q.codes) and back.codes.dtype == torch.int8 and back.g_idx is None


def test_v1_keeps_act_order_g_idx():
    args = QuantArgs(4, 32, True)
    x = torch.randn(512, 64) * torch.linspace(0.1, 4, 64)
    q = gptq_quantize(torch.randn(16, 64), 2 * x.T @ x / 512, args, act_order="group")
    t = gptq_v1.to_tensors(q)
    assert torch.equal(t["g_idx"], q.g_idx)
    expected = QuantizedWeight(q.codes, q.scale.half().float(), None, args, q.g_idx).dequantize()
    assert torch.equal(unpack_documented(t, 4), expected)
    back = gptq_v1.from_tensors(t, args, "w")
    assert torch.equal(back.g_idx, q.g_idx) and torch.equal(back.codes, q.codes)


@pytest.mark.parametrize("args", [QuantArgs(4, 32, False), QuantArgs(3, 32, True)], ids=str)
def test_unexportable_settings(args):
    with pytest.raises(SlimlmError, match="--format gptq writes symmetric 4- or 8-bit weights only"):
        gptq_v1.check_exportable(args)


def test_gptq_v1_checkpoint_round_trip(tiny_llama, calib_txt, tmp_path):
    args = QuantArgs(4, 32, True)
    calib = CalibData(str(calib_txt), 8, 32)
    ct = quantize_weights(
        Quantization("gptq", [GPTQ(args)], args, str(tiny_llama), tmp_path / "ct", calib), progress=False
    )
    v1 = quantize_weights(
        Quantization("gptq", [GPTQ(args)], args, str(tiny_llama), tmp_path / "v1", calib, fmt="gptq"), progress=False
    )
    qcfg = json.loads((v1 / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "gptq" and qcfg["bits"] == 4 and qcfg["group_size"] == 32
    a, _ = reader.read_checkpoint(ct)
    b, _ = reader.read_checkpoint(v1)
    assert a.keys() == b.keys()
    for n in a:  # same GPTQ result; v1 holds the scales in float16
        assert torch.equal(a[n].codes, b[n].codes)
        torch.testing.assert_close(b[n].scale.float(), a[n].scale.half().float(), rtol=0, atol=0)
    m = models.load(str(v1))[0]
    assert torch.isfinite(m.model.layers[0].mlp.down_proj.weight).all()


@pytest.mark.parametrize(
    "args,got",
    [
        (QuantArgs(4, 32, False), "4-bit asym"),
        (QuantArgs(3, 32, True), "3-bit sym"),
        (QuantArgs(2, 32, True), "2-bit sym"),
    ],
)
def test_the_refusal_says_what_was_asked(args, got):
    with pytest.raises(SlimlmError, match=rf"\(got {got}\); use --sym with --bits 4 or 8, or the default"):
        gptq_v1.check_exportable(args)
    gptq_v1.check_exportable(QuantArgs(8, -1, True))  # symmetric 8-bit: fine


@pytest.mark.parametrize("act_order,desc_act", [("group", True), (None, False), ("weight", False)])
def test_the_config_is_autogptqs(act_order, desc_act):
    assert gptq_v1.quantization_config(QuantArgs(4, 128, True), act_order, 0.01) == {
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "bits": 4,
        "group_size": 128,
        "sym": True,
        "desc_act": desc_act,
        "damp_percent": 0.01,
        "true_sequential": True,
    }


@pytest.mark.parametrize(
    "qcfg,expected",
    [
        ({"bits": 4, "group_size": 128}, QuantArgs(4, 128, True)),
        ({"bits": 8, "group_size": -1, "sym": True, "checkpoint_format": "gptq"}, QuantArgs(8, -1, True)),
    ],
)
def test_configs_are_read_with_their_defaults(qcfg, expected):
    assert gptq_v1.args_from_config(qcfg) == expected


@pytest.mark.parametrize(
    "qcfg,fragment",
    [
        (
            {"bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"},
            r"GPTQ checkpoint format gptq_v2 \(sym=None\) is not supported; slimlm reads symmetric GPTQ v1",
        ),
        ({"bits": 4, "group_size": 128, "sym": False}, r"format None \(sym=False\) is not supported"),
        (
            {"bits": "4", "group_size": 128},
            r"GPTQ bits='4' group_size=128: slimlm reads bits 2/3/4/8, group sizes "
            r"\(-1, 32, 64, 128\)",
        ),
        ({"bits": 4, "group_size": 128.0}, "group_size=128.0: slimlm reads"),
        ({"bits": 5, "group_size": 128}, "GPTQ bits=5 group_size=128"),
        ({"bits": 4, "group_size": 16}, "GPTQ bits=4 group_size=16"),
        ({"group_size": 128}, "GPTQ bits=None group_size=128"),
    ],
)
def test_configs_slimlm_cannot_read_are_named(qcfg, fragment):
    with pytest.raises(SlimlmError, match=fragment):
        gptq_v1.args_from_config(qcfg)


def test_broken_tensors_are_named():
    args = QuantArgs(4, 32, True)
    t = gptq_v1.to_tensors(quantize_rtn(torch.randn(16, 64), args))
    for key in gptq_v1.KEYS:
        with pytest.raises(SlimlmError, match=f"the checkpoint has no w.{key}"):
            gptq_v1.from_tensors({k: v for k, v in t.items() if k != key}, args, "w")
    with pytest.raises(SlimlmError, match=r"w.scales is \[3, 16\], the quantization_config implies \[2, 16\]"):
        gptq_v1.from_tensors({**t, "scales": torch.cat([t["scales"], t["scales"][:1]])}, args, "w")
    with pytest.raises(SlimlmError, match=r"w.qweight is \[8, 16\], the quantization_config implies \[16, 16\]"):
        gptq_v1.from_tensors(t, QuantArgs(8, 32, True), "w")
    asym = {**t, "qzeros": t["qzeros"] + 1}  # zero points other than the symmetric 2^(b−1)
    with pytest.raises(SlimlmError, match="^GPTQ v1 checkpoint with asymmetric zero points: not supported yet$"):
        gptq_v1.from_tensors(asym, args, "w")
    with pytest.raises(SlimlmError, match=r"^w.qweight is \[8, 16\], the quantization_config implies \[8, 0\]$"):
        gptq_v1.from_tensors({**t, "scales": torch.tensor(1.0)}, args, "w")  # a scalar: named, not an IndexError
    for bad in (torch.full((64,), 2, dtype=torch.int32), torch.full((64,), -1, dtype=torch.int32), torch.zeros(64)):
        with pytest.raises(SlimlmError, match=r"^w.g_idx holds groups outside 0..1$"):
            gptq_v1.from_tensors({**t, "g_idx": bad}, args, "w")
