"""Quantize a model with Intel's AutoRound on given calibration token windows. Runs in AutoRound's venv.

    python autoround_run.py --model DIR --calib ids.safetensors --bits 4 --group-size 64 [--asym]
        [--iters 200] [--lr LR] --out DIR

The windows go in as they are (batches of token ids, 8 windows a batch as AutoRound's default), so AutoRound
calibrates on exactly the tokens slimlm does. The result is written in llm-compressor's format
(compressed-tensors), which slimlm's runtime reads for the perplexity. Called by benchmarks/quant_vs_peers.py,
which measures wall time and peak memory from outside.
"""

import argparse
import shutil
from pathlib import Path

import torch
from auto_round import AutoRound
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--calib", required=True)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--asym", action="store_true")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--lr", type=float, default=None, help="default: AutoRound's (1/iters)")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    ids = load_file(a.calib)["input_ids"]
    batch = 8
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    rounder = AutoRound(
        model,
        tokenizer,
        bits=a.bits,
        group_size=a.group_size,
        sym=not a.asym,
        dataset=[ids[i : i + batch] for i in range(0, len(ids), batch)],
        nsamples=len(ids),
        seqlen=ids.shape[1],
        batch_size=batch,
        iters=a.iters,
        lr=a.lr,
        device_map="cpu",
    )
    work = Path(a.out).with_name(Path(a.out).name + ".autoround")
    rounder.quantize_and_save(str(work), format="llm_compressor")
    made = next(p.parent for p in work.rglob("config.json"))  # AutoRound names a folder of its own inside
    shutil.move(str(made), a.out)
    shutil.rmtree(work, ignore_errors=True)
    tokenizer.save_pretrained(a.out)


if __name__ == "__main__":
    main()
