"""A plan file's packet stream parsed back into tasks (docs/wire.md): per worker queue, a
task is its leading wait-only `nop` packets, its task packet, and its trailing signal-only
`nop` packets. `plow verify` (checkpoints B, D, F) and the executors parse it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from plow.bundle.wire import NO_COUNTER, Opcode, PacketArray


@dataclass(frozen=True, slots=True)
class Grouped:
    """Tasks parsed from a packet stream: `tasks[g]` = packet indices of task g (stream order
    of the task packets); `queues[w]` task indices per worker."""

    tasks: tuple[tuple[int, ...], ...]
    main: tuple[int, ...]
    queues: dict[int, list[int]]


def group_tasks(arr: PacketArray) -> Grouped | str:
    """Parse a stream into tasks (see the module doc); a string names the first violation."""
    op = arr["opcode"].tolist()
    wc = arr["wait_counter"].tolist()
    sc = arr["signal_counter"].tolist()
    wk = arr["worker"].tolist()
    pending: dict[int, list[int]] = {}  # worker -> leading nops
    last: dict[int, list[int]] = {}  # worker -> the group of its last task packet
    groups: list[list[int]] = []
    for i in range(len(op)):
        w = wk[i]
        if op[i] == Opcode.NOP:
            has_w, has_s = wc[i] != NO_COUNTER, sc[i] != NO_COUNTER
            if has_w and has_s:
                return f"packet {i}: a nop both waits and signals (not an emitter v1 stream)"
            if has_w:
                pending.setdefault(w, []).append(i)
            elif w in last and not pending.get(w):
                last[w].append(i)
            elif has_s:
                return f"packet {i}: a signal-only nop on worker {w} follows no task packet"
            continue
        g = [*pending.pop(w, []), i]
        groups.append(g)
        last[w] = g
    left = [w for w, p in pending.items() if p]
    if left:
        return f"worker {left[0]}: wait-only nop packets at the end of the queue"
    mains = tuple(
        g[len([x for x in g if op[x] == Opcode.NOP and wc[x] != NO_COUNTER])] for g in groups
    )
    queues: dict[int, list[int]] = {}
    for k, g in enumerate(groups):
        queues.setdefault(wk[g[-1]], []).append(k)
    return Grouped(tuple(tuple(g) for g in groups), mains, queues)
