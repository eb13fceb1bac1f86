"""Options that describe a weight scheme and a mixed-precision budget: the weight jobs and `compress plan
--budget` declare them once, here."""

from __future__ import annotations

from slimlm.compress.mixed_precision import BITS as BUDGET_BITS
from slimlm.compress.mixed_precision import MAX_BITS, MIN_BITS
from slimlm.jobs.options import Opt, Switch, float_between, int_list, parse_size

__all__ = ["BUDGET", "BUDGET_BITS", "BUDGET_WIDTHS", "SIZE", "SYM"]

SYM = Opt("symmetric (default)", flag="--sym", switches=(Switch("--asym", False, "asymmetric, with zero points"),))
# Mixed precision, here and in `compress plan --budget`:
BUDGET = Opt(
    "mixed precision: bits per decoder-layer weight, scales and zero points included (e.g. 3.5); each group "
    "of linears reading one input gets the scheme (--budget-bits, groups of 32/64/128) that costs the least "
    "output error for its bytes, measured on the calibration data; --group-size then sets only the lm_head's",
    parse=float_between(MIN_BITS, MAX_BITS, " bits a weight"),
    metavar="BITS",
)
SIZE = Opt(
    "mixed precision by checkpoint size instead of --budget: the weight files' total (e.g. 1.5G, 300M); the "
    "decoder linears get what the other tensors leave, their schemes chosen as --budget chooses them",
    parse=parse_size,
    metavar="SIZE",
)
BUDGET_WIDTHS = Opt(
    "the code widths --budget chooses from (default 2,4,8: transformers with compressed-tensors < 0.18 "
    "reads no 3-bit checkpoint)",
    parse=int_list,
    metavar="B,B,...",
)
