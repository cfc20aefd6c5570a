"""On-chip memory as pages with lifetimes, per worker (docs/memory.md "Pages").

Every task holds two on-chip allocations while it runs on its worker (sizes from the tiler's
on-chip model, `onchip_footprint`):

- its *weight slab* (`weight_pages`: the double-buffered weight chunks of a tile), live from its
  load until the task ends. The load is *hoisted* to the start of the previous task on the
  same queue (overlapping that task's compute) when the previous task's pages plus this slab
  fit the worker's budget; otherwise it starts with the task. Only weights are hoisted: an
  activation operand is not ready before the counters the task waits on open.
- its *activation working set* (`act_pages`: accumulator and input chunks of one tile; at
  least one page; one page for a merge, which streams partials), live while the task runs.

Tiles of a task run back to back, so one tile's footprint is the task's. Time is the
counter-gated simulation of the schedule (`plow.schedule.simulate`) in whole nanoseconds.
On one worker at most two tasks hold pages at once (the running one and the next one's
hoisted slab), so the hoisting rule keeps occupancy within `onchip_bytes_per_worker //
page_bytes` by construction; `plan_pages` raises `PlanRejected` when a single task does not
fit, and checkpoint C re-checks the timeline (`page_payload`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plow.errors import PlanRejected
from plow.graph.ops import OpGraph
from plow.oracle.payloads.pages import PagePayload, PageWindow, WorkerTimeline
from plow.schedule.ir import Schedule, TaskKind
from plow.schedule.protocol import simulate
from plow.target.model import Target, dtype_bytes
from plow.tiles.ir import TiledOp, TileGraph


@dataclass(frozen=True, slots=True)
class TaskPages:
    """The on-chip windows of one task: weights `[load, finish)`, activations
    `[start, finish)` (ns from the start of the step)."""

    start: int
    finish: int
    load: int
    weight_pages: int
    act_pages: int

    @property
    def hoisted(self) -> bool:
        return self.weight_pages > 0 and self.load < self.start


@dataclass(frozen=True, slots=True)
class PagePlan:
    """Pages of every task of one bucket (`tasks[i]` is task `i` of the schedule)."""

    budget_pages: int
    page_bytes: int
    tasks: tuple[TaskPages, ...]

    @property
    def hoisted(self) -> int:
        return sum(1 for t in self.tasks if t.hoisted)


def _pages(nbytes: int, page: int) -> int:
    return -(-max(0, nbytes) // page)


def onchip_footprint(top: TiledOp, tg: TileGraph, graph: OpGraph) -> tuple[int, int]:
    """(weight bytes, activation bytes) one tile of `top` holds on chip — the tiler's
    feasibility model (`plow.tiles.tiler`, which keeps it within the worker's on-chip bytes):
    a matmul holds its fp32 accumulator and double-buffered 64-deep chunks of the input and
    the weight; attention its query block, a score block and double-buffered key/value
    chunks; element-wise ops stream (one staging page)."""
    a = dtype_bytes(tg.activation_dtype)
    w = dtype_bytes(tg.weight_dtype)
    c = dtype_bytes(tg.cache_dtype)
    t = top.tile_shape
    if top.kind in ("linear", "lm_head", "expert_linear") and len(t) == 3:
        mt, nt, kt = t
        kc = min(kt, 64)
        wbytes = 2 * nt * kc * max(a, w)
        return wbytes, mt * nt * 4 + 2 * mt * kc * max(a, w)
    if top.kind == "attention" and len(t) == 3:
        rt, st, dt = t
        op = next(o for o in graph.ops if o.name == top.name)
        q = graph.tensor(op.inputs[0]).shape
        heads, kvh = int(op.attrs["heads"]), int(op.attrs["kv_heads"])
        block = q[1] * (heads // kvh)
        kvt = min(-(-rt // block), q[0] * kvh)
        return 0, rt * dt * a + rt * min(st, 256) * 4 + 2 * min(st, 64) * dt * c * kvt
    return 0, 1


def plan_pages(s: Schedule, tg: TileGraph, target: Target, graph: OpGraph) -> PagePlan:
    """Page windows of every task of `s` (hoisting weight loads where the budget allows)."""
    page = target.page_bytes
    budget = target.onchip_bytes_per_worker // page
    lat: dict[str, float] = {k: float(v) for k, v in target.atomic_latency_ns.items()}
    tl = simulate(s, lat)
    foot = {o.name: onchip_footprint(o, tg, graph) for o in tg.ops}
    need: list[tuple[int, int]] = []
    for t in s.tasks:
        if t.kind in (TaskKind.merge, TaskKind.allreduce):
            need.append((0, 1))  # a merge streams the partials through one page
            continue
        wb, ab = foot[t.op]
        if t.kind is TaskKind.load:
            need.append((_pages(wb, page), 0))
        else:
            need.append((_pages(wb, page), max(1, _pages(ab, page))))
    for t, (wp, ap) in zip(s.tasks, need, strict=True):
        if wp + ap > budget:
            raise PlanRejected(
                f"on-chip pages, bucket {s.bucket}",
                f"task {t.name} needs {wp + ap} pages of {page} bytes on worker {t.worker}, "
                f"budget {budget}",
            )
    # round() is monotone, so a task that starts after its queue predecessor ends still does.
    start = [round(x) for x in tl.start]
    finish = [max(round(x), st) for x, st in zip(tl.finish, start, strict=True)]
    load = list(start)
    for q in s.queues:
        for prev, cur in zip(q, q[1:], strict=False):
            wp = need[cur][0]
            # While `prev` runs only its own pages and `cur`'s hoisted slab are live (the
            # task before `prev` ended when `prev` started).
            if wp and sum(need[prev]) + wp <= budget:
                load[cur] = start[prev]
    tasks = tuple(
        TaskPages(start[i], finish[i], min(load[i], start[i]), need[i][0], need[i][1])
        for i in range(len(s.tasks))
    )
    return PagePlan(budget, page, tasks)


Window = tuple[int, int, int, str]  # (start, end, pages, name)


def page_windows(
    workers: Sequence[int], names: Sequence[str], tasks: Sequence[TaskPages]
) -> dict[int, list[Window]]:
    """Per worker, each task's weight window `<task>.w` and activation window `<task>.a`."""
    per: dict[int, list[Window]] = {}
    for w, name, t in zip(workers, names, tasks, strict=True):
        lst = per.setdefault(w, [])
        if t.weight_pages:
            lst.append((t.load, t.finish, t.weight_pages, f"{name}.w"))
        if t.act_pages:
            lst.append((t.start, t.finish, t.act_pages, f"{name}.a"))
    return per


def page_payload(
    budget_pages: int,
    workers: Sequence[int],
    names: Sequence[str],
    tasks: Sequence[TaskPages],
) -> PagePayload:
    """The checkpoint C payload: per worker, each task's weight and activation windows."""
    per = page_windows(workers, names, tasks)
    return PagePayload(
        budget_pages=budget_pages,
        workers=[
            WorkerTimeline(
                worker=w,
                windows=[PageWindow(name=n, start=a, end=e, pages=p) for a, e, p, n in per[w]],
            )
            for w in sorted(per)
        ],
    )


def peak_pages(windows: dict[int, list[Window]]) -> dict[int, int]:
    """Peak pages live per worker (a sweep over window openings and closings)."""
    out: dict[int, int] = {}
    for w, wins in windows.items():
        ev: list[tuple[int, int]] = []
        for st, en, pg, _ in wins:
            if en > st and pg:
                ev.append((st, pg))
                ev.append((en, -pg))
        ev.sort()  # closings (negative) before openings at one instant
        cur = peak = 0
        for _, d in ev:
            cur += d
            peak = max(peak, cur)
        out[w] = peak
    return out


def split_timeline(
    budget_pages: int, windows: dict[int, list[Window]], chunk: int = 64
) -> dict[str, object]:
    """The checkpoint C payload (a JSON dict) of `windows`, each worker's timeline cut into
    time slices of about `chunk` windows.

    A worker's timeline is cut at the start of every `chunk`-th window (in start order); a
    window crossing a cut becomes two windows with the same name and pages. Each slice is a
    separate timeline entry (with the worker's id). At every cycle a slice's occupancy equals
    the worker's (windows outside the slice hold nothing then), so the oracle's verdict is
    unchanged while its per-timeline quadratic check runs on short lists."""
    import bisect

    out: list[dict[str, object]] = []
    for w in sorted(windows):
        wins = sorted(x for x in windows[w] if x[1] > x[0])
        cuts = sorted({wins[k][0] for k in range(chunk, len(wins), chunk)})
        bounds = [-1, *cuts]
        slices: list[list[dict[str, object]]] = [[] for _ in bounds]
        for st, en, pg, nm in wins:
            j = bisect.bisect_right(bounds, st) - 1
            s0 = st
            while True:
                stop = bounds[j + 1] if j + 1 < len(bounds) else None
                e = en if stop is None else min(en, stop)
                slices[j].append({"name": nm, "start": s0, "end": e, "pages": pg})
                if stop is None or en <= stop:
                    break
                j, s0 = j + 1, stop
        out += [{"worker": w, "windows": sl} for sl in slices if sl]
    return {"budget_pages": budget_pages, "workers": out}
