"""Workload files: one study, fixed before anything runs (DESIGN.md §5).

A workload is YAML validated by pydantic; anything malformed ends the run with one line naming
the file and the field, e.g. ``workload.yaml: field 'batch_sizes.0': Input should be greater
than 0``. `load_workload` also accepts the name of a workload shipped in `harness/workloads/`.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from plow.errors import ConfigError

PositiveInt = Annotated[int, Field(gt=0)]
ExecutorName = Literal["reference", "native", "cpu", "cuda"]
Precision = Literal["fp32", "bf16", "fp8"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FixtureModel(_Strict):
    """A tiny checkpoint made here (`plow.testing.make_tiny_checkpoint`), cached by recipe."""

    family: Literal["llama", "qwen3", "gemma3"]
    seed: int = 0
    overrides: dict[str, Any] = Field(default_factory=dict)


class ModelRef(_Strict):
    """Exactly one of: `default` (the embedded SmolLM2 model), `path` (a checkpoint
    directory; `~` and `$VARS` expand, relative paths are taken from the working directory),
    `fixture` (a tiny checkpoint recipe)."""

    default: bool = False
    path: str | None = None
    fixture: FixtureModel | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelRef:
        given = [self.default, self.path is not None, self.fixture is not None]
        if sum(given) != 1:
            raise ValueError("give exactly one of 'default: true', 'path' or 'fixture'")
        return self

    @property
    def label(self) -> str:
        if self.default:
            return "default (SmolLM2-135M-Instruct)"
        if self.fixture is not None:
            f = self.fixture
            extra = f" {f.overrides}" if f.overrides else ""
            return f"fixture {f.family} seed {f.seed}{extra}"
        return str(self.path)


def _model_ref(value: Any) -> Any:
    """`model: default` and `model: some/dir` are shorthands."""
    if value == "default":
        return {"default": True}
    if isinstance(value, str):
        return {"path": value}
    return value


class PromptLengths(_Strict):
    """Prompts of random token ids, lengths uniform in [min, max], drawn from the study's
    first seed."""

    min: PositiveInt
    max: PositiveInt
    count: PositiveInt = 2

    @model_validator(mode="after")
    def _ordered(self) -> PromptLengths:
        if self.max < self.min:
            raise ValueError(f"max {self.max} is below min {self.min}")
        return self


class GateSpec(_Strict):
    """The correctness gate: greedy generation of `new_tokens` from every prompt on the
    executor and on transformers (torch CPU), then teacher-forced log-probabilities."""

    new_tokens: PositiveInt = 16
    require_token_match: bool = True
    max_abs_logprob_delta: Annotated[float, Field(gt=0)] = 2e-3
    min_top1_agreement: Annotated[float, Field(ge=0, le=1)] = 1.0


class CompileSpec(_Strict):
    """`step_budget_ms`: the per-step budget the plan's lower bounds must fit (checkpoint B);
    None: twice the cost model's estimate (no latency target)."""

    step_budget_ms: Annotated[float, Field(gt=0)] | None = None


class MeasureSpec(_Strict):
    warmup_steps: Annotated[int, Field(ge=0)] = 1
    decode_steps: PositiveInt = 6
    serving_tokens: PositiveInt = 8
    calibrate: bool = True
    # numpy's BLAS threads for the whole study (None: as the environment has it). The CPU
    # executor runs its virtual workers in one thread; a second BLAS thread buys it nothing
    # and, on a shared machine, makes step times far noisier.
    blas_threads: PositiveInt | None = None


class Workload(_Strict):
    study: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=80)]
    description: str = ""
    model: ModelRef
    reference_model: ModelRef | None = None
    precision: Precision = "fp32"
    target: str = "cpu"
    executor: ExecutorName = "reference"
    # executors whose raw decode steps are measured too, in the same run, after the study's
    # own (published beside it as the `compare` surface)
    compare_executors: list[ExecutorName] = Field(default_factory=list)
    tp_degree: PositiveInt = 1
    context_lengths: Annotated[list[PositiveInt], Field(min_length=1)]
    batch_sizes: Annotated[list[PositiveInt], Field(min_length=1)] = Field(
        default_factory=lambda: [1]
    )
    prompts: list[Annotated[str, Field(min_length=1)]] | None = None
    prompt_lengths: PromptLengths | None = None
    seeds: Annotated[list[int], Field(min_length=1)] = Field(default_factory=lambda: [0])
    gate: GateSpec = Field(default_factory=GateSpec)
    compile: CompileSpec = Field(default_factory=CompileSpec)
    measure: MeasureSpec = Field(default_factory=MeasureSpec)

    @field_validator("model", "reference_model", mode="before")
    @classmethod
    def _normalise_model(cls, v: Any) -> Any:
        return _model_ref(v)

    @field_validator("context_lengths", "batch_sizes")
    @classmethod
    def _sorted_unique(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError("values must be distinct")
        return sorted(v)

    @model_validator(mode="after")
    def _prompts(self) -> Workload:
        if (self.prompts is None) == (self.prompt_lengths is None):
            raise ValueError("give exactly one of 'prompts' or 'prompt_lengths'")
        return self

    @property
    def reference(self) -> ModelRef:
        """The checkpoint transformers loads as ground truth (default: the model itself)."""
        return self.reference_model or self.model


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"field {loc!r}: {msg}" if loc else msg


def parse_workload(text: str, where: str | Path) -> Workload:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "not valid YAML"
        raise ConfigError(where, f"malformed YAML{at}: {problem}") from e
    if not isinstance(data, dict):
        raise ConfigError(where, "expected a mapping of workload fields")
    try:
        return Workload.model_validate(data)
    except ValidationError as e:
        raise ConfigError(where, _first_error(e)) from e


def shipped_workloads() -> list[str]:
    root = resources.files("harness").joinpath("workloads")
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def workload_source(arg: str | Path | None) -> tuple[str, str]:
    """(text, display name) of a workload: None is the default study; a path; or the name of
    a shipped workload (`gemma3_12b_h200_decode`)."""
    if arg is None:
        arg = "default"
    path = Path(os.path.expanduser(str(arg)))
    if path.is_file():
        return path.read_text(encoding="utf-8"), str(path)
    if path.exists():
        raise ConfigError(path, "not a workload file")
    name = str(arg).removesuffix(".yaml")
    if name in shipped_workloads():
        res = resources.files("harness").joinpath(f"workloads/{name}.yaml")
        return res.read_text(encoding="utf-8"), f"{name}.yaml"
    raise ConfigError(
        path, f"no such workload file (shipped workloads: {', '.join(shipped_workloads())})"
    )


def load_workload(arg: str | Path | None) -> tuple[Workload, str]:
    text, where = workload_source(arg)
    return parse_workload(text, where), where
