"""GQA conversion on a tiny model: expanding is exact, merging copies is exact (contiguous or permuted
groups), merging to the same count is the identity, similarity finds the copies, bad targets are named."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from slimlm import SlimlmError
from slimlm.train import gqa


@pytest.fixture
def model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()  # 4 heads, 2 KV heads


def logits(model, seed: int = 0) -> torch.Tensor:
    x = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(x).logits


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_expand_keeps_the_function_and_merging_back_restores_the_weights(model):
    before, original = logits(model), weights(model)
    gqa.expand(model, 4)
    assert model.config.num_key_value_heads == 4 and model.model.layers[0].self_attn.k_proj.out_features == 64
    assert torch.allclose(logits(model), before, atol=1e-5)
    gqa.merge(model, [gqa.contiguous_groups(4, 2)] * 2)
    after = weights(model)
    assert all(torch.equal(after[k], original[k]) for k in original)


def test_merging_to_the_same_count_is_the_identity(model):
    before, original = logits(model), weights(model)
    gqa.merge(model, [gqa.contiguous_groups(2, 2)] * 2)
    assert all(torch.equal(weights(model)[k], original[k]) for k in original)
    assert torch.equal(logits(model), before)


def test_a_permuted_grouping_moves_query_heads_and_o_proj_with_it(model):
    """4 KV heads where 0 and 2 are copies, and 1 and 3: merging [0, 2] and [1, 3] changes nothing, which
    only holds if each query head follows its KV head and o_proj's columns follow the query heads."""
    gqa.expand(model, 4)  # copies at 0,1 and 2,3: swap heads 1 and 2 (K, V rows and their query heads)
    before = logits(model)
    gqa.permute_kv_heads(model, [[0, 2, 1, 3]] * 2)
    assert torch.allclose(logits(model), before, atol=1e-5)
    groups = gqa.similarity_groups(model, torch.randint(0, model.config.vocab_size, (4, 16)), kv_heads=2)
    assert groups == [[[0, 2], [1, 3]]] * 2
    gqa.merge(model, groups)
    assert model.config.num_key_value_heads == 2
    assert torch.allclose(logits(model), before, atol=1e-5)


def test_permuting_kv_heads_moves_their_query_groups_too(model):
    before, q = logits(model), model.model.layers[0].self_attn.q_proj.weight.clone()
    gqa.permute_kv_heads(model, [[1, 0], [0, 1]])  # 2 query heads per KV head: rows 32..63 move to the front
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight[:32], q[32:])
    assert torch.allclose(logits(model), before, atol=1e-5)


def test_mean_pooling_is_the_mean_of_the_groups_rows(model):
    k = model.model.layers[1].self_attn.k_proj.weight.clone()
    gqa.merge(model, [[[0, 1]]] * 2)
    assert torch.allclose(model.model.layers[1].self_attn.k_proj.weight, (k[:16] + k[16:]) / 2)
    assert model.model.layers[1].self_attn.num_key_value_groups == 4
    assert isinstance(model.model.layers[1].self_attn.num_key_value_groups, int)  # transformers repeats KV by it


def test_merging_keeps_q_k_v_biases_and_the_weights_dtype():
    """Qwen2's q/k/v carry biases: they are pooled and reordered with their rows; bf16 stays bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    qwen = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    attention = qwen.model.layers[0].self_attn
    k_bias, v_bias, q_bias = attention.k_proj.bias.clone(), attention.v_proj.bias.clone(), attention.q_proj.bias.clone()
    gqa.merge(qwen, [[[0, 1]]])
    attention = qwen.model.layers[0].self_attn
    assert attention.k_proj.weight.dtype == attention.k_proj.bias.dtype == torch.bfloat16
    torch.testing.assert_close(attention.k_proj.bias, (k_bias[:16] + k_bias[16:]) / 2)
    torch.testing.assert_close(attention.v_proj.bias, (v_bias[:16] + v_bias[16:]) / 2)
    assert torch.equal(attention.q_proj.bias, q_bias)


def test_best_partition_minimises_the_within_group_distance():
    points = torch.tensor([0.0, 10.0, 0.1, 10.2, 5.0, 5.1])
    distance = (points[:, None] - points[None, :]) ** 2
    assert sorted(map(sorted, gqa.best_partition(distance, 2))) == [[0, 2], [1, 3], [4, 5]]


def traps(blocks: int) -> torch.Tensor:
    """Distances where greedy pairing goes wrong: in each block of 4 heads, 0-1 are nearest (1) but pairing
    them leaves 2-3 (100); 0-2 and 1-3 (2 each) is the best pairing. Blocks are far apart (1000)."""
    block = torch.tensor([[0, 1, 2, 50], [1, 0, 50, 2], [2, 50, 0, 100], [50, 2, 100, 0]], dtype=torch.float32)
    distance = torch.full((4 * blocks, 4 * blocks), 1000.0)
    for b in range(blocks):
        distance[4 * b : 4 * b + 4, 4 * b : 4 * b + 4] = block
    return distance


def greedy(distance: torch.Tensor, size: int) -> list[list[int]]:
    """The documented rule: each group is the first free head and its size - 1 nearest free heads."""
    free, groups = list(range(len(distance))), []
    while free:
        first, free = free[0], free[1:]
        nearest = sorted(free, key=lambda h: float(distance[first, h]))[: size - 1]
        groups.append(sorted([first, *nearest]))
        free = [h for h in free if h not in nearest]
    return groups


def test_best_partition_is_exhaustive_up_to_12_heads_then_greedy():
    assert gqa.best_partition(traps(3), 2) == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11]]  # 12: exhaustive
    assert gqa.best_partition(traps(4), 2) == [[4 * b + i, 4 * b + i + 1] for b in range(4) for i in (0, 2)]
    distance = torch.rand(16, 16, generator=torch.Generator().manual_seed(0))
    distance = distance + distance.T
    for size in (2, 4, 8):
        groups = gqa.best_partition(distance, size)
        assert groups == greedy(distance, size) and sorted(h for g in groups for h in g) == list(range(16))


@pytest.mark.parametrize(
    "kv_heads,expand,fragment",
    [
        (3, False, "does not divide the 4 query heads; use one of 1, 2, 4"),
        (1, True, "expand needs a multiple of the current 2 KV heads, got 1"),
        (
            4,
            False,
            "kv_heads 4 is more than the model's 2 KV heads: merging only removes heads (add expand to repeat them)",
        ),
    ],
)
def test_targets_that_cannot_work_are_named(model, kv_heads, expand, fragment):
    with pytest.raises(SlimlmError, match=re.escape(fragment)):
        gqa.check_kv_heads(model.config, kv_heads, expand)


def test_uneven_groups_are_named_and_whole_factors_pass():
    from types import SimpleNamespace

    config = SimpleNamespace(num_attention_heads=12, num_key_value_heads=6)
    message = "kv_heads 4 does not divide the current 6 KV heads, so the groups would be uneven"
    with pytest.raises(SlimlmError, match=f"^{re.escape(message)}$"):
        gqa.check_kv_heads(config, 4, False)
    for kv_heads, expand in ((6, False), (3, False), (1, False), (12, True), (6, True)):
        gqa.check_kv_heads(config, kv_heads, expand)  # no error


def test_the_converted_checkpoint_loads_in_transformers_and_the_runtime_agrees_token_for_token(
    tiny_llama, calib_txt, tmp_path
):
    from slimlm.cli import main
    from slimlm.runtime.llm import LLM
    from slimlm.runtime.sampling import SamplingParams

    out = tmp_path / "mqa"
    assert (
        main(
            [
                "gqa",
                "--model",
                str(tiny_llama),
                "--kv-heads",
                "1",
                "--calib",
                str(calib_txt),
                "--num-samples",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert theirs.config.num_key_value_heads == 1
    prompt = [5, 17, 42, 8, 99, 3]
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :]
    (ours,) = LLM(str(out), kv_cache_memory=4 << 20).generate([prompt], SamplingParams(max_tokens=12, temperature=0))
    assert ours.outputs[0].token_ids == expected.tolist()
    # and it composes with what comes after it: quantized, it still serves with one KV head
    assert main(["rtn", "--model", str(out), "--bits", "8", "--group-size", "32", "--out", str(tmp_path / "q")]) == 0
    llm = LLM(str(tmp_path / "q"), kv_cache_memory=4 << 20)
    assert llm.engine.runner.model.config.num_key_value_heads == 1
    assert len(llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "flags,fragment",
    [
        (["--kv-heads", "3"], "does not divide the 4 query heads"),
        (["--kv-heads", "4"], "add --expand to repeat them"),
        (["--kv-heads", "4", "--expand", "--uptrain-tokens", "100"], "--expand is exact"),
        (["--kv-heads", "1", "--uptrain-tokens", "100"], "less than one global batch"),
        (["--kv-heads", "1", "--uptrain-tokens", "100000000"], "but the text gives"),
        (["--kv-heads", "1", "--uptrain-tokens", "4096", "--train", "nothing_like_this"], "matches no parameter"),
        (["--kv-heads", "1", "--uptrain-tokens", "256", "--lr", "0"], "--lr must be in (0, 1], got 0.0"),
        (["--kv-heads", "1", "--uptrain-tokens", "256", "--temperature", "-1"], "--temperature must be > 0, got -1.0"),
        (
            ["--kv-heads", "2", "--uptrain-tokens", "512", "--global-batch", "2", "--micro-batch", "1"],
            "training diverged at step 4",
        ),
    ],
)
def test_the_command_names_what_cannot_work(capsys, tiny_llama, calib_txt, tmp_path, monkeypatch, flags, fragment):
    from slimlm.cli import main
    from tests.train.test_distill import explode_at_the_third_step

    explode_at_the_third_step(monkeypatch)  # only the diverging case trains that far

    text = ["--calib", str(calib_txt), "--train-data", str(calib_txt), "--eval-data", str(calib_txt)]
    code = main(["gqa", "--model", str(tiny_llama), *text, "--seq-len", "32", *flags, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_an_out_that_is_the_source_is_refused_before_any_work(capsys, tiny_llama):
    from slimlm.cli import main

    before = sorted(p.name for p in tiny_llama.iterdir())
    assert main(["gqa", "--model", str(tiny_llama), "--kv-heads", "1", "--out", str(tiny_llama), "--overwrite"]) == 2
    assert "is or contains the source model" in capsys.readouterr().err
    assert sorted(p.name for p in tiny_llama.iterdir()) == before


def test_a_bf16_source_trained_in_fp32_is_written_back_in_bf16(tiny_llama, calib_txt, tmp_path):
    """The student trains in fp32 (AdamW's small steps need it) but the checkpoint keeps the source's dtype:
    the 1.5B's bf16 source came back as a 7 GB fp32 checkpoint before."""
    from safetensors import safe_open

    from slimlm.cli import main

    source = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (source / name).write_bytes((tiny_llama / name).read_bytes())
    out = tmp_path / "mqa"
    text = ["--calib", str(calib_txt), "--train-data", str(calib_txt), "--eval-data", str(calib_txt)]
    flags = [
        "--kv-heads",
        "1",
        "--seq-len",
        "32",
        "--uptrain-tokens",
        "512",
        "--global-batch",
        "4",
        "--micro-batch",
        "2",
    ]
    assert main(["gqa", "--model", str(source), *text, *flags, "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "slimlm.json").read_text())["training"]["log"][-1]["step"] == 4
