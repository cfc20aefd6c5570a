"""The schedule (DESIGN.md §3 "Schedule", docs/schedule.md): placement on workers,
dependency counters with scopes, the counter passes (C4-C6), the collapse decision (C8),
and checkpoint D."""

from plow.schedule.build import ScheduleOptions, build_schedule, run_passes, with_makespan
from plow.schedule.ir import Counter, EdgeDecision, PassReport, Schedule, Task, TaskKind
from plow.schedule.passes import drop_implied_counters, hoist_loads, merge_same_dependency
from plow.schedule.payload import certify_schedule, counter_payload
from plow.schedule.protocol import protocol_errors, simulate

__all__ = [
    "Counter",
    "EdgeDecision",
    "PassReport",
    "Schedule",
    "ScheduleOptions",
    "Task",
    "TaskKind",
    "build_schedule",
    "certify_schedule",
    "counter_payload",
    "drop_implied_counters",
    "hoist_loads",
    "merge_same_dependency",
    "protocol_errors",
    "run_passes",
    "simulate",
    "with_makespan",
]
