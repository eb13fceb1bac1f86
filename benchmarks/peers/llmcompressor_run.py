"""Quantize a model with llm-compressor on given calibration token windows. Runs in llm-compressor's venv.

    python llmcompressor_run.py --method gptq|awq --model DIR --calib ids.safetensors --bits 4 --group-size 64
        [--asym] [--act-order] --out DIR

Called by benchmarks/quant_vs_peers.py, which measures wall time and peak memory from outside.
"""

import argparse

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.awq import AWQModifier
from llmcompressor.modifiers.quantization import GPTQModifier
from safetensors.torch import load_file
from transformers import AutoTokenizer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", choices=["gptq", "awq"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--calib", required=True)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--asym", action="store_true")
    p.add_argument("--act-order", action="store_true")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    ids = load_file(a.calib)["input_ids"]
    calib = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    weights = {"num_bits": a.bits, "type": "int", "symmetric": not a.asym}
    if a.group_size == -1:
        weights["strategy"] = "channel"
    else:
        weights.update(strategy="group", group_size=a.group_size)
    if a.act_order:
        weights["actorder"] = "weight"
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    if a.method == "gptq":
        recipe = GPTQModifier(config_groups=groups, ignore=["lm_head"], dampening_frac=0.01)
    else:
        # On CPU, llm-compressor's AWQ calls Tensor.pin_memory(), which needs an accelerator; make it a no-op.
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
        recipe = AWQModifier(config_groups=groups, ignore=["lm_head"])
    model = oneshot(
        model=a.model, dataset=calib, recipe=recipe, num_calibration_samples=len(ids), max_seq_length=ids.shape[1]
    )
    model.save_pretrained(a.out, save_compressed=True)
    AutoTokenizer.from_pretrained(a.model).save_pretrained(a.out)  # servable on its own (by the runtime too)


if __name__ == "__main__":
    main()
