"""The gated evaluation harness (DESIGN.md §5): workload → compile with certificates →
correctness gate → performance surfaces → published results with stated limits."""

from harness.executors import EXECUTORS, Executor, ExecutorUnavailable, Runner, get_executor
from harness.run import Outcome, run_study
from harness.workload import Workload, load_workload, parse_workload

__all__ = [
    "EXECUTORS",
    "Executor",
    "ExecutorUnavailable",
    "Outcome",
    "Runner",
    "Workload",
    "get_executor",
    "load_workload",
    "parse_workload",
    "run_study",
]
