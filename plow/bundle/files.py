"""On-disk models of a bundle's per-bucket files (pydantic; docs/bundle.md).

- `plan/<bucket>.ops.json` — `OpTable`: every op (index = `op_index` of its packets) with its
  kind, attributes, operand tensor names, tiling axes and cost, and every tensor with its
  arena offset, byte size, shape, dtype, role and region. With it an executor interprets a
  packet completely.
- `plan/<bucket>.schedule.json` — `ScheduleFile`: what `plow verify` needs to re-derive
  checkpoints C, D, E and F without the compiler: the tasks in stream order (columns),
  the counters, the task-level dependency edges, the page windows and the arena map.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

FORMAT = 1


class AxisEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    extent: int = Field(ge=0)
    tile: int = Field(ge=0)
    steps: int = Field(ge=0)


class OpCost(BaseModel):
    """What checkpoint B reads per op (tiles.ir.TiledOp)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    flops_per_point: int = Field(ge=0)
    flops: int = Field(ge=0)
    charged_cost: int = Field(ge=0)
    bytes: int = Field(ge=0)


class OpEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    index: int = Field(ge=0)
    name: str
    kind: str
    layer: int | None = None
    attrs: dict[str, Any] = Field(default_factory=dict)
    inputs: list[str]
    outputs: list[str]
    opcode: int = Field(ge=0)
    axes: list[AxisEntry]
    cost: OpCost
    partial: str | None = None  # the op's fp32 partials buffer when its reduction is split
    # greedy fused into lm_head (plow/bundle/argmax.py): `<lm_head>#argmax` on the lm_head op
    # (it writes it) and on the sample op (it reads it); every non-load packet of both ops
    # carries FUSED_ARGMAX
    argmax: str | None = None


class TensorEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    shape: list[int]
    dtype: str
    role: str  # input / weight / activation / cache / output / scratch
    region: str  # weights / kv / io / activations / scratch
    offset: int = Field(ge=0)
    size: int = Field(ge=0)


class TilingInfo(BaseModel):
    """The plan-level numbers of checkpoint B."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    budget_ns: int = Field(ge=0)
    peak_flops_per_s: int = Field(ge=0)
    bandwidth_bytes_per_s: int = Field(ge=0)
    min_tile: int = Field(ge=0)
    weight_bytes: int = Field(ge=0)
    activation_dtype: str
    cache_dtype: str


class OpTable(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    format: int = FORMAT
    bucket: str
    phase: str
    batch: int
    seq: int
    context: int
    arena_bytes: int
    ops: list[OpEntry]
    tensors: dict[str, TensorEntry]
    tiling: TilingInfo


class TaskColumns(BaseModel):
    """Task `i` (stream order: worker 0's queue, then worker 1's, ...) is column entry `i`.

    `units`: `[unit_start, unit_start + unit_count)` — tile indices of op `op` (compute,
    load) or output-block indices of its split reduction (merge, allreduce)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: list[str]
    op: list[int]
    kind: list[str]
    unit_start: list[int]
    unit_count: list[int]
    worker: list[int]
    waits: list[list[int]]
    signals: list[list[int]]
    est_ns: list[int]
    partial: list[bool]
    masked: list[bool]


class CounterColumns(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: list[str]
    threshold: list[int]
    scope: list[str]


class PageColumns(BaseModel):
    """Per task (same order as `tasks`): windows in ns; weights `[load, finish)`,
    activations `[start, finish)`."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    budget_pages: int = Field(ge=0)
    page_bytes: int = Field(ge=1)
    start: list[int]
    finish: list[int]
    load: list[int]
    weight_pages: list[int]
    act_pages: list[int]


class ArenaBuffer(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    region: str
    offset: int = Field(ge=0)
    size: int = Field(ge=0)


class ArenaMap(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    arena_bytes: int = Field(ge=0)
    align: int = Field(ge=1)
    buffers: list[ArenaBuffer]


class ScheduleFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    format: int = FORMAT
    bucket: str
    workers: int = Field(ge=1)
    gpus: int = Field(ge=1)
    workers_per_gpu: int = Field(ge=1)
    makespan_ns: float
    tasks: TaskColumns
    counters: CounterColumns
    edges: list[int]  # flat pairs: producer0, consumer0, producer1, consumer1, ...
    pages: PageColumns
    arena: ArenaMap
    passes: list[str] = Field(default_factory=list)
