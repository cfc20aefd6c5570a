"""The dispatcher-to-event-loop mailbox (`plow.serve.http._Mailbox`): a burst of events (one
tick's rows) costs one loop wake-up, and every queue gets its events in the order posted."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from plow.serve.http import _Mailbox


class RecordingLoop:
    """Stands in for the loop: records what `call_soon_threadsafe` schedules."""

    def __init__(self) -> None:
        self.scheduled: list[Callable[[], None]] = []

    def call_soon_threadsafe(self, cb: Callable[[], None]) -> None:
        self.scheduled.append(cb)


def drained(q: asyncio.Queue[Any]) -> list[Any]:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_a_burst_wakes_the_loop_once_and_keeps_each_queues_order() -> None:
    loop = RecordingLoop()
    box = _Mailbox(loop)  # type: ignore[arg-type]
    a: asyncio.Queue[Any] = asyncio.Queue()
    b: asyncio.Queue[Any] = asyncio.Queue()
    for i in range(8):  # one tick of 8 rows, two streams
        box.post(a if i % 2 == 0 else b, i)
    assert len(loop.scheduled) == 1 and a.empty() and b.empty()
    loop.scheduled[0]()
    assert drained(a) == [0, 2, 4, 6] and drained(b) == [1, 3, 5, 7]
    box.post(a, 8)  # the next tick: a new wake-up
    assert len(loop.scheduled) == 2
    loop.scheduled[1]()
    assert drained(a) == [8]


def test_events_from_a_thread_all_arrive_in_order_on_a_running_loop() -> None:
    async def run() -> dict[int, list[int]]:
        box = _Mailbox(asyncio.get_running_loop())
        queues: dict[int, asyncio.Queue[int]] = {k: asyncio.Queue() for k in range(4)}
        n = 2000

        def produce() -> None:
            for i in range(n):
                box.post(queues[i % 4], i)

        t = threading.Thread(target=produce)
        t.start()
        got: dict[int, list[int]] = {k: [] for k in queues}
        for k, q in queues.items():
            while len(got[k]) < n // 4:
                got[k].append(await asyncio.wait_for(q.get(), 10))
        t.join()
        return got

    got = asyncio.run(run())
    assert all(got[k] == list(range(k, 2000, 4)) for k in got)
