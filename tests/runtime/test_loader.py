"""Every checkpoint family the runtime serves gives the logits of the model it encodes."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from slimlm import SlimlmError, models
from slimlm.compress.gptq import GPTQ
from slimlm.compress.job import CalibData, Quantization, quantize_weights
from slimlm.compress.rtn import RTN
from slimlm.formats import reader
from slimlm.formats.quantized import QuantArgs
from slimlm.runtime.llm import LLM
from slimlm.runtime.sampling import SamplingParams
from tests.conftest import make_text, make_tiny_llama, make_tokenizer
from tests.formats.test_awq_gemm import pack_awq_gemm
from tests.runtime.conftest import model_logprobs, next_token_logprobs, transformers_greedy

FIXTURES = Path(__file__).parent.parent / "fixtures"


def runtime_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    out = LLM(str(model_dir)).generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor(out.prompt_logprobs)


def ids_for(model_dir: Path, n: int = 40) -> list[int]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def tiny(path: Path, kind: str, **sizes) -> Path:
    """A tiny random model of `kind`, its biases drawn large; `sizes` override the config's widths and depth."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    tok = make_tokenizer()
    common = (
        dict(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        | sizes
    )
    config = {
        "qwen2": lambda: Qwen2Config(**common, tie_word_embeddings=False),  # q/k/v biases, separate lm_head
        # q and k RMS-normed per head before RoPE; head_dim its own (Qwen3's is 128 at every size)
        "qwen3": lambda: Qwen3Config(**common, head_dim=32, tie_word_embeddings=False),
        "mistral": lambda: MistralConfig(**common, sliding_window=128, head_dim=24),  # head_dim != hidden/heads
        "llama-rope-scaled": lambda: LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    }[kind]()
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # transformers zero-initialises biases and sets norms to 1; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral", "llama-rope-scaled"])
def test_architectures_match_transformers(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    model_dir = tiny(tmp_path / kind, kind)
    ids = ids_for(model_dir, 100)
    expected = model_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), ids)
    assert torch.allclose(runtime_logprobs(model_dir, ids), expected, atol=1e-5)


@pytest.fixture(scope="module")
def calibrated(tiny_llama):
    (tiny_llama.parent / "calib.txt").write_text(make_text(100))
    return tiny_llama


def quantize(src: Path, out: Path, method: str, args: QuantArgs, **kw) -> Path:
    impl = {"rtn": lambda: RTN(args), "gptq": lambda: GPTQ(args, act_order=kw.pop("act_order", None))}[method]()
    calib = CalibData(str(src.parent / "calib.txt"), 4, 32)
    return quantize_weights(Quantization(method, [impl], args, str(src), out, calib, **kw), progress=False)


def test_an_untied_embedding_keeps_its_narrower_stored_dtype(tmp_path):
    """A bf16 checkpoint served in fp32: the embedding table stays bf16 (half the bytes; a lookup converts the
    few rows it reads, exactly), every other weight is fp32, and the logits are the fp32 model's."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny(tmp_path / "qwen2", "qwen2")
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "bf16")
    shutil.copy(model_dir / "tokenizer_config.json", tmp_path / "bf16")
    llm = LLM(str(tmp_path / "bf16"), dtype="float32")
    model = llm.engine.runner.model
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert {p.dtype for n, p in model.named_parameters() if "embed_tokens" not in n} == {torch.float32}
    ids = ids_for(model_dir, 60)
    expected = model_logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32), ids)
    got = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    assert torch.allclose(torch.tensor(got), expected, atol=1e-5)


def test_scored_prompts_are_exact_and_other_steps_quantize_x_on_avx2(calibrated, tmp_path, monkeypatch):
    """AVX2's int8 loop runs every step but those of prompts whose log-probabilities are asked for: those are
    transformers' (to the fp16 scales' accuracy, as on any CPU), while plain prompts and every decode step,
    batched or not, multiply x̂."""
    from transformers import AutoModelForCausalLM

    from tests.kernels.problems import haswell_library

    out = quantize(calibrated, tmp_path / "w4", "rtn", QuantArgs(4, 32, True))
    lib = haswell_library(monkeypatch)
    ids = ids_for(out)
    llm = LLM(str(out))
    got = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    assert "slimlm_quant_matmul_i8" not in lib.calls and "slimlm_quant_matmul" in lib.calls  # the fused loop
    expected = model_logprobs(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), ids)
    assert torch.allclose(torch.tensor(got), expected, atol=2e-3)
    lib.calls = []
    llm.generate([ids[:5]] * 30, SamplingParams(max_tokens=3, temperature=0))  # decode steps of 30 sequences
    assert "slimlm_quant_matmul_i8" in lib.calls
    fresh = LLM(str(out), prefix_caching=False)
    lib.calls = []
    fresh.generate([ids], SamplingParams(max_tokens=1))  # one prompt step, nothing scored: x̂ there too
    assert "slimlm_quant_matmul_i8" in lib.calls and lib.calls.count("slimlm_quant_matmul") == 1  # the float head


def test_exact_activations_give_transformers_tokens_on_avx2(calibrated, tmp_path, monkeypatch):
    """activations="exact": no step quantizes x, decode steps included, so greedy text is the checkpoint's as
    transformers computes it; the engine says which arithmetic runs."""
    from transformers import AutoModelForCausalLM

    from tests.kernels.problems import haswell_library

    out = quantize(calibrated, tmp_path / "w4", "rtn", QuantArgs(4, 32, True))
    lib = haswell_library(monkeypatch)
    ids = ids_for(out, 12)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    exact = LLM(str(out), dtype="float32", activations="exact")
    got = exact.generate([ids], greedy)[0].outputs[0].token_ids
    assert "slimlm_quant_matmul_i8" not in lib.calls and "slimlm_quant_matmul" in lib.calls
    assert exact.engine.arithmetic() == "cpu kernels, float32, exact"
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert got == transformers_greedy(hf, ids, 12)
    fast = LLM(str(out), dtype="float32")
    assert fast.engine.arithmetic().startswith("cpu kernels, float32, int8 activations")
    lib.calls = []
    fast.generate([ids], greedy)
    assert "slimlm_quant_matmul_i8" in lib.calls
    with pytest.raises(SlimlmError, match="activations 'int8' is not one of auto, exact"):
        LLM(str(out), activations="int8")


@pytest.mark.parametrize("scored_from", [1, 40])  # echo with logprobs; an eval continuation after 39 tokens
def test_a_scored_prompt_after_the_same_plain_prompt_is_still_exact(calibrated, tmp_path, monkeypatch, scored_from):
    """The plain prompt's KV (int8 loop) is in the prefix cache when the same prompt comes back scored: the
    scored one takes none of those blocks, and its log-probabilities are a fresh engine's, bit for bit."""
    from tests.kernels.problems import haswell_library

    out = quantize(calibrated, tmp_path / "w4", "rtn", QuantArgs(4, 32, True))
    haswell_library(monkeypatch)
    ids = ids_for(out, 48)
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_from=scored_from)
    llm = LLM(str(out))
    llm.generate([ids], SamplingParams(max_tokens=4))
    again = llm.generate([ids], scored)[0]
    assert again.num_cached_tokens == 0
    assert again.prompt_logprobs == LLM(str(out)).generate([ids], scored)[0].prompt_logprobs
    shared = scored_from - 1  # the positions before the first scored one: 0 or 39
    assert llm.generate([ids], scored)[0].num_cached_tokens == shared  # scored prompts share among themselves


def test_avx2_w4_greedy_text_does_not_depend_on_the_batch(smollm2, tmp_path, monkeypatch):
    """Every step but a scored prompt's takes the int8 loop, whose rows do not see each other: a prompt's greedy
    continuation alone is its continuation among seven others of other lengths, prefilled in one step, to the
    last bit of every log-probability. On `compress rtn`'s default checkpoint (W4 g64, 8-bit head); with
    prompts run exact, the fused loop alone and fp32 slices among the others gave SmolLM2 another text."""
    from slimlm.compress.job import Quantization, quantize_weights
    from slimlm.compress.rtn import RTN
    from tests.kernels.problems import haswell_library

    args = QuantArgs(4, 64, True)
    out = quantize_weights(
        Quantization("rtn", [RTN(args)], args, str(smollm2), tmp_path / "w4", lm_head_bits=8, report_error=False),
        progress=False,
    )
    haswell_library(monkeypatch)
    g = torch.Generator().manual_seed(1)
    others = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 19, 33, 50, 3, 28, 61)]
    prompts = [ids_for(out, 20), *others]  # alone: 20 rows, under FUSED_MAX_ROWS_AVX2
    greedy = SamplingParams(max_tokens=16, temperature=0, logprobs=0)
    alone = LLM(str(out), prefix_caching=False).generate([prompts[0]], greedy)[0].outputs[0]
    together = LLM(str(out), prefix_caching=False).generate(prompts, greedy)[0].outputs[0]
    assert together.token_ids == alone.token_ids and together.logprobs == alone.logprobs  # bit for bit


@pytest.mark.parametrize(
    "method,args,kw",
    [
        ("rtn", QuantArgs(4, 32, True), {}),
        ("rtn", QuantArgs(4, 32, False), {}),  # asymmetric: packed zero points (AWQ's default)
        ("rtn", QuantArgs(4, -1, False), {}),
        ("rtn", QuantArgs(4, 32, False), {"lm_head_bits": 8}),  # the head in its own config group
        ("rtn", QuantArgs(8, -1, True), {"lm_head_bits": 8}),
        ("rtn", QuantArgs(8, 32, False), {}),
        pytest.param(
            "rtn",
            QuantArgs(3, 32, False),
            {},
            marks=pytest.mark.xfail(
                strict=True,
                reason="compressed-tensors < 0.18 packs 3 bits ten to a word (slimlm, vLLM and 0.18+ pack them "
                "densely), and 0.18-0.20.1 refuse asymmetric zero points: no version reads both (docs/limits.md)",
            ),
        ),
        ("rtn", QuantArgs(2, 32, True), {}),
        ("gptq", QuantArgs(4, 32, True), {"act_order": "group"}),  # g_idx
    ],
    ids=[
        "w4g32",
        "w4g32-asym",
        "w4-channel-asym",
        "w4g32-asym-head8",
        "w8-head8",
        "w8g32-asym",
        "w3g32-asym",
        "w2g32",
        "w4-act-order-group",
    ],
)
def test_transformers_loads_every_scheme_and_gives_the_runtimes_logits(calibrated, tmp_path, method, args, kw):
    """transformers (through compressed-tensors, the versions pyproject allows) reads every scheme slimlm writes,
    asymmetric ones included (compressed-tensors 0.18-0.20.1 refuse those: docs/limits.md), but 3 bits."""
    from transformers import AutoModelForCausalLM

    out = quantize(calibrated, tmp_path / "q", method, args, **kw)
    ids = ids_for(out)
    expected = model_logprobs(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), ids)
    got = runtime_logprobs(out, ids)
    # the kernel layout keeps scales in fp16 (transformers uses the checkpoint's fp32): ~1e-4 relative per weight
    assert torch.allclose(got, expected, atol=2e-3)


@pytest.mark.parametrize(
    "method,args,kw",
    [
        ("rtn", QuantArgs(4, 32, False), {}),
        ("rtn", QuantArgs(8, -1, True), {}),
        ("gptq", QuantArgs(4, 32, True), {"act_order": "group"}),  # g_idx: columns permuted at load
        ("gptq", QuantArgs(4, 32, True), {"fmt": "gptq"}),
        ("rtn", QuantArgs(3, 32, True), {}),  # 2 and 3 bits: widened to the 4-bit kernels
        ("rtn", QuantArgs(2, 32, False), {}),
    ],
    ids=["ct-w4g32-asym", "ct-w8-channel", "ct-w4-act-order-group", "gptq-v1-w4g32", "ct-w3g32", "ct-w2g32-asym"],
)
def test_quantized_layouts_match_their_dequantized_model(calibrated, tmp_path, method, args, kw):
    out = quantize(calibrated, tmp_path / "q", method, args, **kw)
    ids = ids_for(out)
    expected = model_logprobs(models.load(str(out))[0], ids)
    got = runtime_logprobs(out, ids)
    assert torch.allclose(got, expected, atol=2e-3)


@pytest.mark.parametrize("name", ["llmcompressor-gptq-w4g32-sym", "llmcompressor-gptq-w4g32-asym"])
def test_llmcompressor_checkpoints_serve(name):
    from safetensors.torch import load_file

    ref = load_file(FIXTURES / name / "reference.safetensors")  # llm-compressor's own logits
    ids = ref["input_ids"][0].tolist()
    expected = next_token_logprobs(ref["logits"][0], ids)
    assert torch.allclose(runtime_logprobs(FIXTURES / name, ids), expected, atol=2e-3)


def test_awq_gemm_checkpoint_serves(calibrated, tmp_path):
    ct = quantize(calibrated, tmp_path / "ct", "rtn", QuantArgs(4, 32, False))
    quantized, rest = reader.read_checkpoint(ct)
    tensors = dict(rest)
    for name, q in quantized.items():
        tensors[f"{name}.qweight"] = pack_awq_gemm((q.codes.to(torch.int16) + 8).T.contiguous())
        tensors[f"{name}.qzeros"] = pack_awq_gemm((q.zero.to(torch.int16) + 8).T.contiguous())
        tensors[f"{name}.scales"] = q.scale.T.half().contiguous()
    awq = tmp_path / "awq"
    awq.mkdir()
    for f in ct.iterdir():
        if f.suffix != ".safetensors" and f.name != "slimlm.json":
            shutil.copy(f, awq / f.name)
    save_file(tensors, awq / "model.safetensors")
    config = json.loads((ct / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
    }
    (awq / "config.json").write_text(json.dumps(config))
    ids = ids_for(ct)
    expected = model_logprobs(models.load(str(ct))[0], ids)
    assert torch.allclose(runtime_logprobs(awq, ids), expected, atol=2e-3)


@pytest.mark.parametrize(
    "qcfg,message",
    [
        ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "version gemv"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {
                        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "int"},
                    }
                },
            },
            "activation quantization",
        ),
    ],
    ids=["unknown-method", "awq-gemv", "w8a8"],
)
def test_unservable_quantization_is_named(tiny_llama, tmp_path, qcfg, message):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_llama, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = qcfg
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(SlimlmError, match=message):
        LLM(str(model_dir))


def test_release_freed_hands_freed_tensors_back_to_the_os():
    """Weights replaced at load (joined, packed) free memory inside malloc's heap, which keeps it resident
    until release_freed: here 60 freed 2 MB tensors below a live one, in a fresh process."""
    import subprocess
    import sys

    script = """
import torch
from pathlib import Path
from slimlm.runtime.loader import release_freed
def rss():
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith("VmRSS")).split()[1])
big = torch.ones(1 << 21)
del big  # freeing an 8 MB mapping raises malloc's threshold: 2 MB ones come from the heap now
held = [torch.ones(1 << 19) for _ in range(60)]
last = torch.ones(1 << 19)  # lies above them: the heap's top cannot shrink
del held
before = rss()
release_freed()
print(before - rss())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert int(out) > 100_000  # KiB: most of the 120 MB freed


def test_loading_a_w4_checkpoint_peaks_near_its_size(tmp_path):
    """Each linear is repacked as it is read (reader.read_checkpoint's convert), so the load's peak is the
    file plus one linear's codes, not the file plus every linear's unpacked codes (3.2× the file before; the
    issue's target is 1.3×). Measured in a fresh process on a second load, after the first paged in the
    libraries, from a reset peak."""
    import subprocess
    import sys

    from slimlm.cli import main

    source = make_tiny_llama(tmp_path / "deep", hidden=512, intermediate=2048, layers=32, tied=False)
    assert main(["rtn", "--model", str(source), "--out", str(tmp_path / "w4"), "--group-size", "128"]) == 0
    script = """
import sys
from pathlib import Path
import torch
from slimlm.perf.load import peak_reset, status
from slimlm.runtime import loader
d = Path(sys.argv[1])
loader.load_model(d, torch.float32, "cpu", 64)
loader.release_freed()
base = peak_reset()
model = loader.load_model(d, torch.float32, "cpu", 64)
print((status("VmHWM") - base) / (d / "model.safetensors").stat().st_size)
"""
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "w4")], capture_output=True, text=True, check=True
    ).stdout
    assert float(out) <= 1.3


@pytest.mark.parametrize(
    "command",
    [
        ["rtn", "--bits", "4", "--group-size", "32"],
        ["gptq", "--bits", "4", "--group-size", "32", "--num-samples", "4", "--seq-len", "32"],
        ["awq", "--bits", "4", "--group-size", "32", "--num-samples", "4", "--seq-len", "32", "--then", "gptq"],
        ["kv", "--kv-dtype", "int8", "--num-samples", "4", "--seq-len", "32"],
        ["gqa", "--kv-heads", "1", "--num-samples", "2"],
        ["prune", "--ffn", "64", "--heads", "2", "--num-samples", "2"],  # q/k norms: shared by every head, kept
    ],
    ids=lambda c: c[0],
)
def test_qwen3_compresses_loads_in_transformers_and_serves_its_logits(tmp_path, command):
    """Qwen3 (no asset on PyPI: a tiny random config): every compress command writes a checkpoint transformers
    loads, and the runtime's logprobs on it are transformers' (q and k normed per head, as its modules do)."""
    from transformers import AutoModelForCausalLM

    from slimlm.cli import main

    source = tiny(tmp_path / "qwen3", "qwen3")
    (tmp_path / "calib.txt").write_text(make_text(60))
    out = tmp_path / "out"
    where = [str(source)] if command[0] == "kv" else ["--model", str(source)]
    assert main([command[0], *where, *command[1:], "--calib", str(tmp_path / "calib.txt"), "--out", str(out)]) == 0
    ids = ids_for(out, 60)
    theirs = model_logprobs(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), ids)
    ours = LLM(str(out), dtype="float32", activations="exact", kv_cache_dtype="float32").generate(
        [ids], SamplingParams(max_tokens=1, prompt_logprobs=0)
    )[0]
    assert (torch.tensor(ours.prompt_logprobs) - theirs).abs().max() < 2e-3


def test_qwen3_greedy_decoding_is_transformers_token_for_token(tmp_path):
    """Decode steps too (Qwen3 decodes through the modules: the one-call C layer has no q/k norm)."""
    from transformers import AutoModelForCausalLM

    source = tiny(tmp_path / "qwen3", "qwen3")
    ids = ids_for(source, 12)
    llm = LLM(str(source), dtype="float32")
    assert llm.engine.runner.model.decode_stack is None
    got = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    assert got == transformers_greedy(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), ids, 16)
