"""Checkpoint D from a schedule: `counter_payload(schedule)` (ranks filled by `with_ranks`)
and `certify_schedule`, which runs the oracle and returns the certificate."""

from __future__ import annotations

from plow.oracle import Certificate, run_checkpoint
from plow.oracle.payloads.counters import Counter, CounterPayload, Edge, Task, with_ranks
from plow.schedule.ir import Schedule


def counter_payload(s: Schedule) -> CounterPayload:
    """The checkpoint D payload of a schedule, with the rank witness computed."""
    p = CounterPayload(
        tasks=[
            Task(name=t.name, worker=t.worker, waits=list(t.waits), signals=list(t.signals))
            for t in s.tasks
        ],
        queues=[list(q) for q in s.queues],
        counters=[Counter(name=c.name, threshold=c.threshold, scope=c.scope) for c in s.counters],
        edges=[Edge(producer=u, consumer=t) for u, t in s.edges],
    )
    return with_ranks(p)


def certify_schedule(
    s: Schedule, *, timeout_s: float = 600.0
) -> tuple[CounterPayload, Certificate]:
    """Run checkpoint D on the schedule; the certificate may be a rejection (with a reason)."""
    p = counter_payload(s)
    return p, run_checkpoint("D", p, timeout_s=timeout_s)
