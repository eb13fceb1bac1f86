"""The checkpoint reader on small hand-built checkpoints: every refusal names what is wrong, every accepted
tensor lands where the model expects it (the CLI probes of tests/test_reliability.py go through here too)."""

import json
import re

import pytest
import torch

from slimlm import SlimlmError
from slimlm.compress.quantize import quantize_rtn
from slimlm.formats import compressed_tensors, gptq_v1, kv_cache, reader, shards
from slimlm.formats.quantized import QuantArgs

W4 = QuantArgs(4, 32, sym=False)
W8 = QuantArgs(8, -1, sym=True)


def write(d, config, tensors):
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    shards.write(d, tensors)
    return d


def quantized_checkpoint(d, kv=None):
    """Two 4-bit linears, an 8-bit lm_head in its own config group, float norm and embedding."""
    torch.manual_seed(0)
    weights = {
        "layers.0.q_proj": (torch.randn(16, 64), W4),
        "layers.0.o_proj": (torch.randn(64, 32), W4),
        "lm_head": (torch.randn(40, 64), W8),
    }
    tensors = {"norm.weight": torch.ones(64), "embed.weight": torch.randn(40, 64)}
    qs = {}
    for name, (w, args) in weights.items():
        qs[name] = quantize_rtn(w, args)
        tensors.update({f"{name}.{k}": t for k, t in compressed_tensors.to_tensors(qs[name]).items()})
    if kv is not None:
        k_scale, v_scale = kv_cache.scale_names(0, "layers")
        tensors.update({k_scale: torch.tensor([0.5]), v_scale: torch.tensor([2.0])})
    qcfg = compressed_tensors.quantization_config(W4, ["embed"], kv_cache_scheme=kv, named={"lm_head": W8})
    return write(d, {"model_type": "llama", "quantization_config": qcfg}, tensors), qs


def expected_shapes():
    return {
        "norm.weight": (64,),
        "embed.weight": (40, 64),
        "layers.0.q_proj.weight": (16, 64),
        "layers.0.o_proj.weight": (64, 32),
        "lm_head.weight": (40, 64),
    }


def refusal_after(d, change) -> str:
    """read_checkpoint's one-line refusal once `change` has edited the checkpoint's tensors."""
    tensors = shards.read(d)
    change(tensors)
    shards.write(d, tensors)
    with pytest.raises(SlimlmError) as e:
        reader.read_checkpoint(d)
    return one_line(e)


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ---- config ------------------------------------------------------------------------------------------------


def test_read_config_returns_the_object_and_names_what_it_cannot_read(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"a": 1}')
    assert reader.read_config(tmp_path) == {"a": 1}
    not_object = f"{path} is not a JSON object; re-create or re-download the checkpoint"
    for content, message in [
        (b"[1, 2]", not_object),
        (b"{", f"cannot read {path}: Expecting"),
        (b"\xff\xfe{", f"cannot read {path}: "),
    ]:
        path.write_bytes(content)
        with pytest.raises(SlimlmError) as e:
            reader.read_config(tmp_path)
        assert one_line(e).startswith(message)
    with pytest.raises(SlimlmError, match=rf"^cannot read {re.escape(str(tmp_path / 'none' / 'config.json'))}: "):
        reader.read_config(tmp_path / "none")


def test_quantization_picks_the_reader_its_quant_method_names(tmp_path):
    assert reader.quantization({"model_type": "llama"}, tmp_path) is None
    ct = compressed_tensors.quantization_config(W4, [])
    assert reader.quantization({"quantization_config": ct}, tmp_path) == (compressed_tensors, W4)
    v1 = gptq_v1.quantization_config(QuantArgs(4, 32, True), None, 0.01)
    assert reader.quantization({"quantization_config": v1}, tmp_path) == (gptq_v1, QuantArgs(4, 32, True))
    kv_only = compressed_tensors.quantization_config(None, [], kv_cache_scheme=kv_cache.scheme("fp8", "tensor"))
    assert reader.quantization({"quantization_config": kv_only}, tmp_path) == (compressed_tensors, None)


@pytest.mark.parametrize(
    "qcfg, message",
    [
        ([1], "{d}/config.json: quantization_config is [1], not an object"),
        (
            {"quant_method": "bitsandbytes"},
            "{d}: quant_method 'bitsandbytes' is not supported; slimlm reads compressed-tensors, gptq, awq",
        ),
        ({"bits": 4}, "{d}: quant_method 'None' is not supported; slimlm reads compressed-tensors, gptq, awq"),
        (
            {"quant_method": "awq", "bits": 3},
            "{d}/config.json quantization_config: AWQ checkpoint (version gemm, 3-bit, zero_point=None) is not "
            "supported; slimlm reads AWQ GEMM 4-bit with zero points",
        ),
    ],
    ids=["not-an-object", "unknown-method", "no-method", "reader-refuses"],
)
def test_quantization_refusals_name_the_directory(tmp_path, qcfg, message):
    with pytest.raises(SlimlmError) as e:
        reader.quantization({"quantization_config": qcfg}, tmp_path)
    assert str(e.value) == message.format(d=tmp_path)


def test_kv_cache_scheme_is_checked_and_returned(tmp_path):
    fp8 = kv_cache.scheme("fp8", "tensor")
    assert reader.kv_cache_scheme({"quantization_config": {"kv_cache_scheme": fp8}}, tmp_path) == fp8
    assert reader.kv_cache_scheme({"quantization_config": {"kv_cache_scheme": None}}, tmp_path) is None
    assert reader.kv_cache_scheme({"quantization_config": "x"}, tmp_path) is None
    assert reader.kv_cache_scheme({}, tmp_path) is None
    with pytest.raises(SlimlmError) as e:
        reader.kv_cache_scheme({"quantization_config": {"kv_cache_scheme": {**fp8, "num_bits": 4}}}, tmp_path)
    assert one_line(e).startswith(f"{tmp_path}/config.json: kv_cache_scheme num_bits=4 type=float is not supported")


# ---- tensors -----------------------------------------------------------------------------------------------


def test_read_checkpoint_splits_quantized_linears_from_float_tensors(tmp_path):
    d, qs = quantized_checkpoint(tmp_path / "q")
    quantized, tensors = reader.read_checkpoint(d, expected_shapes())
    assert sorted(quantized) == sorted(qs) and sorted(tensors) == ["embed.weight", "norm.weight"]
    for name, q in qs.items():
        got = quantized[name]
        assert got.args == q.args  # the lm_head's own 8-bit scheme, the others the "Linear" group's
        assert torch.equal(got.codes, q.codes) and torch.equal(got.scale, q.scale)
        assert (got.zero is None) == (q.zero is None) and (q.zero is None or torch.equal(got.zero, q.zero))
    # without `expected` nothing is compared with a model, and the result is the same
    quantized2, tensors2 = reader.read_checkpoint(d)
    assert sorted(quantized2) == sorted(qs) and sorted(tensors2) == sorted(tensors)


def test_a_float_checkpoint_reads_as_float_tensors(tmp_path):
    t = {"norm.weight": torch.ones(4), "steps": torch.tensor([1, 2], dtype=torch.int64)}
    d = write(tmp_path / "f", {"model_type": "llama"}, t)
    quantized, tensors = reader.read_checkpoint(d, {"norm.weight": (4,), "steps": (2,)})
    assert quantized == {} and sorted(tensors) == ["norm.weight", "steps"]


def test_a_gptq_checkpoint_is_read_with_its_own_reader(tmp_path):
    args = QuantArgs(4, 32, True)
    q = quantize_rtn(torch.randn(16, 64), args)
    tensors = {f"proj.{k}": t for k, t in gptq_v1.to_tensors(q).items()}
    d = write(tmp_path / "g", {"quantization_config": gptq_v1.quantization_config(args, None, 0.01)}, tensors)
    quantized, rest = reader.read_checkpoint(d, {"proj.weight": (16, 64)})
    assert rest == {} and torch.equal(quantized["proj"].codes, q.codes)


@pytest.mark.parametrize("where", ["norm.weight", "layers.0.o_proj.weight_scale", "lm_head.weight_scale"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_tensor_that_is_not_finite_is_named(tmp_path, where, bad):
    d, _ = quantized_checkpoint(tmp_path / "q")
    message = refusal_after(d, lambda t: t[where].view(-1).__setitem__(-1, bad))
    assert message == f"{d}: tensor {where} holds NaN or Inf; the checkpoint is broken"


def test_a_broken_quantized_linear_is_named_with_the_directory(tmp_path):
    d, _ = quantized_checkpoint(tmp_path / "q")
    message = refusal_after(d, lambda t: t.pop("layers.0.o_proj.weight_scale"))
    assert message == f"{d}: the checkpoint has no layers.0.o_proj.weight_scale"


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path):
    d, _ = quantized_checkpoint(tmp_path / "q")
    shapes = expected_shapes()
    with pytest.raises(SlimlmError) as e:
        reader.read_checkpoint(d, {**shapes, "a.weight": (1,), "b.weight": (2,)})
    assert one_line(e) == f"{d} has no tensor a.weight (2 missing); the checkpoint is incomplete"
    # an optional tensor may be absent (a tied lm_head); expected ones still may not
    reader.read_checkpoint(d, {**shapes, "a.weight": (1,)}, optional={"a.weight"})
    with pytest.raises(SlimlmError, match=r"has no tensor b\.weight \(1 missing\)"):
        reader.read_checkpoint(d, {**shapes, "a.weight": (1,), "b.weight": (2,)}, optional={"a.weight"})
    del shapes["norm.weight"], shapes["lm_head.weight"]
    with pytest.raises(SlimlmError) as e:
        reader.read_checkpoint(d, shapes)
    assert one_line(e) == (
        f"{d} holds tensor lm_head.weight that its config.json does not describe "
        "(2 unexpected); the checkpoint does not match its config"
    )
    for name, shape in [("norm.weight", (65,)), ("layers.0.q_proj.weight", (64, 16))]:
        with pytest.raises(SlimlmError) as e:
            reader.read_checkpoint(d, {**expected_shapes(), name: shape})
        found = list(expected_shapes()[name])
        assert one_line(e) == f"{d}: {name} is {found}, config.json implies {list(shape)}"


@pytest.mark.parametrize("writer", [compressed_tensors, gptq_v1])
def test_packed_tensors_without_a_quantization_config_get_a_hint(tmp_path, writer):
    q = quantize_rtn(torch.randn(16, 64), QuantArgs(4, 32, True))
    d = write(tmp_path / "f", {"model_type": "llama"}, {f"proj.{k}": t for k, t in writer.to_tensors(q).items()})
    with pytest.raises(SlimlmError) as e:
        reader.read_checkpoint(d, {"proj.weight": (16, 64)})
    assert one_line(e) == (
        f"{d} has no tensor proj.weight (1 missing) (a quantized checkpoint whose "
        "quantization_config was removed?); the checkpoint is incomplete"
    )


def test_kv_scales_are_expected_only_when_the_config_has_a_kv_scheme(tmp_path):
    d, _ = quantized_checkpoint(tmp_path / "q", kv=kv_cache.scheme("int8", "tensor"))
    quantized, tensors = reader.read_checkpoint(d, expected_shapes())
    assert torch.equal(tensors["layers.0.self_attn.v_scale"], torch.tensor([2.0]))
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = None
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(SlimlmError, match="holds tensor layers.0.self_attn.k_scale that its config.json"):
        reader.read_checkpoint(d, expected_shapes())


def test_config_refusals_from_read_checkpoint_name_the_directory(tmp_path):
    d, _ = quantized_checkpoint(tmp_path / "q", kv=kv_cache.scheme("int8", "tensor"))
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"]["num_bits"] = 4
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(SlimlmError) as e:
        reader.read_checkpoint(d, expected_shapes())
    assert one_line(e).startswith(f"{d}/config.json: kv_cache_scheme num_bits=4 type=int is not supported")
    config["quantization_config"]["quant_method"] = "hqq"
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(SlimlmError) as e:
        reader.read_checkpoint(d)
    assert one_line(e) == f"{d}: quant_method 'hqq' is not supported; slimlm reads compressed-tensors, gptq, awq"
