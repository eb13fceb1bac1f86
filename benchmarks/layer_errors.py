"""Each decoder layer's output error, the KL divergence from the float model and the NLL, of quantized
checkpoints against their float model, through transformers on the same wiki windows: what a perplexity over a
truncated model (quant_vs_peers --layers) cannot show, since such a network's perplexity is near-uniform noise.

    .venv/bin/python benchmarks/layer_errors.py FLOAT_DIR QUANTIZED_DIR [QUANTIZED_DIR ...] [--windows 4]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from slimlm import data, models


def run(path: str, ids: torch.Tensor) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Per window: every layer's hidden states and the log-probabilities (fp32; one window at a time)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hidden, logprobs = [], []
    with torch.no_grad():
        for window in ids:
            out = model(window[None], output_hidden_states=True)
            hidden.append([h[0] for h in out.hidden_states[1:]])
            logprobs.append(torch.log_softmax(out.logits[0], -1))
    return hidden, logprobs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("float_model")
    p.add_argument("quantized", nargs="+")
    p.add_argument("--windows", type=int, default=4, help="wiki windows of 512 tokens")
    a = p.parse_args()
    ids = data.calibration_windows("wiki", models.load_tokenizer(a.float_model), a.windows, 512, 0)

    def nll(logprobs: list[torch.Tensor]) -> float:
        pairs = zip(logprobs, ids, strict=True)
        return sum(-lp[:-1].gather(-1, w[1:, None]).mean().item() for lp, w in pairs) / len(ids)

    ref_hidden, ref_logprobs = run(a.float_model, ids)
    print(f"{a.float_model}: NLL {nll(ref_logprobs):.4f} over {a.windows} wiki windows of 512 tokens")
    for path in a.quantized:
        hidden, logprobs = run(path, ids)
        errors = []
        for layer in range(len(hidden[0])):
            diff = sum((h[layer] - r[layer]).double().pow(2).sum() for h, r in zip(hidden, ref_hidden, strict=True))
            errors.append(diff / sum(r[layer].double().pow(2).sum() for r in ref_hidden))
        pairs = zip(ref_logprobs, logprobs, strict=True)
        kl = sum((r.exp() * (r - q)).sum(-1).mean().item() for r, q in pairs) / len(ids)
        print(
            f"{path}: layer output relative error {' '.join(f'{e.item():.2e}' for e in errors)}; "
            f"KL from float {kl:.4f}; NLL {nll(logprobs):.4f}"
        )


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
