"""Eval throughput: lm-eval over the slimlm runtime against lm-eval's own `hf` backend on the same model, tasks,
documents and activation dtype, in one run (quality.hf_compare): both wall times (lm-eval's task handling
included), per-document agreement and the largest log-likelihood difference.

    .venv/bin/python benchmarks/eval_vs_hf.py [--model qwen2.5-coder-1.5b] [--tasks slimlm_hellaswag,...] \
        [--limit 40] [--dtype bfloat16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
from quality import hf_compare

from slimlm import models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--tasks", default="slimlm_hellaswag,slimlm_piqa,slimlm_arc_easy,slimlm_winogrande")
    p.add_argument("--limit", type=int, default=40, help="documents per task")
    p.add_argument("--dtype", default="bfloat16", help="both backends' activations (float32, bfloat16)")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    result = hf_compare(str(models.resolve(a.model)), a, a.dtype)
    print(
        f"{a.model}, {a.dtype}, {a.limit} documents of {a.tasks}; {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads\n"
        f"lm-eval over slimlm {result['slimlm_seconds']} s, lm-eval hf {result['hf_seconds']} s: "
        f"{result['speedup']}x; per-document agreement {result['per_document_agreement']}, largest "
        f"log-likelihood difference {result['max_abs_loglikelihood_difference']:.2e}"
    )
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, **result}, indent=2))


if __name__ == "__main__":
    main()
