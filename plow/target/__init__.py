"""Targets: the hardware as data (DESIGN.md §3 "Targets and cost", docs/targets.md)."""

from plow.target.calibrate import calibrate_cpu
from plow.target.load import load_target, parse_target, shipped_targets
from plow.target.model import DTYPE_BYTES, MinTile, Target, dtype_bytes, rate_class

__all__ = [
    "DTYPE_BYTES",
    "MinTile",
    "Target",
    "calibrate_cpu",
    "dtype_bytes",
    "load_target",
    "parse_target",
    "rate_class",
    "shipped_targets",
]
