"""The CPU executor: a faithful emulation of the persistent kernel (docs/runtime.md,
"CPU executor"). One queue per virtual worker, counters as the only synchronisation, the
arena as one buffer, tile work in numpy on views of it."""

from plow.runtime.cpu.arena import Arena, KVShape, Layout, Slot
from plow.runtime.cpu.generate import GenerationStats, Request, generate
from plow.runtime.cpu.machine import DeadlockError, DispatchStats, Machine, RaceError
from plow.runtime.cpu.model import CpuModel, RowDevice, RowInput, round_up
from plow.runtime.cpu.plan import OpEntry, Packet, Plan, plan_from_parts

__all__ = [
    "Arena",
    "CpuModel",
    "DeadlockError",
    "DispatchStats",
    "GenerationStats",
    "KVShape",
    "Layout",
    "Machine",
    "OpEntry",
    "Packet",
    "Plan",
    "RaceError",
    "Request",
    "RowDevice",
    "RowInput",
    "Slot",
    "generate",
    "plan_from_parts",
    "round_up",
]
