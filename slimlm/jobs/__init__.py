"""Every command as a typed job: `compress COMMAND`, a recipe step and a Python call are the same object.

    from slimlm.jobs import GPTQ
    GPTQ(model="smollm2-135m", out="out/gptq", bits=4, num_samples=32).run()

A job's fields (options.py) declare its flags, checks and help once; the CLI is generated from `JOBS`, a
recipe step is `JOBS[command].from_options(mapping)`, and `run()` does the work. A new method is one job
class (its fields and `execute`; `run()` claims its outputs, then executes) and one entry here.
"""

from slimlm.jobs.measure import Bench, Eval, LongContext, Plan, Report
from slimlm.jobs.options import Job
from slimlm.jobs.quantize import AWQ, GPTQ, KV, RTN, AutoRound
from slimlm.jobs.serve import Assets, Generate, Serve
from slimlm.jobs.train import GQA, Prune

JOBS: dict[str, type[Job]] = {
    job.command: job
    for job in (
        Assets,
        RTN,
        GPTQ,
        AutoRound,
        AWQ,
        KV,
        GQA,
        Prune,
        Bench,
        Report,
        Plan,
        Eval,
        LongContext,
        Generate,
        Serve,
    )
}
# the jobs that write a checkpoint (their `out` is a directory), which a recipe can chain
STEPS = tuple(name for name, job in JOBS.items() if "out" in job.opts() and job.opts()["out"].output == "dir")

__all__ = [
    "AWQ",
    "AutoRound",
    "GPTQ",
    "GQA",
    "JOBS",
    "KV",
    "RTN",
    "STEPS",
    "Assets",
    "Bench",
    "Eval",
    "Generate",
    "Job",
    "LongContext",
    "Plan",
    "Prune",
    "Report",
    "Serve",
]
