"""GPTQ with bf16 calibration passes: which Hessian product keeps the quality, over calibration seeds.

For each seed, `compress gptq` W4 g64 sym on the default model in three variants, and the wiki perplexity of each
(the float model's is printed first; fp32 passes are the baseline of each seed):
    fp32      fp32 passes, the Hessian multiplied in fp32
    bf16-H    bf16 passes, the Hessian multiplied in bf16 (each batch's product rounded to 8 bits, summed in fp32)
    bf16-in   bf16 passes, the bf16 activations multiplied as bf16 numbers summed in fp32 (exact; the default
              where bf16 is fast)
The bf16-H variant patches HessianAccumulator.add in this process only.

    PYTHONPATH=. .venv/bin/python benchmarks/gptq_hessian_dtype.py [--seeds 0,1,2] [--variants fp32,bf16-in]
        [--work /tmp/gptq-hessian]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slimlm import cli, models
from slimlm.compress import gptq
from slimlm.eval.perplexity import engine_for, perplexity

ADD = gptq.HessianAccumulator.add


def bf16_product_add(self, x: torch.Tensor) -> None:
    x = x.reshape(-1, x.shape[-1]).bfloat16()
    n = x.shape[0]
    self.H *= self.tokens / (self.tokens + n)
    self.tokens += n
    self.H += (x.T @ x).float() * (2 / self.tokens)


VARIANTS = {  # name: (--compute-dtype, HessianAccumulator.add)
    "fp32": ("float32", ADD),  # fp32 activations: the kept code multiplies them in plain fp32
    "bf16-H": ("bfloat16", bf16_product_add),
    "bf16-in": ("bfloat16", ADD),
}


def run(variant: str, seed: int, out: Path) -> tuple[float, float]:
    dtype, add = VARIANTS[variant]
    gptq.HessianAccumulator.add = add
    try:
        start = time.time()
        code = cli.main(
            [
                "gptq",
                "--model",
                "smollm2-135m",
                "--calib",
                "owt",
                "--num-samples",
                "32",
                "--seq-len",
                "512",
                "--seed",
                str(seed),
                "--bits",
                "4",
                "--group-size",
                "64",
                "--sym",
                "--compute-dtype",
                dtype,
                "--out",
                str(out),
                "--overwrite",
            ]
        )
        seconds = time.time() - start
    finally:
        gptq.HessianAccumulator.add = ADD
    if code:
        raise SystemExit(f"{variant} seed {seed}: compress gptq exited {code}")
    return seconds, perplexity(engine_for(str(out), 512), "wiki", 512, 16384, progress=False)["perplexity"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--variants", default=",".join(VARIANTS), help="a comma-separated subset; fp32 is the baseline")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "gptq-hessian")
    a = p.parse_args()
    variants = a.variants.split(",")
    if "fp32" not in variants or not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants: a subset of {', '.join(VARIANTS)} that includes fp32")
    torch.set_num_threads(2)
    base = perplexity(engine_for(str(models.resolve("smollm2-135m")), 512), "wiki", 512, 16384, progress=False)
    print(f"float model: wiki ppl {base['perplexity']:.3f}", flush=True)
    ppl: dict[str, list[float]] = {v: [] for v in variants}
    for seed in map(int, a.seeds.split(",")):
        for variant in variants:
            seconds, value = run(variant, seed, a.work / f"{variant}-{seed}")
            ppl[variant].append(value)
            print(f"seed {seed} {variant:10s} {seconds:6.1f} s  wiki ppl {value:.3f}", flush=True)
    print(f"\n{'variant':10s} {'mean ppl':>9s} {'vs fp32':>8s}  per seed")
    fp32 = statistics.mean(ppl["fp32"])
    for variant, values in ppl.items():
        mean = statistics.mean(values)
        print(f"{variant:10s} {mean:9.3f} {mean / fp32 - 1:+8.2%}  " + " ".join(f"{v:.3f}" for v in values))


if __name__ == "__main__":
    main()
