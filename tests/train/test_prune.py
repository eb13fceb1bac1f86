"""Structured pruning on a tiny model: keeping everything is the identity, planted dead units rank last and
removing them keeps the function (hidden channels up to the RMSNorm's count), the search stays under its
target with exact parameter counts, the command's checkpoint loads in transformers and serves greedy tokens
equal to transformers', a killed distillation resumes on the same curve, bad targets are named."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from slimlm.cli import main
from slimlm.train import prune
from tests.conftest import make_tiny_llama
from tests.train.test_distill import kill_after, losses

HD = 16  # the tiny model's head_dim: hidden 64 over 4 heads


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("prune") / "tiny4", layers=4)


@pytest.fixture
def model(tiny4):
    return AutoModelForCausalLM.from_pretrained(tiny4, dtype=torch.float32).eval()


def ids(model, seed: int = 0, shape=(4, 24)) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def logits(model, x) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


@torch.no_grad()
def plant(model, heads=(), neuron=None, layer=None, channels=()):
    """Dead units: heads whose o_proj columns are zero, a neuron whose down_proj column is zero (in every
    layer), a layer that adds nothing to the residual stream, hidden channels nothing ever writes."""
    for i, block in enumerate(model.model.layers):
        for h in heads:
            block.self_attn.o_proj.weight[:, h * HD : (h + 1) * HD] = 0
        if neuron is not None:
            block.mlp.down_proj.weight[:, neuron] = 0
        if i == layer:
            block.self_attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
        for c in channels:
            block.self_attn.o_proj.weight[c] = 0
            block.mlp.down_proj.weight[c] = 0
    for c in channels:
        model.model.embed_tokens.weight[:, c] = 0


def test_keeping_everything_is_the_identity(model):
    x = ids(model)
    scores = prune.importance(model, ids(model, 1), progress=False)
    same = prune.prune(model, prune.select(scores, model.config, prune.Shape.of(model.config)))
    assert torch.equal(logits(same, x), logits(model, x))
    assert same.config.to_dict() == {**model.config.to_dict(), "head_dim": HD}
    assert same.lm_head.weight is same.model.embed_tokens.weight  # tied embeddings stay tied


def test_planted_dead_units_rank_last(model):
    plant(model, heads=[2], neuron=5, layer=2, channels=[7])
    scores = prune.importance(model, ids(model, 1), progress=False)
    assert int(scores.layers.argmin()) == 2 and scores.layers[2] < 1e-6
    assert all(int(s.argmin()) == 2 for i, s in enumerate(scores.heads) if i != 2)
    assert all(int(s.argmin()) == 5 for i, s in enumerate(scores.ffn) if i != 2)
    assert int(scores.hidden.argmin()) == 7 and scores.hidden[7] == 0
    assert (scores.hidden > 0).sum() == 63 and all((s > 0).sum() == 3 for i, s in enumerate(scores.heads) if i != 2)


def test_removing_dead_heads_neurons_and_layers_keeps_the_function(model):
    """One dead head in each KV group (2 query heads per KV head), a dead neuron, a dead layer: the pruned
    model computes the same logits, which only holds if every q row, o_proj column and MLP slice matches."""
    plant(model, heads=[0, 3], neuron=5, layer=2)
    x = ids(model)
    scores = prune.importance(model, ids(model, 1), progress=False)
    shape = prune.Shape(hidden=64, heads=2, kv_heads=2, ffn=95, layers=3)
    keep = prune.select(scores, model.config, shape)
    assert keep.layers == [0, 1, 3] and keep.heads == [[1, 2]] * 3 and all(5 not in f for f in keep.ffn)
    small = prune.prune(model, keep)
    assert small.model.layers[0].self_attn.q_proj.weight.shape == (32, 64)
    assert torch.allclose(logits(small, x), logits(model, x), atol=1e-5)


def test_removing_dead_channels_keeps_the_function_up_to_the_norms_count(model):
    """Channels nothing writes are zero in the residual stream; removing them changes only the RMSNorm's
    mean (over 60 channels instead of 64), which scaling every norm weight by sqrt(64/60) undoes."""
    dead = [3, 17, 40, 63]
    plant(model, channels=dead)
    x = ids(model)
    scores = prune.importance(model, ids(model, 1), progress=False)
    keep = prune.select(scores, model.config, prune.Shape(hidden=60, heads=4, kv_heads=2, ffn=96, layers=4))
    assert keep.hidden == [c for c in range(64) if c not in dead]
    small = prune.prune(model, keep)
    with torch.no_grad():
        for name, p in small.named_parameters():
            if "norm" in name:
                p.mul_(math.sqrt(64 / 60))
    assert torch.allclose(logits(small, x), logits(model, x), atol=1e-4)


def test_whole_groups_go_with_their_kv_head(model):
    plant(model, heads=[2, 3])  # KV head 1's group is dead
    scores = prune.importance(model, ids(model, 1), progress=False)
    assert prune.kv_heads_for(model.config, 2) == 2  # 2 heads: one per group, both KV heads stay
    keep = prune.select(scores, model.config, prune.Shape(hidden=64, heads=2, kv_heads=1, ffn=96, layers=4))
    assert keep.kv_heads == [[0]] * 4 and keep.heads == [[0, 1]] * 4
    x = ids(model)
    assert torch.allclose(logits(prune.prune(model, keep), x), logits(model, x), atol=1e-5)


def test_the_search_stays_under_its_target_with_exact_counts(model):
    full = prune.count_parameters(model, prune.Shape.of(model.config))
    assert full == sum(p.numel() for p in model.parameters())
    scores = prune.importance(model, ids(model, 1), progress=False)
    found = prune.candidates(model, 0.6)
    assert {"depth", "width-heads"} <= set(found) and len(set(found.values())) == len(found)
    for shape in found.values():
        small = prune.prune(model, prune.select(scores, model.config, shape))
        assert prune.count_parameters(model, shape) == sum(p.numel() for p in small.parameters()) <= 0.6 * full
        assert shape.ffn % 32 == 0 and shape.hidden % shape.heads == 0
    assert found["depth"].layers == 2  # 3 layers would be 0.61 of the parameters


def prune_command(model, text, out, *extra) -> list[str]:
    return ["prune", "--model", str(model), "--calib", str(text), "--num-samples", "4", "--out", str(out), *extra]


def test_a_pruned_checkpoint_loads_in_transformers_and_serves_the_same_greedy_tokens(
    tiny4, calib_txt, tmp_path, capsys
):
    from slimlm.runtime.llm import LLM
    from slimlm.runtime.sampling import SamplingParams

    out = tmp_path / "pruned"
    assert (
        main(prune_command(tiny4, calib_txt, out, "--hidden", "48", "--heads", "2", "--ffn", "64", "--layers", "3"))
        == 0
    )
    err = capsys.readouterr().err
    assert "quantization group sizes none of 32, 64, 128 still fit (the model took 32)" in err
    assert "warning: no --distill-tokens, so the pruned model is not distilled: perplexity" in err
    config = json.loads((out / "config.json").read_text())
    assert {
        k: config[k]
        for k in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "num_hidden_layers",
            "head_dim",
        )
    } == {
        "hidden_size": 48,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "head_dim": HD,
    }
    meta = json.loads((out / "slimlm.json").read_text())
    assert len(meta["removed"]["layers"]) == 1 and len(meta["removed"]["hidden"]) == 16
    assert all(len(v) == 2 for v in meta["removed"]["heads"].values())
    assert meta["parameters"]["after"] < 0.5 * meta["parameters"]["before"]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert sum(p.numel() for p in hf.parameters()) == meta["parameters"]["after"]
    prompts = [ids(hf, seed, (1, n))[0].tolist() for seed, n in enumerate((5, 17, 40))]
    with torch.no_grad():
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p) :].tolist() for p in prompts
        ]
    got = LLM(str(out)).generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    assert [o.outputs[0].token_ids for o in got] == expected


def test_target_params_distills_the_candidate_that_scored_best(tiny4, calib_txt, tmp_path):
    out = tmp_path / "target"
    assert (
        main(
            prune_command(
                tiny4,
                calib_txt,
                out,
                "--target-params",
                "0.7",
                "--distill-tokens",
                "256",
                "--seq-len",
                "32",
                "--global-batch",
                "4",
                "--train-data",
                str(calib_txt),
                "--eval-data",
                str(calib_txt),
                "--eval-every",
                "1",
            )
        )
        == 0
    )
    meta = json.loads((out / "slimlm.json").read_text())
    ppl = {name: c["ppl"] for name, c in meta["candidates"].items()}
    assert len(ppl) >= 2 and meta["arguments"]["candidate"] == min(ppl, key=ppl.get)
    assert meta["parameters"]["after"] <= 0.7 * meta["parameters"]["before"]
    curve = [e["eval_ppl"] for e in meta["training"]["log"] if "eval_ppl" in e]
    assert len(curve) == 3 and curve[-1] < curve[0]  # distillation brought the pruned model back toward the source


def distill_command(model, text, out) -> list[str]:
    return prune_command(
        model,
        text,
        out,
        "--ffn",
        "32",
        "--layers",
        "3",
        "--train-data",
        str(text),
        "--eval-data",
        str(text),
        "--distill-tokens",
        str(16 * 4 * 32),
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--checkpoint-every",
        "4",
        "--eval-every",
        "8",
    )


def test_a_killed_distillation_resumes_on_the_same_curve(tiny4, calib_txt, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight = tmp_path / "straight"
    subprocess.run(
        [sys.executable, "-m", "slimlm.cli", *distill_command(tiny4, calib_txt, straight)],
        check=True,
        capture_output=True,
        env=env,
    )
    out, run_log = tmp_path / "killed", tmp_path / ".killed.train" / "log.jsonl"
    command = [sys.executable, "-m", "slimlm.cli", *distill_command(tiny4, calib_txt, out)]
    kill_after(command, env, run_log, 7)  # past the checkpoint at step 4
    assert not out.exists() and (tmp_path / ".killed.train" / "checkpoint" / "state.json").exists()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(losses(out)) == 16 and losses(out) == pytest.approx(losses(straight), rel=1e-6, abs=1e-9)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--target-params", "1.0"], "must be a fraction of today's parameters, in (0, 1)"),
        (["--target-params", "0.01"], "no candidate reaches 1% of the parameters"),
        (["--target-params", "0.6", "--ffn", "32"], "some of --hidden/--heads/--ffn/--layers"),
        ([], "some of --hidden/--heads/--ffn/--layers"),
        (
            ["--heads", "3"],
            "heads 3 breaks the grouping of 4 query heads over 2 KV heads (2 per KV head); counts that work: 2, 4",
        ),
        (["--hidden", "30"], "--hidden 30 is not a multiple of the 4 attention heads"),
        (["--ffn", "96", "--layers", "4"], "nothing would be removed"),
        (["--ffn", "200"], "--ffn 200 must be between 1 and the model's 96"),
        (["--target-params", "0.6", "--candidate", "sideways"], "--candidate needs --target-params and one of depth"),
        (["--ffn", "32", "--distill-tokens", "1000000"], "need 1952 windows of 512"),
    ],
)
def test_bad_targets_are_one_line_errors(tiny4, calib_txt, tmp_path, capsys, args, fragment):
    out = tmp_path / "bad"
    assert main(prune_command(tiny4, calib_txt, out, *args, "--train-data", str(calib_txt))) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and not out.exists()


def test_a_pruned_checkpoint_quantizes_like_any_other(tiny4, calib_txt, tmp_path):
    from tests.conftest import transformers_logits_error

    pruned, quantized = tmp_path / "pruned", tmp_path / "w4"
    assert main(prune_command(tiny4, calib_txt, pruned, "--ffn", "64", "--heads", "2")) == 0
    assert (
        main(
            [
                "gptq",
                "--model",
                str(pruned),
                "--calib",
                str(calib_txt),
                "--num-samples",
                "4",
                "--group-size",
                "32",
                "--out",
                str(quantized),
            ]
        )
        == 0
    )
    assert json.loads((quantized / "config.json").read_text())["intermediate_size"] == 64
    assert transformers_logits_error(quantized) < 1e-4  # transformers reads it as slimlm does


def test_search_tokens_picks_the_candidate_best_after_a_short_distillation(tiny4, calib_txt, tmp_path):
    out = tmp_path / "searched"
    args = [
        "--target-params",
        "0.7",
        "--search-tokens",
        "256",
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--train-data",
        str(calib_txt),
    ]
    assert main(prune_command(tiny4, calib_txt, out, *args)) == 0
    meta = json.loads((out / "slimlm.json").read_text())
    after = {name: c["ppl_after_search"] for name, c in meta["candidates"].items()}
    assert len(after) >= 2 and meta["arguments"]["candidate"] == min(after, key=after.get)
    assert all(c["ppl_after_search"] < c["ppl"] for c in meta["candidates"].values())


@torch.no_grad()
def test_importance_is_its_definition_summed_over_every_batch(model):
    """Against the definitions, from hooks on a plain forward of all windows at once (the pipeline sees them
    two at a time): a head's score is the RMS over tokens of its o_proj contribution |W_o[:, h] x_h|; a
    neuron's, the RMS of its down_proj input times that column's norm; a hidden channel's, the sum over
    layers and both norms of the norm output's RMS; a layer's, the mean cosine distance of its input and
    output."""
    x = ids(model, 1, shape=(6, 24))
    got = prune.importance(model, x, batch_size=2, progress=False)
    seen = {}

    def keep(name):
        return lambda module, args, out=None: seen.setdefault(name, []).append(
            (args[0] if args else None, out[0] if isinstance(out, tuple) else out)
        )

    hooks = []
    for i, block in enumerate(model.model.layers):
        hooks += [
            block.self_attn.o_proj.register_forward_pre_hook(keep(f"o{i}")),
            block.mlp.down_proj.register_forward_pre_hook(keep(f"d{i}")),
            block.input_layernorm.register_forward_hook(keep(f"n{i}.0")),
            block.post_attention_layernorm.register_forward_hook(keep(f"n{i}.1")),
            block.register_forward_hook(keep(f"l{i}")),
        ]
    model(x)
    for h in hooks:
        h.remove()

    def rms(t):  # over every token
        t = t.double().flatten(0, -2)
        return (t * t).mean(0).sqrt()

    tokens = x.numel()
    hidden = 0
    for i, block in enumerate(model.model.layers):
        a = seen[f"o{i}"][0][0].double().view(tokens, -1, HD)  # [T, heads, head_dim]
        w_o = block.self_attn.o_proj.weight.double().view(-1, a.shape[1], HD)
        contribution = torch.einsum("dnh,tnh->tnd", w_o, a)  # per token and head: W_o[:, h] x_h
        torch.testing.assert_close(got.heads[i], contribution.norm(dim=-1).pow(2).mean(0).sqrt().float())
        d = seen[f"d{i}"][0][0]
        torch.testing.assert_close(got.ffn[i], (rms(d) * block.mlp.down_proj.weight.double().norm(dim=0)).float())
        hidden = hidden + rms(seen[f"n{i}.0"][0][1]) + rms(seen[f"n{i}.1"][0][1])
        layer_in, layer_out = seen[f"l{i}"][0][0].flatten(0, -2), seen[f"l{i}"][0][1].flatten(0, -2)
        distance = (1 - torch.nn.functional.cosine_similarity(layer_in.double(), layer_out.double(), dim=-1)).mean()
        assert got.layers[i].item() == pytest.approx(distance.item(), rel=1e-5)
    torch.testing.assert_close(got.hidden, hidden.float())


def test_head_counts_kv_heads_and_the_sizes_the_search_tries():
    from types import SimpleNamespace

    config = SimpleNamespace(
        hidden_size=768, num_attention_heads=12, num_key_value_heads=4, intermediate_size=640, num_hidden_layers=6
    )
    assert prune.head_counts(config) == [3, 4, 6, 8, 9, 12]  # 1-3 heads in each of 4 groups, or 1-4 whole groups
    kv = {heads: prune.kv_heads_for(config, heads) for heads in (3, 4, 6, 8, 9, 12)}
    assert kv == {3: 1, 4: 4, 6: 2, 8: 4, 9: 3, 12: 4} and all(type(k) is int for k in kv.values())
    for heads in (0, 5, 15, 16):
        message = (
            f"heads {heads} breaks the grouping of 12 query heads over 4 KV heads (3 per KV head); counts "
            "that work: 3, 4, 6, 8, 9, 12"
        )
        with pytest.raises(prune.SlimlmError, match=f"^{message.replace('(', '[(]').replace(')', '[)]')}$"):
            prune.kv_heads_for(config, heads)
    assert prune._sizes(config, "layers", 12) == [1, 2, 3, 4, 5, 6]
    assert prune._sizes(config, "hidden", 12) == [384, 768]  # multiples of lcm(12 heads, 128-alignment)
    assert prune._sizes(config, "ffn", 12) == [128, 256, 384, 512, 640]
    assert prune.alignment(100) == 1 and prune.alignment(96) == 32
    current, shape = prune.Shape.of(config), prune.Shape(384, 12, 4, 480, 6)
    assert prune._deepest_cut(shape, current, ("ffn", "hidden")) == 0.5  # hidden cut by half, ffn by a quarter
    old = SimpleNamespace(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2)
    assert prune.Shape.of(old) == prune.Shape(64, 4, 4, 128, 2)  # no num_key_value_heads: multi-head


def test_a_pruned_config_keeps_the_attention_kinds_of_the_kept_layers():
    from transformers import Qwen2Config

    config = Qwen2Config(
        num_hidden_layers=3,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        use_sliding_window=True,
    )
    shape = prune.Shape(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, 2
    )
    out = prune.pruned_config(config, shape, [1, 2])
    assert out.layer_types == ["sliding_attention", "full_attention"] and out.num_hidden_layers == 2
    assert config.layer_types == ["full_attention", "sliding_attention", "full_attention"]  # the source's own


@pytest.fixture
def wide():
    """A model of a finer grid (hidden 512, 8 heads over 4 KV heads, FFN 1536, 8 layers) on the meta device:
    the search reads only its config and parameter names."""
    from accelerate import init_empty_weights
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def test_each_family_takes_the_most_even_cut_within_the_tolerance(wide):
    """Every shape a family can take (the grid of its dimensions' sizes): the one chosen is under the target,
    within the tolerance of it (else the largest under it), and no shape there cuts its deepest dimension
    less (ties: the larger one)."""
    import itertools
    from dataclasses import asdict, replace

    model, current = wide, prune.Shape.of(wide.config)
    total = prune.count_parameters(model, current)
    found = prune.candidates(model, 0.6)
    assert len(found) >= 3  # (a family whose choice repeats an earlier one's is left out)
    for name, shape in found.items():
        dims = prune.FAMILIES[name]
        grid = [[(d, v) for v in prune._sizes(model.config, d, current.heads)] for d in dims if d != "heads"]
        heads = prune._sizes(model.config, "heads", current.heads) if "heads" in dims else [current.heads]
        shapes = [
            replace(current, **dict(choice), heads=h, kv_heads=prune.kv_heads_for(model.config, h))
            for h in heads
            for choice in itertools.product(*grid)
        ]
        fits = [s for s in shapes if prune.count_parameters(model, s) <= 0.6 * total]
        window = [s for s in fits if prune.count_parameters(model, s) >= 0.57 * total]  # the default 0.03
        if not window:  # none that close: the largest that fits
            largest = max(prune.count_parameters(model, s) for s in fits)
            window = [s for s in fits if prune.count_parameters(model, s) == largest]
        assert shape in window, (name, asdict(shape))
        best = min(prune._deepest_cut(s, current, dims) for s in window)
        even = [s for s in window if prune._deepest_cut(s, current, dims) == best]
        assert prune._deepest_cut(shape, current, dims) == best
        assert prune.count_parameters(model, shape) == max(prune.count_parameters(model, s) for s in even)
