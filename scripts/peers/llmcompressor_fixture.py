"""Write small checkpoints with llm-compressor, for tests/compress/test_peer_checkpoints.py.

Runs in llm-compressor's own venv (it pins other transformers/compressed-tensors versions than slimlm):
    python3 -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1 'transformers==5.17.*'
    /tmp/llmc/bin/python scripts/peers/llmcompressor_fixture.py tests/fixtures
Each output directory also holds reference.safetensors: fixed input ids and the logits of llm-compressor's
own fake-quantized model, computed before it compressed and saved the checkpoint.
"""

import shutil
import sys
from pathlib import Path

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from safetensors.torch import save_file
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """128 made-up words, one id each: enough for llm-compressor, which insists on a processor."""
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def main(out_root: Path) -> None:
    g = torch.Generator().manual_seed(0)
    calib = Dataset.from_dict({"input_ids": torch.randint(0, 128, (16, 64), generator=g).tolist()})
    probe = torch.randint(0, 128, (2, 32), generator=g)
    for name, sym in [("llmcompressor-gptq-w4g32-sym", True), ("llmcompressor-gptq-w4g32-asym", False)]:
        src = out_root / f".{name}-source"
        tiny_llama(seed=1).save_pretrained(src)
        word_tokenizer().save_pretrained(src)
        weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": 32}
        recipe = GPTQModifier(config_groups={"g": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"])
        model = oneshot(model=str(src), dataset=calib, recipe=recipe, num_calibration_samples=16, max_seq_length=64)
        with torch.no_grad():
            logits = model(probe).logits
        out = out_root / name
        model.save_pretrained(out, save_compressed=True)
        word_tokenizer().save_pretrained(out)
        shutil.rmtree(src)
        save_file({"input_ids": probe, "logits": logits.contiguous()}, out / "reference.safetensors")
        print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
