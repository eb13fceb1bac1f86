import pytest
import torch
from transformers import AutoModelForCausalLM

from slimlm import SlimlmError
from slimlm.compress import pipeline
from slimlm.compress.rtn import RTN
from slimlm.formats.quantized import QuantArgs

QUIET = pipeline.Passes(progress=False)


class Identity:
    """Quantizes nothing; also counts how many calibration rows each linear saw during the float pass."""

    needs_data = True
    changes_layer = False
    float_target = 0.0  # the pipeline's float chain: not wanted (pipeline.Step)

    def __init__(self):
        self.rows: dict[str, int] = {}

    def observe(self, layer, linears):
        def hook(name):
            def fn(_m, args):
                self.rows[name] = self.rows.get(name, 0) + args[0].reshape(-1, args[0].shape[-1]).shape[0]

            return fn

        return [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]

    def apply(self, layer, linears) -> pipeline.StepResult:
        return pipeline.StepResult()

    def arguments(self):
        return {}


@pytest.fixture
def model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def test_layer_by_layer_equals_full_forward(model):
    calib = torch.randint(0, model.config.vocab_size, (6, 20))
    outputs = []
    model.model.norm.register_forward_pre_hook(lambda _m, args: outputs.append(args[0]))
    with torch.no_grad():
        model(calib[:4], use_cache=False)
        model(calib[4:], use_cache=False)
    full = torch.cat(outputs)

    captured = []
    last = pipeline.decoder_layers(model)[-1]
    last.register_forward_hook(lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out))
    method = Identity()
    result = pipeline.run(model, [method], calib, pipeline.Passes(4, progress=False))
    quantized, report = result.quantized, result.report
    layerwise = torch.cat(captured[-2:])  # the second pass over the last layer, both batches
    assert quantized == {} and len(report) == 2
    torch.testing.assert_close(layerwise, full, rtol=1e-5, atol=1e-5)
    assert all(r["relative_error"] == 0 for r in report)
    assert set(method.rows.values()) == {6 * 20}  # every linear saw every calibration token once


@pytest.mark.parametrize("changes_layer", [False, True])
def test_a_layer_runs_a_second_time_only_after_a_step_that_changes_it(model, changes_layer):
    """The next layer's inputs are this layer's outputs as the steps left it: recomputed after a step that
    changes the layer, the float pass's own when none does (KV scales, pruning statistics)."""
    calib = torch.randint(0, model.config.vocab_size, (6, 20))
    method = Identity()
    method.changes_layer = changes_layer
    calls = []
    pipeline.decoder_layers(model)[-1].register_forward_pre_hook(lambda _m, _a: calls.append(1))
    result = pipeline.run(model, [method], calib, pipeline.Passes(4, progress=False))
    assert len(calls) == (4 if changes_layer else 2)  # two batches, one pass or two
    assert all(r["relative_error"] == 0 for r in result.report)  # (test_layer_by_layer_... checks the values)


def test_rtn_quantizes_every_decoder_linear_and_reports_error(model):
    calib = torch.randint(0, model.config.vocab_size, (4, 16))
    result = pipeline.run(model, [RTN(QuantArgs(4, 32))], calib, QUIET)
    quantized, report = result.quantized, result.report
    assert len(quantized) == 14 and not any("lm_head" in n or "embed" in n for n in quantized)
    assert all(r["relative_error"] > 0 for r in report)
    w = model.get_submodule("model.layers.1.mlp.down_proj").weight
    assert torch.equal(w, quantized["model.layers.1.mlp.down_proj"].dequantize(w.dtype))  # model now holds x̂


def test_ignore_keeps_linears_float(model):
    linears = pipeline.quantizable_linears(model, ["*.down_proj", "model.layers.0.*"])
    assert sorted(linears) == [
        f"model.layers.1.{n}"
        for n in sorted(
            [
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
            ]
        )
    ]


def test_group_size_that_does_not_divide_names_layers(model):
    with pytest.raises(SlimlmError) as e:
        pipeline.check_group_size(model, QuantArgs(4, 128))
    msg = str(e.value)
    assert "model.layers.*.mlp.up_proj (in=64)" in msg and "model.layers.*.mlp.down_proj (in=96)" in msg
    assert "fit every layer: 32, -1" in msg


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_weights_fail_loudly(model, value, dtype):
    model.get_submodule("model.layers.1.mlp.up_proj").weight.data[0, 0] = value
    passes = pipeline.Passes(compute_dtype=dtype, progress=False)
    with pytest.raises(SlimlmError, match=r"non-finite values \(NaN/Inf\) in the float outputs of decoder layer 1"):
        pipeline.run(model, [RTN(QuantArgs(4, 32))], torch.randint(0, 100, (2, 8)), passes)


def test_one_non_finite_output_anywhere_is_found():
    """_all_finite reads only the extremes: NaN and ±inf at any position in any dtype still make it False."""
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(64, 96).to(dtype)
        assert pipeline._all_finite(x)
        for value in (float("nan"), float("inf"), -float("inf")):
            for pos in (0, 1, 4095, 6143):
                y = x.clone()
                y.view(-1)[pos] = value
                assert not pipeline._all_finite(y), (dtype, value, pos)


def test_offloaded_layers_give_the_same_checkpoint(tiny_llama):
    """Layers read from disk one at a time give exactly what the in-memory model gives."""
    from slimlm import models
    from slimlm.compress.offload import LazyWeights

    calib = torch.randint(0, 100, (4, 16))
    in_memory = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    expected = pipeline.run(in_memory, [RTN(QuantArgs(4, 32))], calib, QUIET)

    empty = models.empty_model(tiny_llama)
    assert all(p.is_meta for p in empty.model.layers.parameters())
    weights = LazyWeights(tiny_llama)
    weights.materialize(empty.model.embed_tokens, "model.embed_tokens", torch.float32, "cpu")
    got = pipeline.run(empty, [RTN(QuantArgs(4, 32))], calib, QUIET, weights=weights)
    assert got.quantized.keys() == expected.quantized.keys()
    for n, q in expected.quantized.items():
        assert torch.equal(got.quantized[n].codes, q.codes)
    assert [r["relative_error"] for r in got.report] == pytest.approx([r["relative_error"] for r in expected.report])
    assert sorted(got.float_tensors) == sorted(
        f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")
    )
    assert all(p.is_meta for p in empty.model.layers.parameters())  # dropped again after use


def test_rtn_without_data_gives_the_same_codes(model, tiny_llama):
    calib = torch.randint(0, model.config.vocab_size, (4, 16))
    with_data = pipeline.run(model, [RTN(QuantArgs(4, 32))], calib, QUIET)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    without = pipeline.run(fresh, [RTN(QuantArgs(4, 32))], None, pipeline.Passes(report_error=False, progress=False))
    assert all("relative_error" not in r for r in without.report)
    for name, q in with_data.quantized.items():
        assert torch.equal(without.quantized[name].codes, q.codes)


class Probe(Identity):
    """Records the dtype of what each linear receives in the pass and of the weights each step is given."""

    def __init__(self):
        super().__init__()
        self.seen: set[torch.dtype] = set()
        self.weights: set[torch.dtype] = set()

    def observe(self, layer, linears):
        self.weights.update(m.weight.dtype for m in linears.values())
        return [m.register_forward_pre_hook(lambda _m, a: self.seen.add(a[0].dtype)) for m in linears.values()]

    def apply(self, layer, linears):
        self.weights.update(m.weight.dtype for m in linears.values())
        self.weights.update(p.dtype for p in layer.parameters())
        return pipeline.StepResult()


def test_passes_run_in_the_compute_dtype_while_the_weights_stay_as_stored(model, tiny_llama):
    calib = torch.randint(0, model.config.vocab_size, (4, 16))
    probe = Probe()
    result = pipeline.run(
        model, [probe, RTN(QuantArgs(4, 32))], calib, pipeline.Passes(compute_dtype=torch.bfloat16, progress=False)
    )
    # The hooks sit on the bf16 copy the batches run through; apply() gets the layer's own fp32 weights.
    assert probe.seen == {torch.bfloat16} and probe.weights == {torch.bfloat16, torch.float32}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(t.dtype == torch.float32 for t in result.float_tensors.values())
    # RTN reads no data: the codes come from the stored fp32 weights, as with fp32 passes.
    fresh = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    fp32 = pipeline.run(fresh, [RTN(QuantArgs(4, 32))], calib, QUIET)
    for name, q in fp32.quantized.items():
        assert torch.equal(result.quantized[name].codes, q.codes) and torch.equal(result.quantized[name].scale, q.scale)
    # The error report compares bf16 outputs with bf16 outputs: close to the fp32 one, not the same.
    errors = [r["relative_error"] for r in result.report]
    assert errors == pytest.approx([r["relative_error"] for r in fp32.report], rel=0.2) and errors != [
        r["relative_error"] for r in fp32.report
    ]


def test_a_job_with_an_unknown_compute_dtype_stops_before_any_work(tiny_llama, tmp_path):
    from slimlm.compress.job import CalibData, Quantization, quantize_weights

    args = QuantArgs(4, 32)
    with pytest.raises(SlimlmError, match=r"^compute_dtype 'fp16' is not one of auto, float32, bfloat16$"):
        quantize_weights(
            Quantization("rtn", [RTN(args)], args, str(tiny_llama), tmp_path / "q", CalibData(compute_dtype="fp16")),
            progress=False,
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("after_rtn", [False, True])
def test_a_float_target_step_sees_the_float_models_inputs_to_every_layer(model, after_rtn):
    """Layer 0 is quantized to 2 bits, yet the reference inputs to layer 1 are the float model's own, also
    when a step before changed the layer (its outputs on them are not the float model's then)."""
    from slimlm.compress.gptq import GPTQ

    calib = torch.randint(0, model.config.vocab_size, (4, 16))
    with torch.no_grad():
        float_inputs = model(calib, output_hidden_states=True, use_cache=False).hidden_states[1]
    step = GPTQ(QuantArgs(2, 32), float_target=0.5)
    seen = []  # (reference?, input) in call order
    record = lambda _m, args: seen.append((step.reference, args[0]))  # noqa: E731
    pipeline.decoder_layers(model)[1].register_forward_pre_hook(record)
    steps = [RTN(QuantArgs(2, 32)), step] if after_rtn else [step]
    pipeline.run(model, steps, calib, pipeline.Passes(2, progress=False))
    refs = [i for i, (reference, _) in enumerate(seen) if reference]
    assert len(refs) == 2  # each batch once, in the step's pass, each followed by its compressed twin
    # the step's pass, the output pass; after RTN also a float pass on the refs and the error report's
    assert len(seen) == (10 if after_rtn else 6)
    torch.testing.assert_close(torch.cat([seen[i][1] for i in refs]), float_inputs, rtol=1e-5, atol=1e-5)
    compressed = torch.cat([seen[i + 1][1] for i in refs])
    assert not seen[refs[0] + 1][0] and (compressed - float_inputs).abs().max() > 1e-2
