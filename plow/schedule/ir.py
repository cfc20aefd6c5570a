"""The schedule IR (docs/schedule.md): tasks on worker queues, counters, dependency edges.

Frozen dataclasses. A `Schedule` is what the emitter (packets, arena, pages) and the CPU
executor (one queue per worker, counters as the only synchronisation) consume:

- `tasks[i]` is task `i` (its `index` is `i`): a run of work units of one op (tiles, or
  output blocks of a split reduction's merge, or weight-slab loads) that one worker executes
  back to back. Before it starts it waits until every counter in `waits` has reached its
  threshold; when it finishes it increments every counter in `signals` once.
- `queues[w]` lists worker `w`'s task indices in execution order. The queues partition the
  tasks. Workers are numbered globally: worker `w` is on GPU `w // workers_per_gpu` and in
  L2 partition `(w % workers_per_gpu) * l2_partitions // workers_per_gpu` of that GPU.
- `counters[c]` (its `id` is `c`): `threshold` = the number of tasks whose `signals` contain
  `c`; `scope` the cheapest atomic that reaches every signaller and waiter.
- `edges` are the task-level dependencies `(producer task, consumer task)`: the consumer
  reads a region the producer writes. Every edge is covered by a counter the consumer waits
  on and the producer signals, or by same-queue order (producer earlier).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

Scope = Literal["cta", "device", "system"]
SCOPES: tuple[Scope, ...] = ("cta", "device", "system")


class TaskKind(str, Enum):
    """What a task computes.

    compute: tiles of an op that write the op's output (or, for a split reduction, its
    fp32 partials — then `partial` is true); merge: sums the partials of a split reduction
    (linear `k`, attention `s`, sample `cols`) for some output blocks; allreduce: a merge
    whose partials come from several GPUs (tensor parallel); load: brings a weight slab of
    the next compute task on its worker on chip (waits on nothing).
    """

    compute = "compute"
    merge = "merge"
    allreduce = "allreduce"
    load = "load"


@dataclass(frozen=True, slots=True)
class Task:
    """One task (one or more packets when emitted; see docs/schedule.md).

    `units` are tile indices of `op` (compute, load) or output-block indices of the op's
    split reduction (merge, allreduce; block `j` is the `j`-th distinct tile box on the
    non-reduction axes, in tile order). `tile` is the first unit (the name's `#k` is the
    task's position among the op's tasks of that kind).
    """

    index: int
    name: str  # e.g. "L3.q_proj#2", "L3.q_proj.merge#0", "L3.q_proj.load#5"
    op: str
    kind: TaskKind
    units: tuple[int, ...]
    worker: int
    gpu: int
    partition: int
    waits: tuple[int, ...]
    signals: tuple[int, ...]
    est_ns: float
    partial: bool = False  # writes fp32 partials of a split reduction
    weight_bytes: int = 0

    @property
    def tile(self) -> int:
        return self.units[0]

    @property
    def is_load(self) -> bool:
        return self.kind is TaskKind.load


@dataclass(frozen=True, slots=True)
class Counter:
    """An atomic counter. `producer` is the group of tasks it was built for: an op name,
    `<op>.partial` for a split reduction's partial tiles. `fine` counters gate one consumer
    slice (`consumer` names its task) instead of every consumer of `producer`."""

    id: int
    name: str
    threshold: int
    scope: Scope
    producer: str
    fine: bool = False
    consumer: str = ""


@dataclass(frozen=True, slots=True)
class PassReport:
    """What one pass changed. `changes` are human-readable lines (one per change);
    `theorem` the Rocq theorem that licenses the pass (docs/theorems.md)."""

    name: str
    theorem: str
    changed: int
    changes: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True, slots=True)
class EdgeDecision:
    """The collapse decision (C8) for one op-level edge `producer -> consumer`."""

    producer: str
    consumer: str
    fine: bool
    reason: str
    consumer_costs: tuple[int, ...] = ()  # the consumer slices' est costs (ns, rounded)


@dataclass(frozen=True, slots=True)
class Schedule:
    """The schedule of one bucket (see the module docstring for the invariants).

    `op_edges` are the op-level dependencies of the tile graph (producer op, consumer op);
    `decisions` the collapse decision per op edge; `makespan_ns` the simulated
    counter-gated execution time (task est times + atomic latency per scope, launch
    overhead included); `reports` the passes run so far, in order.
    """

    bucket: str
    target: str
    gpus: int
    workers_per_gpu: int
    l2_partitions: int
    tasks: tuple[Task, ...]
    queues: tuple[tuple[int, ...], ...]
    counters: tuple[Counter, ...]
    edges: tuple[tuple[int, int], ...]
    op_edges: tuple[tuple[str, str], ...]
    ops: tuple[str, ...]
    decisions: tuple[EdgeDecision, ...] = ()
    makespan_ns: float = 0.0
    reports: tuple[PassReport, ...] = ()
    l2_aware: bool = True
    cross_partition_bytes: int = 0
    cross_gpu_bytes: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def workers(self) -> int:
        """Workers over all GPUs (the number of queues)."""
        return self.gpus * self.workers_per_gpu

    def gpu_of(self, worker: int) -> int:
        return worker // self.workers_per_gpu

    def partition_of(self, worker: int) -> int:
        return (worker % self.workers_per_gpu) * self.l2_partitions // self.workers_per_gpu

    def task(self, name: str) -> Task:
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(name)

    def live_counters(self) -> list[Counter]:
        """Counters some task still signals or waits on (passes leave dropped ids unused)."""
        used = {c for t in self.tasks for c in (*t.waits, *t.signals)}
        return [c for c in self.counters if c.id in used]
