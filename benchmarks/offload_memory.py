"""Peak memory of quantizing a model whose weights are far larger than one decoder layer.

Builds a random Llama (real shapes, random weights) on disk, then, each in a fresh process, measures the
peak RSS a job adds over the process's resident size just before it starts (Linux clear_refs resets the
peak mark; a warm-up run first pays the one-time lazy imports, whose transient peak is not the job's, and
what it freed is handed back to the OS before the baseline is read). Each job runs twice: with glibc as it
comes (what a user sees: freed blocks are kept for reuse, by an amount that varies between runs) and with
a fixed low mmap threshold (MALLOC_MMAP_THRESHOLD_=65536), where the peak RSS is what the job holds live:
  - load whole model: transformers loads the float model and reads every weight, the least any
    whole-model pipeline holds (the baseline);
  - compress rtn / gptq: slimlm, decoder layers read from disk one at a time.

    .venv/bin/python benchmarks/offload_memory.py [--layers 12 --hidden 2048 --intermediate 5632]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
import sys
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
def measure(job):
    from slimlm.compress.memory import return_freed_memory
    job("warmup")
    return_freed_memory()
    open("/proc/self/clear_refs", "w").write("5")
    before = status("VmRSS")
    job("measured")
    print("GROWTH", status("VmHWM") - before)
model, calib, out, kind = sys.argv[1:5]
if kind == "whole":
    from transformers import AutoModelForCausalLM
    def job(tag):
        m = AutoModelForCausalLM.from_pretrained(model)
        print(sum(float(p.double().sum()) for p in m.parameters()))
else:
    from slimlm.compress.gptq import GPTQ
    from slimlm.compress.job import CalibData, Quantization, quantize_weights
    from slimlm.formats.quantized import QuantArgs
    from slimlm.compress.rtn import RTN
    args = QuantArgs(4, 128, True)
    def job(tag):
        method = RTN(args) if kind == "rtn" else GPTQ(args)
        quantize_weights(Quantization(kind, [method], args, model, f"{out}-{tag}", CalibData(calib, 8, 128)),
                         progress=False)
measure(job)
"""


def growth_gb(model: Path, calib: Path, out: Path, kind: str, live: bool) -> float:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"} if live else None
    argv = [sys.executable, "-c", PROBE, str(model), str(calib), str(out), kind]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("GROWTH")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-2000:]}")
    return int(lines[-1].split()[1]) / 1e9


def make_model(path: Path, layers: int, hidden: int, intermediate: int) -> tuple[int, int]:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(510)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(words),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    size = lambda mod: sum(p.numel() * p.element_size() for p in mod.parameters())  # noqa: E731
    return size(model), size(model.model.layers[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_bytes, layer_bytes = make_model(tmp / "model", a.layers, a.hidden, a.intermediate)
        calib = tmp / "calib.txt"
        calib.write_text("\n\n".join(" ".join(f"w{(i * 7 + j) % 500}" for j in range(200)) for i in range(64)))
        kinds = {"load whole model (HF)": "whole", "compress rtn (slimlm)": "rtn", "compress gptq (slimlm)": "gptq"}
        runs = {
            name: [growth_gb(tmp / "model", calib, tmp / f"{kind}-{live}", kind, live) for live in (False, True)]
            for name, kind in kinds.items()
        }
    gb = model_bytes / 1e9
    print(
        f"model: {a.layers} layers, hidden {a.hidden}, intermediate {a.intermediate}: {gb:.2f} GB float32, "
        f"{layer_bytes / 1e9:.3f} GB per decoder layer"
    )
    print("peak RSS added, GB (÷ model size, ÷ one layer): glibc as it comes | live (fixed mmap threshold)")
    whole = runs["load whole model (HF)"]
    for name, pair in runs.items():
        cells = [f"{g:7.3f} ({g / gb:.2f}, {g * 1e9 / layer_bytes:4.1f})" for g in pair]
        print(f"{name:26}{cells[0]:>24} | {cells[1]:>24}   ÷ whole-model load: {pair[1] / whole[1]:.2f}")


if __name__ == "__main__":
    main()
