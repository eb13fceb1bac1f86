"""Does the budget's error proxy rank the model's linears as the real loss does?

For every unit of linears (q/k/v, o, gate/up, down of each decoder layer), the budget search predicts the
cost of a scheme by E = Σ (W − Ŵ)² · diag(H) / ‖h‖², the output error over the energy of the residual stream
it joins (slimlm/compress/mixed_precision.py). Here each unit alone is rounded to nearest at one scheme (the
rest of the model float) and the model's wiki loss is measured; the script prints the Spearman rank
correlation between E and the loss increase over all units, beside the same for the output error alone
(Σ (W − Ŵ)² · diag(H)) and for the weight error alone (Σ (W − Ŵ)²), and the units that cost the most.

    PYTHONPATH=. .venv/bin/python benchmarks/budget_proxy.py [--model smollm2-135m] [--scheme 2,64] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.quant_vs_peers import save_results
from slimlm import data, models
from slimlm.compress import mixed_precision, pipeline
from slimlm.compress.quantize import fake_quantize
from slimlm.formats.quantized import QuantArgs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--scheme", default="2,64", help="BITS,GROUP the units are rounded to")
    p.add_argument("--tokens", type=int, default=4096, help="wiki tokens the loss is measured on")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--rows", type=Path, help="only report the JSON rows an earlier run printed to this log")
    a = p.parse_args()
    bits, group = (int(v) for v in a.scheme.split(","))
    args = QuantArgs(bits, group, sym=False)
    if a.rows:
        rows = [json.loads(line) for line in a.rows.read_text().splitlines() if line.startswith('{"unit"')]
        report(rows, a, bits, group, f"wiki loss over {a.tokens} tokens")
        return

    model_dir = models.resolve(a.model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = models.load_tokenizer(model_dir)
    calib = data.calibration_windows("owt", tokenizer, mixed_precision.SENSITIVITY_WINDOWS, a.seq_len, 0)
    start = time.time()
    linears = pipeline.quantizable_linears(model)
    units = mixed_precision.sensitivity(linears, mixed_precision.fisher(model, calib), sym=False, bits=(bits,))
    seconds = time.time() - start
    inputs, stream = input_energies(model, calib)
    wiki = data.calibration_windows("wiki", tokenizer, a.tokens // a.seq_len, a.seq_len, 0)

    def loss() -> float:
        with torch.no_grad():
            return sum(model(w[None], labels=w[None]).loss.item() for w in wiki) / len(wiki)

    base = loss()
    print(f"float loss {base:.4f}; proxy in {seconds:.0f} s", flush=True)
    rows = []
    for unit in units:
        k = next(i for i, s in enumerate(unit.schemes) if s == args)
        saved = {n: model.get_submodule(n).weight.data.clone() for n in unit.names}
        plain = output = 0.0
        for n in unit.names:
            w = model.get_submodule(n).weight
            q = fake_quantize(w.data, args)
            plain += (w.data - q).square().sum().item()
            output += ((w.data - q).square() * inputs[n]).sum().item()
            w.data = q
        layer = int(unit.names[0].removeprefix("model.layers.").split(".")[0])
        rows.append(
            {
                "unit": unit.names[0],
                "fisher": unit.errors[k],
                "output": output,
                "relative": output / stream[layer],
                "plain": plain,
                "loss_increase": loss() - base,
            }
        )
        for n, w in saved.items():
            model.get_submodule(n).weight.data = w
        print(json.dumps(rows[-1]), flush=True)
    setting = f"wiki loss over {len(wiki) * a.seq_len} tokens (float {base:.4f}); proxy from "
    setting += f"{mixed_precision.SENSITIVITY_WINDOWS}×{a.seq_len} owt tokens in {seconds:.0f} s"
    report(rows, a, bits, group, setting)


def report(rows: list[dict], a: argparse.Namespace, bits: int, group: int, setting: str) -> None:
    truth = [r["loss_increase"] for r in rows]
    keys = ("fisher", "plain", "output", "relative")
    rho = {key: spearman([r[key] for r in rows], truth) for key in keys}
    by_loss = sorted(rows, key=lambda r: -r["loss_increase"])
    lines = [
        f"{a.model}: each of {len(rows)} units (q/k/v, o, gate/up, down per layer) alone rounded to nearest at "
        f"W{bits} g{group} asym, the rest float; {setting}.",
        "",
        "| proxy | Spearman rank correlation with the loss increase |",
        "|---|---|",
        f"| Σ F·(W − Ŵ)², F the loss's diagonal Fisher (the budget's) | {rho['fisher']:.3f} |",
        f"| Σ (W − Ŵ)² (weight error) | {rho['plain']:.3f} |",
        f"| Σ (W − Ŵ)² · diag(H), H GPTQ's Hessian (output error) | {rho['output']:.3f} |",
        f"| the output error over the residual stream's ‖h‖² | {rho['relative']:.3f} |",
        "",
        "The ten units that cost the most loss, with each proxy's rank (1 = predicted worst):",
        "",
        "| unit | loss increase | rank by Fisher | by weight error | by output error | by relative |",
        "|---|---|---|---|---|---|",
    ]
    rank = {key: {r["unit"]: i + 1 for i, r in enumerate(sorted(rows, key=lambda r: -r[key]))} for key in keys}
    for r in by_loss[:10]:
        u = r["unit"]
        ranks = " | ".join(str(rank[key][u]) for key in keys)
        lines.append(f"| {u} | {r['loss_increase']:+.4f} | {ranks} |")
    save_results(f"budget_proxy-{a.model}-w{bits}g{group}", "\n".join(lines), {"rows": rows})


def input_energies(model, calib: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[float]]:
    """diag(H) = 2/n Σ x² of every decoder linear's input, and the mean ‖h‖² per token of the residual stream
    entering each decoder layer."""
    sums: dict = {}

    def hook(key, per_column: bool):
        def record(_m, a, kwargs):
            x = (a[0] if a else kwargs["hidden_states"]).float().reshape(-1, a[0].shape[-1] if a else 1)
            acc = sums.setdefault(key, [0.0, 0])
            acc[0] = acc[0] + (x.square().sum(0) if per_column else x.square().sum().item())
            acc[1] += x.shape[0]

        return record

    handles = [
        layer.register_forward_pre_hook(hook(i, False), with_kwargs=True) for i, layer in enumerate(model.model.layers)
    ]
    handles += [
        m.register_forward_pre_hook(hook(n, True), with_kwargs=True)
        for n, m in pipeline.quantizable_linears(model).items()
    ]
    with torch.no_grad():
        for i in range(0, len(calib), 8):
            model(calib[i : i + 8])
    for h in handles:
        h.remove()
    stream = [sums[i][0] / sums[i][1] for i in range(len(model.model.layers))]
    return {n: 2 * v[0] / v[1] for n, v in sums.items() if isinstance(n, str)}, stream


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v: list[float]) -> torch.Tensor:
        return torch.tensor(v).argsort().argsort().double()

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


if __name__ == "__main__":
    main()
