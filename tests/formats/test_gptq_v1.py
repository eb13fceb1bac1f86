import json

import pytest
import torch

from slimlm import SlimlmError, models
from slimlm.compress.gptq import GPTQ, gptq_quantize
from slimlm.compress.job import quantize_weights
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
    back = gptq_v1.from_tensors(t, args, "w")
    assert torch.equal(back.codes, q.codes) and back.g_idx is None


def test_v1_keeps_act_order_g_idx():
    args = QuantArgs(4, 32, True)
    x = torch.randn(512, 64) * torch.linspace(0.1, 4, 64)
    q = gptq_quantize(torch.randn(16, 64), 2 * x.T @ x / 512, args, act_order="group")
    t = gptq_v1.to_tensors(q)
    assert torch.equal(t["g_idx"], q.g_idx)
    expected = QuantizedWeight(q.codes, q.scale.half().float(), None, args, q.g_idx).dequantize()
    assert torch.equal(unpack_documented(t, 4), expected)


@pytest.mark.parametrize("args", [QuantArgs(4, 32, False), QuantArgs(3, 32, True)], ids=str)
def test_unexportable_settings(args):
    with pytest.raises(SlimlmError, match="--format gptq writes symmetric 4- or 8-bit weights only"):
        gptq_v1.check_exportable(args)


def test_gptq_v1_checkpoint_round_trip(tiny_llama, calib_txt, tmp_path):
    args = QuantArgs(4, 32, True)
    common = dict(calib=str(calib_txt), num_samples=8, seq_len=32, progress=False)
    ct = quantize_weights("gptq", GPTQ(args), args, str(tiny_llama), tmp_path / "ct", **common)
    v1 = quantize_weights("gptq", GPTQ(args), args, str(tiny_llama), tmp_path / "v1", fmt="gptq", **common)
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
