"""Shared fixtures: a tiny random Llama with its own tokenizer (fast tests) and the real default model (slow)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(1)
if not torch.cuda.is_available():  # Triton kernels run in its interpreter (must be set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or has had not "
    "first new one two city river music school team war state year film album game people world church house "
    "government university company species population season series village built played released born"
).split()


def make_text(n_passages: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    passages = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))) + "." for _ in range(n_passages)]
    return "\n\n".join(passages)


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(make_text(200).split("\n\n"), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make_tiny_llama(
    path: Path, hidden: int = 64, intermediate: int = 96, layers: int = 2, seed: int = 0, tied: bool = True
) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def transformers_logits_error(checkpoint_dir: Path, seq_len: int = 24) -> float:
    """Relative error between transformers' logits on our checkpoint and our own dequantized model's."""
    from transformers import AutoModelForCausalLM

    from slimlm import models

    ours = models.load(str(checkpoint_dir))[0]
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32)
    x = torch.randint(0, ours.config.vocab_size, (2, seq_len))
    with torch.no_grad():
        a, b = theirs(x).logits, ours(x).logits
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def calib_txt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text(make_text(300, seed=1))
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from slimlm import assets

    return assets.fetch("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def smollm2_w4(smollm2, tmp_path_factory) -> Path:
    """The default model quantized RTN W4 g64 symmetric (a layout transformers can load too)."""
    from slimlm.compress.job import Quantization, quantize_weights
    from slimlm.compress.rtn import RTN
    from slimlm.formats.quantized import QuantArgs

    args = QuantArgs(4, 64, True)
    out = tmp_path_factory.mktemp("smol") / "rtn-w4g64"
    # RTN needs no data: as `compress rtn` does by default, no calibration pass
    return quantize_weights(
        Quantization("rtn", [RTN(args)], args, "smollm2-135m", out, report_error=False), progress=False
    )


@pytest.fixture(autouse=True, scope="session")
def fp32_runtime():
    """The runtime's default dtype, auto, is bf16 on CPUs with AVX-512 BF16 and fp32 on AVX2 ones, and CI's
    machines are of both kinds: the suite's parity tests compare against fp32 transformers, so in this process
    `auto` means fp32 whatever the machine (tests of auto itself take `machine_auto_dtype`; commands the tests
    run as subprocesses resolve it as the machine does)."""
    from slimlm.runtime import engine

    real = engine.activation_dtype
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            engine, "activation_dtype", lambda name, *rest: torch.float32 if name == "auto" else real(name, *rest)
        )
        yield real


@pytest.fixture
def machine_auto_dtype(fp32_runtime, monkeypatch):
    """The runtime's `auto` dtype as this machine resolves it (devices.fast_dtype), for tests of auto itself."""
    from slimlm.runtime import engine

    monkeypatch.setattr(engine, "activation_dtype", fp32_runtime)
