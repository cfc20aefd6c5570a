"""Checkpoint B payload: the tile shapes of every op, their charged cost, and the target.

Each op has an index space of axes (`extent` = true size). Its tiling gives each axis a
`tile` size and a number of `steps`; step `k` covers indices `k*tile .. k*tile+tile-1`,
masked at the extent (an oversized tile on a small axis — 8 router columns under a minimum
tile of 16 — is one masked step). The oracle (Plow.Tiles.check_tiling_plan) accepts when

- every axis: `tile > 0`, `tile >= target.min_tile`, `steps*tile >= extent` (no hole),
  `(steps-1)*tile < extent` when `steps > 0` (no empty step);
- every op: `flops == flops_per_point * prod(extent)` (the arithmetic on the true extents) and
  `charged_cost >= flops_per_point * prod(steps*tile)` (padding is charged, hence
  charged >= arithmetic);
- the plan: `sum(bytes) >= weight_bytes`, `sum(bytes) * 1e9 <= budget_ns * bandwidth` and
  `sum(flops) * 1e9 <= budget_ns * peak` (the makespan lower bounds fit the budget);

With `plan` on every op (what `plow verify` derives from a bundle; a tiling checked before
scheduling has none), also (Plow.Partition.check_plan_tasks):

- the op's kind has a shape rule and the op table's `opcode` is the kind's;
- every axis extent is what the kind's rule computes from the op's tensor shapes
  (`inputs`/`outputs`, in operand order; docs/oracle.md "Checkpoint B" lists the dims);
- the compute tasks' ranges `[start, start + count)` partition the tiles `[0, prod(steps))`
  (row-major over the axes, last axis fastest), the merge tasks' ranges the merge units
  `[0, merge_units)`; each op's `tasks` are sorted by `start`; loads lie within the tiles;
- each task packet's opcode is its op's (merges: the kind's merge opcode or allreduce), and
  `MASKED` is set exactly on the tasks with a tile that overhangs an extent.

(theorem Plow.Tilesproof.checkpoint_b_sound). Integers only on the wire.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TileAxis(BaseModel):
    """One axis of an op's index space and its tiling."""

    model_config = ConfigDict(frozen=True)

    name: str  # e.g. "m", "n", "k"
    extent: int = Field(ge=0)  # true size of the axis
    tile: int = Field(ge=0)  # tile size along the axis
    steps: int = Field(ge=0)  # tile steps along the axis


class TileTask(BaseModel):
    """One task of an op, as its task packet says (a task is a packet of the plan file)."""

    model_config = ConfigDict(frozen=True)

    task: int = Field(ge=0)  # task index in the plan (stream order of the task packets)
    name: str  # the schedule file's task name (reasons only)
    start: int = Field(ge=0)  # packet row_start: first unit (tile, or merge unit)
    count: int = Field(ge=0)  # packet rows: number of units
    opcode: int = Field(ge=0)
    flags: int = Field(ge=0)


class TileOpPlan(BaseModel):
    """What checkpoint B checks of an op beyond its tiling (module docstring)."""

    model_config = ConfigDict(frozen=True)

    opcode: int = Field(ge=0)  # the op table's opcode
    inputs: list[list[int]]  # shapes of the op's input tensors, operand order
    outputs: list[list[int]]  # shapes of its output tensors
    heads: int = Field(default=0, ge=0)  # attrs the shape rules read (0: absent)
    head_dim: int = Field(default=0, ge=0)
    group: int = Field(default=0, ge=0)  # rmsnorm group (0: the last dim)
    window: int | None = Field(default=None, ge=0)  # attention sliding window
    merge_units: int = Field(default=0, ge=0)  # merge units of a split reduction (0: not split)
    tasks: list[TileTask]  # sorted by start


class TileOp(BaseModel):
    """One op of the tile graph: its axes, arithmetic, charged cost and memory traffic."""

    model_config = ConfigDict(frozen=True)

    name: str  # op name in the graph, e.g. "layers.3.mlp.down"
    kind: str  # op kind, e.g. "linear", "attention", "rmsnorm"
    axes: list[TileAxis]
    flops_per_point: int = Field(ge=0)  # arithmetic per index-space point (2 for a matmul FMA)
    flops: int = Field(ge=0)  # flops_per_point * prod(extent): arithmetic on the true extents
    charged_cost: int = Field(ge=0)  # cost the tiler charged (>= padded work)
    bytes: int = Field(ge=0)  # bytes moved to/from device memory by this op
    plan: TileOpPlan | None = None  # tasks and shapes (all ops or none)


class TileTarget(BaseModel):
    """The hardware numbers the bounds use."""

    model_config = ConfigDict(frozen=True)

    name: str  # "h100", "h200", "b200", "mi350x", "cpu"
    bandwidth_bytes_per_s: int = Field(ge=0)
    peak_flops_per_s: int = Field(ge=0)  # aggregate over all workers, for the ops' dtype
    min_tile: int = Field(ge=0)  # minimum tile size on any axis


class TilePayload(BaseModel):
    """The tiled plan of one bucket (one step of the model)."""

    model_config = ConfigDict(frozen=True)

    ops: list[TileOp]
    target: TileTarget
    budget_ns: int = Field(ge=0)  # time budget of one step
    weight_bytes: int = Field(default=0, ge=0)  # weight bytes one step must read (0: none claimed)


def covering_steps(extent: int, tile: int) -> int:
    """The number of steps of size `tile` that cover `extent` (ceil division)."""
    return -(-extent // tile)


def padded_work(op: TileOp) -> int:
    """`flops_per_point * prod(steps*tile)`: what the tiles compute, masked lanes included."""
    w = op.flops_per_point
    for a in op.axes:
        w *= a.steps * a.tile
    return w


def arithmetic(flops_per_point: int, extents: list[int]) -> int:
    """`flops_per_point * prod(extents)`: the arithmetic on the true extents."""
    w = flops_per_point
    for e in extents:
        w *= e
    return w
