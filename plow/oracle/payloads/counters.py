"""Checkpoint D payload: the counter protocol of one plan.

Tasks (packets) are indexed 0..n-1; each worker runs its queue of tasks in order. A task waits
until every counter in `waits` has reached its threshold, runs, then increments every counter
in `signals` once. `edges` are the task-graph dependencies (producer, consumer) the protocol
must respect. The oracle (Plow.Counters.check_counters) accepts when

- the queues partition the tasks (and each task's `worker` names the queue it is in),
- every edge is covered by a counter the consumer waits on and the producer signals, or by
  same-queue order (producer earlier),
- every counter's threshold is the number of tasks that signal it,
- `ranks` strictly increase along "must precede" (every signaller of a waited counter before
  the waiter, queue order) - an untrusted witness of acyclicity, checked pair by pair;
- every counter's `scope` covers the placement of the tasks that wait on or signal it: `cta`
  one worker, `device` one GPU (worker `w` is on GPU `w // workers_per_gpu`; absent: all
  queues are one GPU), `system` anything;

and then, by Plow.Countersproof.checkpoint_d_sound, every execution (any interleaving, any
number of workers) runs a task only after its predecessors and runs every task without
deadlock. Integer indices only on the wire. `ranks` may be left out when building a payload;
`with_ranks` fills it (Kahn's algorithm) before it is sent.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Scope = Literal["cta", "device", "system"]


class Task(BaseModel):
    """One packet: its name (for messages), its worker, the counters it waits on / signals."""

    model_config = ConfigDict(frozen=True)

    name: str
    worker: int = Field(ge=0)
    waits: list[int] = Field(default_factory=list)
    signals: list[int] = Field(default_factory=list)


class Counter(BaseModel):
    """An atomic counter: consumers proceed when it reaches `threshold`."""

    model_config = ConfigDict(frozen=True)

    name: str
    threshold: int = Field(ge=0)
    scope: Scope = "device"


class Edge(BaseModel):
    """A dependency: `consumer` reads what `producer` writes (task indices)."""

    model_config = ConfigDict(frozen=True)

    producer: int = Field(ge=0)
    consumer: int = Field(ge=0)


class CounterPayload(BaseModel):
    """`queues[w]` lists worker w's task indices in execution order."""

    model_config = ConfigDict(frozen=True)

    tasks: list[Task]
    queues: list[list[int]]
    counters: list[Counter]
    edges: list[Edge]
    ranks: list[int] | None = None
    workers_per_gpu: int | None = Field(default=None, ge=1)  # None: every queue on one GPU


def must_precede(payload: CounterPayload) -> list[tuple[int, int]]:
    """The pairs (a, b) the oracle checks `rank a < rank b` on: gates, consecutive queue pairs."""
    signallers: dict[int, list[int]] = {}
    for a, t in enumerate(payload.tasks):
        for c in dict.fromkeys(t.signals):
            signallers.setdefault(c, []).append(a)
    pairs: list[tuple[int, int]] = []
    for b, t in enumerate(payload.tasks):
        for c in dict.fromkeys(t.waits):
            pairs.extend((a, b) for a in signallers.get(c, []))
    for q in payload.queues:
        pairs.extend(zip(q, q[1:], strict=False))
    return pairs


def topological_ranks(payload: CounterPayload) -> list[int]:
    """Kahn's algorithm over must-precede: rank = position in a topological order.

    Tasks left over (on or behind a cycle) all get the same rank, one past the ordered ones,
    so every must-precede pair among them fails the oracle's `rank a < rank b` check and the
    oracle reports one of them as a possible cycle.
    """
    n = len(payload.tasks)
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for a, b in must_precede(payload):
        if 0 <= a < n and 0 <= b < n:
            succ[a].append(b)
            indeg[b] += 1
    ranks = [-1] * n
    ready = deque(i for i in range(n) if indeg[i] == 0)
    k = 0
    while ready:
        a = ready.popleft()
        ranks[a] = k
        k += 1
        for b in succ[a]:
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    return [r if r >= 0 else k for r in ranks]


def with_ranks(payload: CounterPayload) -> CounterPayload:
    """The payload with `ranks` computed by `topological_ranks` (replacing any given)."""
    return payload.model_copy(update={"ranks": topological_ranks(payload)})
