"""Learned rounding's steps and windows against RTN and GPTQ on the same model, windows and evaluation text.

Each method quantizes the model through the same job code `compress` runs (float lm_head, as the peers
leave it), timed from the start of the job to the written checkpoint; each checkpoint's wiki perplexity is
measured by the runtime. Rows run one after another in this process, so the times compare only when
nothing else shares the machine.

    PYTHONPATH=. .venv/bin/python benchmarks/autoround_settings.py [--settings 100x2,100x4,200x4] \
        [--baselines rtn,gptq] [--bits 4 --group-size 64 --asym]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.quant_vs_peers import save_results
from slimlm.compress.autoround import AutoRound
from slimlm.compress.gptq import GPTQ
from slimlm.compress.job import CalibData, Quantization, quantize_weights
from slimlm.compress.rtn import RTN
from slimlm.formats.quantized import QuantArgs
from slimlm.jobs.measure import measure_perplexity


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--settings", default="100x2", help="ITERSxWINDOWS of learned rounding, comma-separated")
    p.add_argument("--baselines", default="rtn,gptq")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--asym", action="store_true")
    p.add_argument("--ppl-tokens", type=int, default=16384)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "slimlm-autoround-settings")
    a = p.parse_args()
    args = QuantArgs(a.bits, a.group_size, not a.asym)

    steps = {name: {"rtn": lambda: RTN(args), "gptq": lambda: GPTQ(args)}[name] for name in a.baselines.split(",")}
    for setting in a.settings.split(","):
        iters, windows = (int(v) for v in setting.split("x"))
        steps[f"autoround {setting}"] = lambda i=iters, w=windows: AutoRound(args, iters=i, windows=w)
    base = measure_perplexity(a.model, "wiki", 512, a.ppl_tokens)["perplexity"]
    rows = []
    for name, make in steps.items():
        out = a.work / name.replace(" ", "-")
        start = time.time()
        job = Quantization(name.split()[0], [make()], args, a.model, out, CalibData(), overwrite=True)
        quantize_weights(job, progress=False)
        seconds = time.time() - start
        ppl = measure_perplexity(str(out), "wiki", 512, a.ppl_tokens)["perplexity"]
        rows.append({"method": name, "seconds": round(seconds, 1), "ppl": ppl})
        print(json.dumps(rows[-1]), flush=True)
    gptq = next((r for r in rows if r["method"] == "gptq"), None)
    scheme = f"W{a.bits} g{a.group_size} {'sym' if args.sym else 'asym'}"
    lines = [
        f"{a.model}, {scheme}, float lm_head, 128×512 owt calibration tokens, wiki ppl over {a.ppl_tokens} tokens "
        f"(float {base:.3f}), 2 CPU cores, one process.",
        "",
        "| method | wiki ppl | increase | seconds | increase vs GPTQ's | time vs GPTQ's |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        inc = r["ppl"] / base - 1
        vs = f"{inc / (gptq['ppl'] / base - 1):.2f}" if gptq else ""
        t = f"{r['seconds'] / gptq['seconds']:.2f}" if gptq else ""
        lines.append(f"| {r['method']} | {r['ppl']:.3f} | {inc:+.1%} | {r['seconds']:.0f} | {vs} | {t} |")
    save_results(f"autoround_settings-{a.model}", "\n".join(lines), {"base_ppl": base, "rows": rows})


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
