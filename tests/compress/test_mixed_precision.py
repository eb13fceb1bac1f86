import itertools
import json
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from slimlm.compress import mixed_precision as budget
from slimlm.compress import pipeline
from slimlm.compress.quantize import fake_quantize, quantize_rtn
from slimlm.errors import FieldError, SlimlmError
from slimlm.formats import compressed_tensors
from slimlm.formats.quantized import QuantArgs, scale_bytes, stored_scale
from tests.conftest import make_tiny_llama, transformers_logits_error


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize(("out_f", "in_f", "group"), [(96, 128, 32), (70, 128, 64), (33, 256, 128), (64, 96, -1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bytes_counted_are_the_bytes_the_checkpoint_stores(bits, sym, out_f, in_f, group, dtype):
    args = QuantArgs(bits, group, sym)
    q = quantize_rtn(torch.randn(out_f, in_f, dtype=dtype), args)
    q.scale = stored_scale(q.scale, dtype)
    stored = sum(t.numel() * t.element_size() for t in compressed_tensors.to_tensors(q).values())
    assert budget.linear_bytes(args, out_f, in_f, scale_bytes(dtype)) == stored


def brute_force(units: list[budget.Unit], limit: int) -> float:
    best = float("inf")
    for options in itertools.product(*(range(len(u.schemes)) for u in units)):
        size = sum(u.bytes[o] for u, o in zip(units, options, strict=True))
        if size <= limit:
            best = min(best, sum(u.errors[o] for u, o in zip(units, options, strict=True)))
    return best


def random_units(rng: random.Random, n: int, options: int) -> list[budget.Unit]:
    schemes = [QuantArgs(b, 32) for b in (2, 3, 4, 8)][:options]
    units = []
    for i in range(n):
        sizes = sorted(rng.randint(100, 1000) for _ in range(options))
        errors = sorted((rng.random() * 10 for _ in range(options)), reverse=rng.random() < 0.8)
        units.append(budget.Unit((f"u{i}",), 1000, schemes, sizes, errors))
    return units


@pytest.mark.parametrize("seed", range(30))
def test_the_knapsack_finds_the_brute_force_optimum(seed):
    """3 units × 3 schemes, and 6 × 4, at budgets from the least to past the most: the least error that fits,
    with bytes that fit, and the schemes it reports adding up to both."""
    rng = random.Random(seed)
    for n, options in ((3, 3), (6, 4)):
        units = random_units(rng, n, options)
        lo, hi = sum(min(u.bytes) for u in units), sum(max(u.bytes) for u in units)
        for limit in sorted({lo, hi, hi + 5, *(rng.randint(lo, hi) for _ in range(8))}):
            choice = budget.choose(units, limit)
            assert choice.exact
            assert choice.error == pytest.approx(brute_force(units, limit))
            assert choice.bytes <= limit
            picked = [u.schemes.index(choice.schemes[u.names[0]]) for u in units]
            assert choice.bytes == sum(u.bytes[o] for u, o in zip(units, picked, strict=True))
            assert choice.error == pytest.approx(sum(u.errors[o] for u, o in zip(units, picked, strict=True)))


def test_a_thinned_frontier_still_fits_and_says_so(monkeypatch):
    monkeypatch.setattr(budget, "MAX_FRONTIER", 8)
    units = random_units(random.Random(0), 8, 4)
    least = sum(min(u.bytes) for u in units)
    limit = (least + sum(max(u.bytes) for u in units)) // 2
    choice = budget.choose(units, limit)
    assert choice.exact is False and choice.bytes <= limit
    assert choice.error <= 1.5 * brute_force(units, limit)
    tightest = budget.choose(units, least)  # the cheapest point survives every thinning
    assert tightest.bytes == least and tightest.error == pytest.approx(brute_force(units, least))


@pytest.mark.parametrize("seed", range(5))
def test_thinning_keeps_the_cheapest_point_and_the_best_of_each_byte_range(monkeypatch, seed):
    monkeypatch.setattr(budget, "MAX_FRONTIER", 8)
    rng = np.random.default_rng(seed)
    c = np.cumsum(rng.integers(1, 50, size=100))
    kept = budget.thinned(c)
    width = (c[-1] - c[0] + 1) / 8
    assert kept[0] == 0 and kept[-1] == len(c) - 1 and len(kept) <= 9 and np.all(np.diff(kept) > 0)
    for i in range(len(c)):  # the next kept point at or after it lies in its byte range, and is its range's last
        j = kept[np.searchsorted(kept, i)]
        assert (c[j] - c[0]) // width == (c[i] - c[0]) // width
        assert j in (0, len(c) - 1) or (c[j + 1] - c[0]) // width > (c[j] - c[0]) // width


def test_a_budget_below_the_smallest_schemes_is_refused():
    units = random_units(random.Random(0), 3, 3)
    with pytest.raises(FieldError, match="budget is too small"):
        budget.choose(units, sum(min(u.bytes) for u in units) - 1)
    with pytest.raises(FieldError, match="^budget there are no linears to quantize$"):
        budget.choose([], 10**9)


@pytest.mark.parametrize("sym", [True, False])
def test_the_candidates_are_every_width_in_every_group_that_divides_the_inputs(sym):
    got = budget.candidates(sym, {192, 576})
    assert got == [QuantArgs(b, g, sym) for b in budget.BITS for g in (32, 64)]
    assert budget.candidates(sym, {1536}, (3,)) == [QuantArgs(3, g, sym) for g in (32, 64, 128)]


def test_the_fisher_is_the_mean_squared_gradient_of_the_loss_over_the_windows(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    model.requires_grad_(False)
    got = budget.fisher(model, ids, ignore=["*.layers.1.mlp.*"])
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    assert sorted(got) == sorted(n for n in names if ".layers.1.mlp." not in n)
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())  # left as it found them
    expected = {n: torch.zeros_like(model.get_submodule(n).weight) for n in got}
    for window in ids:
        params = {f"{n}.weight": model.get_submodule(n).weight.detach().clone().requires_grad_() for n in got}
        loss = torch.func.functional_call(model, params, (window[None],), {"labels": window[None]}).loss
        for n, g in zip(params, torch.autograd.grad(loss, list(params.values())), strict=True):
            expected[n.removesuffix(".weight")] += g.square() / len(ids)
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-4, atol=1e-12)
    # in bf16 passes (where they are fast): a copy runs them, the same Fisher to bf16's precision
    low = budget.fisher(model, ids, ignore=["*.layers.1.mlp.*"], dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for n in got:
        assert low[n].dtype == torch.float32 and (low[n] - got[n]).norm() < 0.05 * got[n].norm(), n
    assert not all(torch.equal(low[n], got[n]) for n in got)  # they did run in bf16


def test_sensitivity_is_the_fisher_weighted_rounding_error_of_each_unit_at_each_scheme(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    linears = pipeline.quantizable_linears(model)
    g = torch.Generator().manual_seed(1)
    fisher = {n: torch.rand(m.weight.shape, generator=g) for n, m in linears.items()}
    units = budget.sensitivity(linears, fisher, sym=False, bits=(2, 3, 4, 8))
    assert [u.names for u in units[:4]] == [
        tuple(f"model.layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("model.layers.0.self_attn.o_proj",),
        ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"),
        ("model.layers.0.mlp.down_proj",),
    ]
    assert len(units) == 8
    assert budget.least_bytes(linears, False, (2, 3, 4, 8)) == sum(min(u.bytes) for u in units)  # shapes alone
    for unit in units:
        assert unit.weights == sum(linears[n].weight.numel() for n in unit.names)
        for args, err, size in zip(unit.schemes, unit.errors, unit.bytes, strict=True):
            w = [linears[n].weight.detach() for n in unit.names]
            expected = sum(
                (fisher[n] * (x - fake_quantize(x, args)).square()).sum().item()
                for n, x in zip(unit.names, w, strict=True)
            )
            assert err == pytest.approx(expected, rel=1e-5)
            assert size == sum(budget.linear_bytes(args, *x.shape, 2) for x in w)  # fp16 scales
        by_bits = {a.bits: e for a, e in zip(unit.schemes, unit.errors, strict=True) if a.group_size == 32}
        assert by_bits[2] > by_bits[3] > by_bits[4] > by_bits[8]


@pytest.mark.parametrize("method", ["rtn", "gptq", "autoround"])
def test_a_budget_writes_a_mix_that_transformers_and_the_runtime_read(tiny_llama, calib_txt, tmp_path, method):
    from slimlm.jobs import GPTQ, RTN, AutoRound
    from slimlm.runtime.llm import LLM
    from slimlm.runtime.sampling import SamplingParams
    from tests.runtime.conftest import model_logprobs

    job = {"rtn": RTN, "gptq": GPTQ, "autoround": lambda **kw: AutoRound(iters=4, **kw)}[method]
    out = job(
        model=str(tiny_llama),
        calib=str(calib_txt),
        num_samples=8,
        seq_len=32,
        out=tmp_path / method,
        budget=4.5,
        sym=False,
    ).run()
    meta = json.loads((out / "slimlm.json").read_text())["budget"]
    assert meta["bits_per_weight"] == 4.5 and meta["achieved_bits_per_weight"] <= 4.5
    assert len(set(meta["schemes"].values())) > 1  # a mix
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    named = compressed_tensors.named_args(qcfg)
    main = compressed_tensors.args_from_config(qcfg)
    for name, scheme in meta["schemes"].items():
        assert budget.scheme_name(named.get(name, main)) == scheme
    assert transformers_logits_error(out) < 1e-4
    # the runtime's kernels (2 bits widened to 4) give transformers' log-probabilities
    llm = LLM(str(out), dtype="float32")
    ids = llm.tokenizer.encode("the city river music school team war state")
    got = torch.tensor(llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.allclose(got, model_logprobs(hf, ids), atol=1e-3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"budget": 1.5}, "budget: '1.5' must be between 2 and 16 bits a weight"),
        ({"budget": 4.0, "format": "gptq"}, "budget mixes schemes, which format gptq cannot store"),
        ({"budget": 4.0, "budget_bits": [4, 5]}, r"budget_bits \[4, 5\]: choose from 2, 3, 4, 8"),
        ({"budget": 4.0, "size": 10**6}, "size and budget both set the size; give one"),
        ({"size": 10**6, "format": "gptq"}, "size mixes schemes, which format gptq cannot store"),
    ],
)
def test_bad_budgets_are_refused_before_any_work(tiny_llama, tmp_path, options, message):
    from slimlm.jobs import GPTQ

    with pytest.raises(SlimlmError, match=message):
        GPTQ(model=str(tiny_llama), out=tmp_path / "x", **options).check()


def test_a_budget_out_of_range_is_refused_by_the_quantization_too(tiny_llama, tmp_path):
    from slimlm.compress.job import Quantization, check_inputs
    from slimlm.compress.rtn import RTN

    args = QuantArgs(4, 32)
    with pytest.raises(FieldError, match="budget 16.5 must be between 2.0 and 16.0 bits a weight"):
        check_inputs(Quantization("rtn", [RTN(args)], args, str(tiny_llama), tmp_path / "x", budget=16.5))


def test_a_size_gives_the_linears_what_the_other_tensors_leave(tiny_llama, calib_txt, tmp_path):
    """--size: the weight files come within one scheme step of the size asked and never over it; a size the
    other tensors and the smallest schemes do not fit in is refused with the least that would."""
    from slimlm.jobs import RTN

    def run(size, name):
        return RTN(
            model=str(tiny_llama),
            calib=str(calib_txt),
            num_samples=8,
            seq_len=32,
            out=tmp_path / name,
            size=size,
            sym=False,
        ).run()

    uniform4 = run(None, "w4")  # no size: uniform W4 g128 (the tiny model's default group)
    w4_bytes = json.loads((uniform4 / "slimlm.json").read_text())["size_bytes"]
    out = run(w4_bytes + 20_000, "sized")
    meta = json.loads((out / "slimlm.json").read_text())
    assert meta["budget"]["size_bytes"] == w4_bytes + 20_000
    assert meta["budget"]["written_bytes"] == meta["size_bytes"] <= w4_bytes + 20_000
    assert meta["size_bytes"] > w4_bytes  # the extra bytes went to wider schemes
    with pytest.raises(SlimlmError, match=r"bytes is too small: the tensors besides the decoder linears take"):
        run(w4_bytes // 4, "small")


def test_the_choice_is_named_summed_and_laid_out_layer_by_layer(tiny_llama):
    """Scheme names, the one-line summary (counts, most common first, and bits per weight), the per-layer
    table (one column per unit, '—' for a linear kept float), and the bytes the kernels hold (2/3 bits at 4)."""
    from slimlm import models

    assert [budget.scheme_name(QuantArgs(b, g)) for b, g in ((4, 64), (2, -1), (8, 128))] == [
        "w4g64",
        "w2-channel",
        "w8g128",
    ]
    model = models.empty_model(tiny_llama)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    schemes = {n: QuantArgs(4, 32, False) for n in linears}
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"):
        schemes[name] = QuantArgs(2, 64, False)
    schemes["model.layers.1.mlp.gate_proj"] = schemes["model.layers.1.mlp.up_proj"] = QuantArgs(8, -1, False)
    del schemes["model.layers.0.mlp.down_proj"]  # kept float
    weights = sum(linears[n].weight.numel() for n in schemes)
    size = sum(budget.linear_bytes(a, *linears[n].weight.shape, 2) for n, a in schemes.items())
    choice = budget.Choice(schemes, size, weights, 1.0, True)
    line = budget.summary(choice)
    assert line.startswith("9 w4g32, 2 w2g64, 2 w8-channel linears: ")
    assert f"{8 * size / weights:.3f} bits per weight, the least summed error" in line
    assert "within 1/" in budget.summary(budget.Choice(schemes, size, weights, 1.0, False))
    table = budget.layout_table(choice).splitlines()
    assert table[0].split() == ["layer", "q/k/v", "o", "gate/up", "down"]
    assert table[1].split() == ["0", "w4g32", "w2g64", "w4g32", "—"]
    assert table[2].split() == ["1", "w4g32", "w4g32", "w8-channel", "w2g64"]
    assert table[3] == line and len(table) == 4
    widened = {n: QuantArgs(4, a.group_size, False) if a.bits == 2 else a for n, a in schemes.items()}
    served = sum(budget.linear_bytes(a, *linears[n].weight.shape, 2) for n, a in widened.items())
    assert budget.served_bytes(choice, model) == served > size


def test_bits_per_weight_become_bytes_and_the_least_bytes_take_the_cheapest_scheme(tiny_llama):
    from slimlm import models

    units = [budget.Unit(("a",), 1000, [], [], []), budget.Unit(("b",), 600, [], [], [])]
    assert budget.budget_bytes(units, 4.25) == int(4.25 * 1600 / 8) == 850
    assert budget.budget_bytes(units, 3.3) == 660  # rounded down: never over the budget
    model = models.empty_model(tiny_llama)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    # at 2 bits, each in the largest group its input takes: 64 inputs in groups of 64, the MLP's 96 of 32
    group = {64: 64, 96: 32}
    cheapest = sum(
        budget.linear_bytes(QuantArgs(2, group[m.in_features], True), *m.weight.shape, 2) for m in linears.values()
    )
    assert budget.least_bytes(linears, True) == cheapest
    assert budget.least_bytes(linears, True, (4, 8)) > cheapest


def test_slimlm_json_records_the_choice():
    schemes = {"b": QuantArgs(8, 32), "a": QuantArgs(2, 64)}
    choice = budget.Choice(schemes, 1000, 1500, 0.25, False)
    assert budget.record(choice, 4.25) == {
        "bits_per_weight": 4.25,
        "bytes": 1000,
        "achieved_bits_per_weight": 5.3333,
        "proxy_error": 0.25,
        "exact": False,
        "schemes": {"a": "w2g64", "b": "w8g32"},
    }
    assert budget.record(choice, None, 12345)["size_bytes"] == 12345
    assert budget.summary(choice).startswith("1 w2g64, 1 w8g32 linears")  # ties by name


@pytest.mark.parametrize("tied", [True, False])
def test_the_other_tensors_are_every_parameter_but_the_linears_and_a_header_entry_each(tmp_path, tied):
    from slimlm import models

    model = models.empty_model(make_tiny_llama(tmp_path / "m", tied=tied))
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    params = dict(model.named_parameters())  # a meta model lists a tied head apart: the files store it once
    rest = {n: p for n, p in params.items() if n.removesuffix(".weight") not in linears}
    if tied:
        del rest["lm_head.weight"]
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    header = budget.HEADER_BYTES_PER_TENSOR
    assert budget.other_bytes(model, linears, None) == size(rest.values()) + header * (4 * len(linears) + len(rest))
    head_args = QuantArgs(8, 32, False)
    w = model.get_output_embeddings().weight
    kept = {n: p for n, p in rest.items() if n != "lm_head.weight"}  # the float head goes; the embeddings stay
    assert len(kept) == len(rest) - (not tied) and "model.embed_tokens.weight" in kept
    expected = size(kept.values()) + budget.linear_bytes(head_args, *w.shape, 2)  # its fp16 scales
    expected += header * (4 * len(linears) + len(kept) + 3)  # the head's codes, scales, zero points
    assert budget.other_bytes(model, linears, head_args) == expected
