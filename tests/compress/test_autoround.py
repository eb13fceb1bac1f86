import pytest
import torch
from torch.func import functional_call
from transformers import AutoModelForCausalLM

from slimlm.compress import pipeline
from slimlm.compress.autoround import AutoRound, fake_quantized, rounded
from slimlm.compress.quantize import quantize_rtn
from slimlm.errors import FieldError
from slimlm.formats.quantized import QuantArgs, stored_scale
from tests.conftest import transformers_logits_error


def fitted(tiny_llama, args: QuantArgs, float_target: float = 0.0, **options):
    """AutoRound run on the first decoder layer of the tiny model, 6 windows of 32 tokens; returns the step, the
    layer as it was, its linears, the layer's inputs and the quantized weights."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (6, 32), generator=torch.Generator().manual_seed(0))
    inputs = pipeline.capture_first_layer_inputs(model, ids, 3)
    layer = model.model.layers[0]
    linears = {f"model.layers.0.{n}": m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    step = AutoRound(args, float_target=float_target, **options)
    original = {n: m.weight.detach().clone() for n, m in linears.items()}
    handles = step.observe(layer, linears)
    with torch.no_grad():
        for x in inputs:
            if float_target:  # the pipeline's pairs: the float model's inputs first (here: slightly different)
                step.reference = True
                layer(x.hidden * 1.01, **x.kwargs)
                step.reference = False
            layer(x.hidden, **x.kwargs)
    for h in handles:
        h.remove()
    quantized = step.apply(layer, linears).quantized
    return step, layer, original, inputs, quantized


def output_error(layer, inputs, weights: dict[str, torch.Tensor]) -> float:
    """The layer's output error with `weights` (full names) in place of its own, against the layer as it is."""
    local = {f"{n.removeprefix('model.layers.0.')}.weight": w for n, w in weights.items()}
    with torch.no_grad():
        err = 0.0
        for x in inputs:
            ref = layer(x.hidden, **x.kwargs)
            ours = functional_call(layer, local, (x.hidden,), x.kwargs)
            err += (ours - ref).pow(2).sum().item()
    return err


@pytest.mark.parametrize("sym", [True, False])
def test_no_steps_is_round_to_nearest_to_the_bit(tiny_llama, sym):
    args = QuantArgs(4, 32, sym)
    _, _, original, _, quantized = fitted(tiny_llama, args, iters=0)
    for name, q in quantized.items():
        rtn = quantize_rtn(original[name], args)
        assert torch.equal(q.codes, rtn.codes), name
        assert torch.equal(q.scale, stored_scale(rtn.scale, torch.float32)), name
        assert (q.zero is None) == sym and (sym or torch.equal(q.zero, rtn.zero)), name


@pytest.mark.parametrize("sym", [True, False])
def test_fitting_lowers_the_layer_error_and_stays_in_range(tiny_llama, sym):
    """Every window in every step's loss: the loss is the layer error the fit minimizes, so the kept step is
    below RTN's and the loss falls over the steps. Offsets stay in [−0.5, 0.5]: a code is at most one step
    from w/s + z; the range multipliers in [0.5, 1]: each group's scale between half and all of RTN's."""
    args = QuantArgs(3, 32, sym)
    step, layer, original, inputs, quantized = fitted(tiny_llama, args, iters=40, windows=6)
    losses = step.losses
    assert len(losses) == 40 and min(losses) < losses[0]
    assert sum(losses[-10:]) < sum(losses[:10])
    rtn = {n: quantize_rtn(w, args) for n, w in original.items()}
    ours = output_error(layer, inputs, {n: q.dequantize(torch.float32) for n, q in quantized.items()})
    theirs = output_error(layer, inputs, {n: q.dequantize() for n, q in rtn.items()})
    assert ours < 0.9 * theirs
    moved = 0
    for name, q in quantized.items():
        # Scales are stored in fp16 (quantized.stored_scale): within 2^-11 of the fitted ones.
        ratio = q.scale.float() / rtn[name].scale
        assert ratio.min() >= 0.5 * (1 - 2**-11) and ratio.max() <= 1 + 2**-11, name
        idx = torch.arange(q.codes.shape[1]) // 32
        real = original[name] / q.scale.float()[:, idx] + (0 if q.zero is None else q.zero.float()[:, idx])
        inside = (real >= args.qmin) & (real <= args.qmax)
        assert ((q.codes.float() - real).abs()[inside] <= 1 + 2**-11 * args.qmax * 2).all(), name
        moved += (q.codes != rtn[name].codes).sum().item()
    assert moved > 0


def test_one_step_is_the_signed_gradient_step_from_round_to_nearest(tiny_llama):
    """Step 1's loss is the loss at p₀ − lr·sign(∇L(p₀)) (then clamped), p₀ = (V 0, α 1, β 1), ∇ through
    rounding taken straight."""
    args, lr = QuantArgs(4, 32, False), 0.3
    step, layer, original, inputs, _ = fitted(tiny_llama, args, iters=2, windows=6, lr=lr)
    params = {}
    for name, w in original.items():
        g = w.reshape(w.shape[0], -1, 32)
        params[name] = [torch.zeros_like(g, requires_grad=True)] + [
            torch.ones(g.shape[:2], requires_grad=True) for _ in range(2)
        ]

    def loss():
        fake = {
            name: fake_quantized(w.reshape(w.shape[0], -1, 32), *params[name], args).reshape(w.shape)
            for name, w in original.items()
        }
        local = {f"{n.removeprefix('model.layers.0.')}.weight": w for n, w in fake.items()}
        total, count = 0.0, 0
        for x in inputs:
            with torch.no_grad():
                ref = layer(x.hidden, **x.kwargs)
            total = total + (functional_call(layer, local, (x.hidden,), x.kwargs) - ref).pow(2).sum()
            count += ref.numel()
        return total / count

    first = loss()
    first.backward()
    with torch.no_grad():
        for v, a, b in params.values():
            v.sub_(lr * v.grad.sign()).clamp_(-0.5, 0.5)
            a.sub_(lr * a.grad.sign()).clamp_(0.5, 1)
            b.sub_(lr * b.grad.sign()).clamp_(0.5, 1)
    assert step.losses[0] == pytest.approx(first.item(), rel=1e-5)
    assert step.losses[1] == pytest.approx(loss().item(), rel=1e-5)
    assert step.losses[1] != pytest.approx(step.losses[0], rel=1e-3)


def test_the_float_target_blends_in_the_float_models_outputs(tiny_llama):
    """With float_target 1 the fit is to the outputs on the float model's inputs, not the layer's own: with
    0 steps the loss measured is the distance to those."""
    args = QuantArgs(4, 32, True)
    own = fitted(tiny_llama, args, float_target=0.0, iters=1, windows=6)[0].losses[0]
    step, layer, original, inputs, _ = fitted(tiny_llama, args, float_target=1.0, iters=1, windows=6)
    rtn = {
        f"{n.removeprefix('model.layers.0.')}.weight": quantize_rtn(w, args).dequantize() for n, w in original.items()
    }
    with torch.no_grad():
        diff = [functional_call(layer, rtn, (x.hidden,), x.kwargs) - layer(x.hidden * 1.01, **x.kwargs) for x in inputs]
    expected = sum(d.pow(2).sum().item() for d in diff) / sum(d.numel() for d in diff)
    assert step.losses[0] == pytest.approx(expected, rel=1e-5)
    assert own != pytest.approx(expected, rel=1e-2)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"iters": -1}, "iters"),
        ({"lr": 0.0}, "lr"),
        ({"lr": 2.0}, "lr"),
        ({"windows": 0}, "windows"),
        ({"float_target": 1.5}, "float_target"),
    ],
)
def test_bad_settings_are_refused(options, field):
    with pytest.raises(FieldError) as e:
        AutoRound(QuantArgs(), **options)
    assert e.value.field == field


def test_the_edges_of_the_settings_are_accepted_and_recorded():
    """lr 1 and a single window are valid; the step size defaults to 1/iters (AutoRound's), 1 at 0 steps."""
    step = AutoRound(QuantArgs(), iters=40, windows=1, float_target=0.0)
    assert step.lr == 1 / 40 and AutoRound(QuantArgs(), iters=0).lr == 1.0 and AutoRound(QuantArgs()).lr == 0.01
    assert step.arguments() == {"iters": 40, "lr": 1 / 40, "windows": 1, "float_target": 0.0}
    assert AutoRound(QuantArgs(), lr=1.0).lr == 1.0


def test_command_writes_a_checkpoint_transformers_and_the_runtime_read(tiny_llama, calib_txt, tmp_path):
    from slimlm.jobs import AWQ
    from slimlm.jobs import AutoRound as Job

    common = {"model": str(tiny_llama), "calib": str(calib_txt), "num_samples": 8, "seq_len": 32, "group_size": 32}
    out = Job(**common, out=tmp_path / "ar", iters=5, sym=False).run()
    assert transformers_logits_error(out) < 1e-4
    meta = (out / "slimlm.json").read_text()
    assert '"method": "autoround"' in meta and '"iters": 5' in meta
    out2 = AWQ(**common, out=tmp_path / "awq-ar", then="autoround", iters=3).run()
    assert '"method": "awq+autoround"' in (out2 / "slimlm.json").read_text()
    with pytest.raises(FieldError, match="learned-rounding option; AWQ runs it only with then autoround"):
        AWQ(model=str(tiny_llama), out=tmp_path / "x", iters=3)


@pytest.mark.parametrize("sym", [True, False])
def test_rounding_follows_the_definition_for_any_offsets_and_range_multipliers(sym):
    """ŵ = s·(clip(⌊w/s + V⌉ + z) − z), s from the group's range scaled by α (β for an asymmetric minimum), an
    all-zero group at scale 1; at V 0 and α = β = 1 it is RTN's scale and codes."""
    args = QuantArgs(4, 32, sym)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, 32, generator=g, dtype=torch.float64)
    w[2, 1] = 0.0  # all-zero group
    v = torch.rand(w.shape, generator=g, dtype=torch.float64) - 0.5
    alpha = 0.5 + 0.5 * torch.rand(6, 4, generator=g, dtype=torch.float64)
    beta = None if sym else 0.5 + 0.5 * torch.rand(6, 4, generator=g, dtype=torch.float64)
    codes, scale, zero = rounded(w, v, alpha, beta, args)
    if sym:
        s = w.abs().amax(-1) * alpha / 7.5
        z = torch.zeros_like(s)
    else:
        lo, hi = w.amin(-1).clamp(max=0) * beta, w.amax(-1).clamp(min=0) * alpha
        s = (hi - lo) / 15
    s = torch.where(s > 0, s, torch.ones_like(s))
    if not sym:
        z = torch.clamp(torch.round(-8 - lo / s), -8, 7)
        assert torch.equal(zero, z)
    assert torch.equal(scale, s) and scale[2, 1] == 1
    expected = torch.clamp(torch.round(w / s[..., None] + v) + z[..., None], -8, 7)
    assert torch.equal(codes, expected) and codes.min() == -8 and codes.max() == 7  # the clip is reached
    ŵ = fake_quantized(w, v, alpha, beta, args)
    assert torch.equal(ŵ, (expected - z[..., None]) * s[..., None])
    ones = torch.ones(6, 4, dtype=torch.float64)
    rtn = quantize_rtn(w.reshape(6, 128), args)
    codes, scale, zero = rounded(w, torch.zeros_like(w), ones, None if sym else ones, args)
    assert torch.equal(codes.reshape(6, 128).to(torch.int8), rtn.codes) and torch.equal(scale, rtn.scale)
    assert sym or torch.equal(zero.to(torch.int8), rtn.zero)
