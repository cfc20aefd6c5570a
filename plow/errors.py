"""Errors that reach the user as one line naming the input and the problem.

The CLI turns a `PlowError` into `plow: <message>` on stderr and its exit code
(2 for bad input, 1 for a rejected plan or a failed gate) — never a traceback
unless `--debug` is given.
"""

from __future__ import annotations

from pathlib import Path


class PlowError(Exception):
    """A user-facing error: `where` names the input (file, field, bucket)."""

    exit_code = 2

    def __init__(self, where: str | Path, problem: str) -> None:
        self.where = str(where)
        self.problem = problem
        super().__init__(f"{self.where}: {problem}")


class CheckpointError(PlowError):
    """A checkpoint directory is missing files or holds inconsistent data."""


class ConfigError(PlowError):
    """A config (model config, workload, target) is malformed or unsupported."""


class GraphError(PlowError):
    """An operator graph cannot be built (invalid bucket, inconsistent shapes)."""


class OracleError(PlowError):
    """The oracle binary is missing, crashed, timed out or answered garbage."""


class PlanRejected(PlowError):
    """A plan was rejected by a checkpoint or a bound; exit status 1."""

    exit_code = 1
