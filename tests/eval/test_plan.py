"""The capacity and bandwidth model against hand-computed values: parameter counts (exact against
transformers' own models, with and without biases and tied heads), weight bytes with scales and zero
points, KV bytes, the bandwidth-only step, intensities, what fits, and the command's errors."""

from __future__ import annotations

import pytest

from slimlm.cli import main
from slimlm.eval import plan
from slimlm.formats import kv_int4, shards

# one layer, hand-sized: q/o 256×256, k/v 256×128, gate/up 256×512, down 512×256 = 589,824 linear weights
SMALL = plan.Dims(vocab=1000, hidden=256, heads=2, kv_heads=1, head_dim=128, ffn=512, layers=1, tied=True)
DEVICE = plan.Device("test", peak_flops=1e12, bandwidth=1e9, memory=2e7)


@pytest.mark.parametrize("model_type,tied", [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", False)])
def test_the_exact_count_is_transformers_count(model_type, tied):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=300,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        attention_bias=model_type == "llama" and not tied,
    )
    model = AutoModelForCausalLM.from_config(config)  # tiny: real weights (meta ones would not tie)
    dims = plan.Dims.from_config(config.to_dict())
    assert plan.parameters(dims)["total"] == sum(p.numel() for p in model.parameters())


def test_llama_8b_and_the_simplified_formula():
    p = plan.parameters(plan.MODEL_PRESETS["llama-3.1-8b"])
    assert p["total"] == 8_030_261_248  # the published count
    # 2VD + 3DFL + (2DNH + 2DKH)L, by hand: 2·128256·4096 + 3·4096·14336·32 + (2·4096·32·128 + 2·4096·8·128)·32
    assert p["simplified"] == 1_050_673_152 + 5_637_144_576 + 1_342_177_280
    assert p["total"] - p["simplified"] == 266_240  # the norms: (2·32 + 1)·4096


def test_weight_bytes_count_codes_scales_and_zero_points():
    linear = 589_824
    assert plan.weight_bytes(SMALL, plan.WeightFormat("bfloat16")) == 2 * plan.parameters(SMALL)["total"]
    others = plan.parameters(SMALL)["total"] - linear  # the tied embeddings and 3 norms, kept in bf16
    assert others == 256_000 + 3 * 256
    # groups of 128 along the input: q 256 rows·2 groups, k/v 128·2, o 256·2, gate/up 512·2, down 256·4
    groups = 256 * 2 + 2 * 128 * 2 + 256 * 2 + 2 * 512 * 2 + 256 * 4
    assert plan.weight_bytes(SMALL, plan.WeightFormat.parse("w4g128")) == linear // 2 + 2 * groups + 2 * others
    assert plan.weight_bytes(SMALL, plan.WeightFormat.parse("w4g128-asym")) == (linear // 2 + 2.5 * groups + 2 * others)
    rows = 256 + 128 + 128 + 256 + 512 + 512 + 256  # per channel: one scale per output row
    assert plan.weight_bytes(SMALL, plan.WeightFormat.parse("w8g-1")) == linear + 2 * rows + 2 * others


def test_kv_bytes_and_the_bandwidth_only_step():
    assert plan.kv_bytes_per_token(SMALL, "bf16") == 2 * 2 * 1 * 1 * 128
    assert plan.kv_bytes_per_token(plan.MODEL_PRESETS["llama-3.1-8b"], "fp8") == 2 * 32 * 8 * 128
    w = plan.WeightFormat("bfloat16")
    step = plan.decode_step(SMALL, w, "bf16", batch=4, context=100, device=DEVICE)
    weights = plan.weight_bytes(SMALL, w)  # tied: the step reads the whole table as the head
    assert step["kv_bytes"] == 4 * 100 * 512 and step["bytes_moved"] == weights + 204_800
    assert step["step_ms"] == pytest.approx(1e3 * (weights + 204_800) / 1e9)
    assert step["tokens_per_s"] == pytest.approx(4 / ((weights + 204_800) / 1e9))
    assert step["linear_intensity"] == pytest.approx(4.0)  # 2 FLOPs per 2-byte weight per token: B
    assert step["attention_intensity"] == pytest.approx(2.0)  # 2 query heads per KV head, 2 bytes
    assert step["compute_ms"] == pytest.approx(1e3 * 2 * 4 * (589_824 + 256_000) / 1e12)
    assert step["bound"] == "bandwidth" and step["roofline_tokens_per_s"] == step["tokens_per_s"]
    untied = plan.Dims(**{**SMALL.__dict__, "tied": False})
    assert plan.read_bytes(untied, w) == plan.weight_bytes(untied, w) - 2 * 256_000  # B rows, not the table


def test_a_4bit_cache_is_half_a_byte_per_value_and_its_scales_per_head_vector(tiny_llama):
    from slimlm.models import read_config
    from slimlm.runtime.engine import Engine, EngineConfig

    row = 128 // 2 + kv_int4.META_BYTES
    assert plan.kv_bytes_per_token(SMALL, "int4") == 2 * 1 * 1 * row  # K and V, a layer, a KV head
    step = plan.decode_step(SMALL, plan.WeightFormat("bfloat16"), "int4", batch=1, context=10, device=DEVICE)
    assert step["attention_intensity"] == pytest.approx(2 * 2 * 128 / row)  # 2 FLOPs per value per query head
    engine = Engine(str(tiny_llama), EngineConfig(kv_cache_dtype="int4", max_model_len=64, kv_cache_memory=1 << 20))
    assert (
        plan.kv_bytes_per_token(plan.Dims.from_config(read_config(tiny_llama)), "int4")
        == engine.runner.kv_bytes_per_token
    )  # what the runtime allocates


def test_what_fits_and_the_crossover():
    w = plan.WeightFormat("bfloat16")
    weights = plan.weight_bytes(SMALL, w)
    assert plan.max_batch(SMALL, weights, "bf16", 100, memory=weights + 3 * 51_200 + 1) == 3
    assert plan.max_batch(SMALL, weights, "bf16", 100, memory=weights - 1) == 0
    result = plan.plan(SMALL, w, "bf16", 100, [1, 400], [1, 2], DEVICE)
    assert result["crossover"] == 1000.0
    fits = [(r["kv_heads"], r["batch"], r["fits"]) for r in result["rows"]]
    assert fits == [(1, 1, True), (1, 400, False), (2, 1, True), (2, 400, False)]
    assert result["rows"][2]["kv_bytes"] == 2 * result["rows"][0]["kv_bytes"]


def test_a_kv_budget_caps_what_each_sequence_keeps():
    w = plan.WeightFormat("bfloat16")
    weights = plan.weight_bytes(SMALL, w)
    memory = weights + 3 * 51_200 + 1  # three sequences of 100 tokens
    device = plan.Device("test", peak_flops=1e12, bandwidth=1e9, memory=memory)
    full = plan.plan(SMALL, w, "bf16", 100, [4], [1], device)
    capped = plan.plan(SMALL, w, "bf16", 100, [4], [1], device, kv_budget=25)
    assert full["rows"][0]["max_batch"] == 3 and capped["rows"][0]["max_batch"] == 12
    assert capped["rows"][0]["kv_bytes"] == full["rows"][0]["kv_bytes"] // 4
    assert capped["rows"][0]["context"] == 100 and capped["rows"][0]["resident"] == 25
    assert capped["kv_bytes_per_request"] == 25 * 512 and full["kv_bytes_per_request"] == 100 * 512
    assert plan.plan(SMALL, w, "bf16", 100, [4], [1], device, kv_budget=500)["rows"] == full["rows"]


def test_the_command_prints_the_table_for_a_local_model_and_names_bad_input(tiny_llama, capsys):
    assert main(["plan", str(tiny_llama), "--weights", "w4g32", "--batch", "1,8", "--kv-heads", "2,1"]) == 0
    out = capsys.readouterr().out
    assert "parameters: " in out and "W4 groups of 32 sym" in out and len(out.splitlines()) == 10
    for args, fragment in [(["--kv-heads", "3"], "does not divide the 4"), (["--device", "tpu"], "--device tpu")]:
        assert main(["plan", str(tiny_llama), *args]) == 2
        assert fragment in capsys.readouterr().err
    for args, fragment in [
        (["--weights", "w5"], "argument --weights: use a float dtype"),
        (["--batch", "0"], "argument --batch: '0'"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(["plan", str(tiny_llama), *args])
        assert e.value.code == 2 and fragment in capsys.readouterr().err


def test_the_serving_roofline_by_hand():
    """One layer of 144 linear weights (q 16, k 8, v 8, o 16, gate/up/down 32 each), vocab 10 × hidden 4.
    Requests (arrival, prompt, output): (0, 3, 2) and (0.5, 1, 4). Contexts: prompt tokens 1+2+3 and 1, decode
    tokens 4 and 2+3+4 (13, the KV tokens decode reads). Arithmetic 2·144·10 + 2·40·6 + 4·1·2·2·20 = 3680."""
    d = plan.Dims(vocab=10, hidden=4, heads=2, kv_heads=1, head_dim=2, ffn=8, layers=1)
    requests = [(0.0, 3, 2), (0.5, 1, 4)]
    r = plan.serving_roofline(
        d, requests, max_seqs=2, read_bytes=100, kv_bytes_per_token=10, peak_flops=3680, bandwidth=265
    )
    assert r["flops"] == 3680 and r["steps"] == 4 and r["bytes"] == 4 * 100 + 13 * 10  # the longest output: 4 steps
    assert (r["compute_s"], r["memory_s"], r["arrivals_s"]) == (1.0, 2.0, 0.5)
    assert r["bound"] == "bandwidth" and r["time_s"] == 2.0 and r["output_tok_s"] == 3.0
    one_at_a_time = plan.serving_roofline(d, requests, 1, 100, 10, 3680, 265)
    assert one_at_a_time["steps"] == 6 and one_at_a_time["bytes"] == 730  # six outputs, one sequence per step
    three = plan.serving_roofline(d, [(0.0, 1, 3), (0.0, 1, 2), (0.0, 1, 2)], 2, 100, 10, 3680, 265)
    assert three["steps"] == 4  # ⌈7 outputs / 2 per step⌉, more than the longest output's 3
    fast = plan.serving_roofline(d, requests, 2, 100, 10, 1e9, 1e9)
    assert fast["bound"] == "arrivals" and fast["output_tok_s"] == 12.0
    slow = plan.serving_roofline(d, requests, 2, 100, 10, 368, 1e9)
    assert slow["bound"] == "compute" and slow["time_s"] == pytest.approx(10.0)


def test_the_matmul_rate_is_plausible():
    assert 1e8 < plan.matmul_rate("float32", "cpu", 256, seconds=0.05) < 1e14


def test_the_cpu_probe_measures_something_plausible():
    device = plan.probe_cpu(seconds=0.05)
    assert 1e8 < device.bandwidth < 1e12 and 1e8 < device.peak_flops < 1e14 and device.memory > 1e9


def test_predicted_against_a_bench_run(tiny_llama, tmp_path, capsys):
    from slimlm import models
    from slimlm.perf import bench
    from slimlm.perf.config import BenchConfig

    config = BenchConfig(
        batch=[1, 2],
        context=32,
        prefill_len=16,
        steps=2,
        kv_cache_memory=4 << 20,
        requests=2,
        rate=50.0,
        prompt_len=(8, 12),
        output_len=(2, 3),
    )
    result = bench.bench(str(tiny_llama), None, config, progress=False)
    path = tmp_path / "bench.json"
    path.write_text(__import__("json").dumps(result))
    rows = plan.against_bench(result, models.read_config(tiny_llama), tiny_llama)
    dims = plan.Dims.from_config(models.read_config(tiny_llama))
    expected = plan.read_bytes(dims, plan.WeightFormat("float32")) + 2 * 32 * plan.kv_bytes_per_token(dims, "fp32")
    assert rows[1]["predicted_ms"] == pytest.approx(1e3 * expected / result["bandwidth_bytes_s"])
    assert rows[1]["ratio"] == pytest.approx(
        result["systems"]["model"]["offline"]["decode"][1]["step_ms"] / rows[1]["predicted_ms"]
    )
    assert main(["plan", str(tiny_llama), "--bench", str(path)]) == 0
    assert "measured/predicted" in capsys.readouterr().out
    assert main(["plan", str(tiny_llama), "--bench", str(tmp_path / "missing.json")]) == 2


def test_the_format_a_checkpoint_config_describes():
    ct = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "config_groups": {
                "group_0": {"weights": {"num_bits": 4, "group_size": 64, "strategy": "group", "symmetric": False}}
            },
        }
    }
    assert plan.weight_format_of(ct, "bfloat16") == plan.WeightFormat("bfloat16", 4, 64, False)
    channel = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "config_groups": {
                "group_0": {"weights": {"num_bits": 8, "group_size": None, "strategy": "channel", "symmetric": True}}
            },
        }
    }
    assert plan.weight_format_of(channel, "float32") == plan.WeightFormat("float32", 8, -1, True)
    assert plan.weight_format_of({}, "float32") == plan.WeightFormat("float32")


def test_a_budget_plans_the_layout_the_quantization_writes(tiny_llama, calib_txt, tmp_path, capsys):
    """`plan --budget` chooses what `rtn --budget` chooses (same Fisher windows, same knapsack), counts the bytes
    the written checkpoint stores for its linears, and `plan CHECKPOINT` reads those bytes back from the files."""
    import json

    from slimlm.jobs import RTN

    data = ["--calib", str(calib_txt), "--seq-len", "32", "--asym"]
    assert main(["plan", str(tiny_llama), "--budget", "4.5", *data, "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    planned = json.loads((tmp_path / "p.json").read_text())
    written = RTN(
        model=str(tiny_llama),
        calib=str(calib_txt),
        num_samples=16,
        seq_len=32,
        out=tmp_path / "q",
        budget=4.5,
        sym=False,
    ).run()
    meta = json.loads((written / "slimlm.json").read_text())["budget"]
    assert planned["weights"]["linear_bytes"] == meta["bytes"] and len(set(meta["schemes"].values())) > 1
    for layer in range(2):  # a row per decoder layer, each unit's scheme as written
        local = {n.split(".", 3)[3]: s for n, s in meta["schemes"].items() if n.startswith(f"model.layers.{layer}.")}
        row = [local["self_attn.q_proj"], local["self_attn.o_proj"], local["mlp.gate_proj"], local["mlp.down_proj"]]
        assert f"{layer:>5} " + " ".join(f"{s:>13}" for s in row) in out
    assert main(["plan", str(written), "--json", str(tmp_path / "c.json")]) == 0
    stored = json.loads((tmp_path / "c.json").read_text())
    assert stored["weights"]["linear_bytes"] == meta["bytes"] and "mixed: " in capsys.readouterr().out
    head = sum(v for k, v in shards.tensor_bytes(written).items() if k.startswith("lm_head."))
    assert stored["weights"]["head_bytes"] == head > 0  # the 8-bit head as stored, not a float one
    for args, fragment in [
        (["llama-3.1-8b", "--budget", "4"], "give a checkpoint, not the preset llama-3.1-8b"),
        ([str(tiny_llama), "--budget", "4", "--weights", "w4"], "names the float dtype of the other tensors"),
        ([str(tiny_llama), "--budget", "4", "--kv-heads", "1"], "--kv-heads changes the linears' shapes"),
        ([str(tiny_llama), "--budget", "4", "--size", "1G"], "--size and --budget both set the size"),
    ]:
        assert main(["plan", *args]) == 2
        assert fragment in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plan", str(tiny_llama), "--budget", "1"])
    assert e.value.code == 2 and "must be between 2" in capsys.readouterr().err
