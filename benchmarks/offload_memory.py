"""Peak memory of quantizing a model whose weights are far larger than one decoder layer.

Builds a random Llama (real shapes, random weights) on disk, then measures in separate processes:
  - `import`: the interpreter with torch/transformers/slimlm imported (the floor every run pays);
  - `load whole model`: transformers loading the float model, what a whole-model pipeline holds at least;
  - `compress rtn` / `compress gptq`: slimlm quantizing it, decoder layers read from disk one at a time.
Prints peak RSS above the import floor, as a fraction of the model's size.

    .venv/bin/python benchmarks/offload_memory.py [--layers 12 --hidden 2048 --intermediate 5632]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def peak_rss_gb(code_or_cmd: str | list[str]) -> float:
    cmd = [sys.executable, "-c", code_or_cmd] if isinstance(code_or_cmd, str) else code_or_cmd
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)[:120]} failed:\n{out[-2000:]}")
    return usage.ru_maxrss / 1e6


def make_model(path: Path, layers: int, hidden: int, intermediate: int) -> int:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(510)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    from tokenizers import pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(words), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_bytes = make_model(tmp / "model", a.layers, a.hidden, a.intermediate)
        (tmp / "calib.txt").write_text(
            "\n\n".join(" ".join(f"w{(i * 7 + j) % 500}" for j in range(200)) for i in range(64))
        )
        layer_bytes = (model_bytes - 2 * 512 * a.hidden * 4) / a.layers
        floor = peak_rss_gb("import torch, transformers, slimlm.cli, slimlm.compress.job")
        whole = peak_rss_gb(
            f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('{tmp / 'model'}')"
        )
        runs = {}
        for method in ("rtn", "gptq"):
            cmd = [sys.executable, "-m", "slimlm.cli", method, "--model", str(tmp / "model"), "--calib",
                   str(tmp / "calib.txt"), "--num-samples", "8", "--seq-len", "128", "--group-size", "128",
                   "--out", str(tmp / method)]  # fmt: skip
            runs[method] = peak_rss_gb(cmd)
        gb = model_bytes / 1e9
        print(
            f"model: {a.layers} layers, hidden {a.hidden}, {gb:.2f} GB float32 ({layer_bytes / 1e9:.3f} GB per layer)"
        )
        print(f"{'process':28}{'peak RSS GB':>12}{'above import':>14}{'÷ model size':>14}")
        print(f"{'import only':28}{floor:>12.2f}")
        for name, peak in [("load whole model (HF)", whole)] + [(f"compress {m}", v) for m, v in runs.items()]:
            print(f"{name:28}{peak:>12.2f}{peak - floor:>14.2f}{(peak - floor) / gb:>14.2f}")


if __name__ == "__main__":
    main()
