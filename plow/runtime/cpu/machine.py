"""The persistent kernel, emulated: one queue per virtual worker, counters as the only
synchronisation, packets run as tile work in numpy on the arena.

`Machine.dispatch(plan)` runs one step: every counter starts at 0; a worker may run the task at
the head of its queue once every counter the task waits on has reached its threshold; after
running the task it increments each counter the task signals. A task runs to completion before
another starts (interleaving is at task granularity: tasks talk only through counters and the
arena, so every order the counters allow is some such sequence). Which runnable worker goes
next is the scheduler's choice:

- `round_robin`: runnable workers in FIFO order (a worker goes to the back after each task);
- `random`: a seeded random runnable worker at every step (`seed` per dispatch).

No runnable worker while tasks remain is a deadlock: `DeadlockError` names every blocked
worker, its head task and the counters it waits on (value / threshold).

Checking mode (`check=True`) verifies, before and while each packet runs, that everything it
reads was produced by tasks the counter protocol orders before it — not merely tasks that
happened to finish first in this run:

- `G(T)`, the tasks guaranteed complete when T starts: T's predecessor on its queue and its
  `G`, and for each counter T waits on, the tasks every allowed opening of that counter
  implies (a counter whose threshold equals its number of signallers implies all of them and
  their `G`; one with a lower threshold only what more than `n - threshold` of them imply);
- before T runs, every schedule edge `(P, T)` needs `P` in `G(T)`;
- every arena word T reads or writes is checked against the word's last writer in this step
  (read-after-write, write-after-write) and a write against every earlier reader
  (write-after-read): the other task must be in `G(T)`.

A violation raises `RaceError` naming the packet, the other task, the tensor and the counter
(or missing wait / edge) responsible — so a schedule with a missing dependency fails even
when this interleaving happened to produce the right bytes.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from plow.errors import PlowError
from plow.runtime.cpu.arena import Arena
from plow.runtime.cpu.kernels import Index, run_packet
from plow.runtime.cpu.plan import Plan

Mode = Literal["round_robin", "random"]


class RaceError(PlowError):
    """The checking mode found a read or write not ordered by the counter protocol."""

    exit_code = 1


class DeadlockError(PlowError):
    """No worker can run and tasks remain."""

    exit_code = 1


@dataclass(frozen=True, slots=True)
class DispatchStats:
    tasks: int
    order: tuple[int, ...]  # task indices in the order their packets ran
    entries: int = 0  # queue entries run (task packets and nops)
    nops: int = 0  # nop packets run (waits / signals only; bundle plans)


class _PlainAccess:
    """Views of the arena, no bookkeeping (the fast path)."""

    def __init__(
        self,
        arena: Arena,
        weights: Mapping[str, np.ndarray],
        counts: Counter[str] | None = None,
    ) -> None:
        self.arena = arena
        self.weights = weights
        self.counts: Counter[str] = Counter() if counts is None else counts
        self._views: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}

    def _view(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = (name, shape)
        if key not in self._views:
            self._views[key] = self.arena.view(name).reshape(shape)
        return self._views[key]

    def get(self, name: str, shape: tuple[int, ...], idx: Index) -> np.ndarray:
        return np.array(self._view(name, shape)[idx])

    def put(self, name: str, shape: tuple[int, ...], idx: Index, value: np.ndarray) -> None:
        self._view(name, shape)[idx] = value

    def weight(self, name: str) -> np.ndarray:
        return self.weights[name]

    def count(self, key: str, n: int) -> None:
        self.counts[key] += n


class _Checker:
    """Per-dispatch happens-before bookkeeping over the stream's entries (see the module
    docstring; an entry is a task packet or a nop)."""

    def __init__(self, plan: Plan, arena: Arena) -> None:
        st = plan.stream
        self.plan = plan
        self.st = st
        self.arena = arena
        self.n = len(st.runs)
        self.G: list[int] = [0] * self.n
        self.done = [False] * self.n
        self.writer = np.full(arena.buf.shape[0], -1, dtype=np.int64)
        self.reads: list[tuple[int, int, int, np.ndarray]] = []
        self.sig: dict[int, list[int]] = {}  # counter -> signalling entries
        self.task_sig: dict[int, set[int]] = {}  # counter -> signalling tasks
        self.task_waits: list[list[tuple[int, int]]] = [[] for _ in st.main]
        self.task_sigs: list[list[int]] = [[] for _ in st.main]
        for e in range(self.n):
            t = st.task_of[e]
            for c in st.signals[e]:
                self.sig.setdefault(c, []).append(e)
                self.task_sig.setdefault(c, set()).add(t)
                self.task_sigs[t].append(c)
            self.task_waits[t].extend(st.waits[e])
        self.prev: dict[int, int] = {}
        for q in st.queues:
            for a, b in zip(q, q[1:], strict=False):
                self.prev[b] = a
        self.edges_in: dict[int, list[int]] = {}
        self.edge_set = set(st.edges)
        for u, t in st.edges:
            self.edges_in.setdefault(t, []).append(u)
        self.current = -1

    def _task(self, e: int) -> int:
        return self.st.task_of[e]

    def _name(self, e: int) -> str:
        return self.st.task_names[self._task(e)]

    # -- happens-before ------------------------------------------------------------------
    def _cover(self, e: int) -> int:
        return (self.G[e] | (1 << e)) if self.done[e] else 0

    def start(self, e: int) -> None:
        g = 0
        p = self.prev.get(e)
        if p is not None:
            g |= self._cover(p)
        for c, th in self.st.waits[e]:
            sig = self.sig.get(c, [])
            covers = [self._cover(x) for x in sig]
            if th >= len(sig):
                for cv in covers:
                    g |= cv
            elif th > 0:
                # X is implied only if every th-subset of signallers implies it: fewer than
                # th signallers may fail to cover X.
                union = 0
                for cv in covers:
                    union |= cv
                x = union
                while x:
                    low = x & -x
                    missing = sum(1 for cv in covers if not cv & low)
                    if missing < th:
                        g |= low
                    x ^= low
        self.G[e] = g
        self.current = e
        if not self.st.runs[e]:
            return
        t = self._task(e)
        for u in self.edges_in.get(t, []):
            if not (g >> self.st.main[u]) & 1:
                raise RaceError(
                    self.plan.describe(e),
                    f"schedule edge {u} -> {t} is not ordered: {self.explain(u, t)}",
                )

    def finish(self, e: int) -> None:
        self.done[e] = True
        self.current = -1

    def ordered(self, u: int, e: int) -> bool:
        return u == e or bool((self.G[e] >> u) & 1)

    def explain(self, u: int, t: int) -> str:
        """Why the protocol does not order task u before task t (names counter / edge)."""
        st = self.st
        name_u = f"{st.task_names[u]!r} (task {u}, worker {st.task_workers[u]})"
        for c, th in dict.fromkeys(self.task_waits[t]):
            if c not in self.task_sigs[u]:
                continue
            n = len(self.task_sig.get(c, ()))
            if th < n:
                return (
                    f"counter {c} {st.counter_names[c]!r} has threshold {th} but {n} tasks "
                    f"signal it, so it can open before {name_u} signals"
                )
        waits = ", ".join(
            f"{c} {st.counter_names[c]!r}" for c in dict.fromkeys(c for c, _ in self.task_waits[t])
        )
        edge = (
            f"the schedule has edge {u} -> {t} but no counter covers it (a dropped wait)"
            if (u, t) in self.edge_set
            else f"the schedule has no edge {u} -> {t}"
        )
        sig_u = ", ".join(f"{c} {st.counter_names[c]!r}" for c in dict.fromkeys(self.task_sigs[u]))
        return (
            f"{st.task_names[t]!r} waits on counters [{waits or 'none'}], none of which orders "
            f"{name_u} (it signals [{sig_u or 'none'}]) before it, and it is not earlier on "
            f"worker {st.task_workers[t]}'s queue; {edge}"
        )

    # -- word tracking (entries that run kernels) -----------------------------------------
    def _race(self, e: int, other: int, what: str, words: np.ndarray) -> RaceError:
        w = int(words.reshape(-1)[0]) if words.size else 0
        tensor = self.arena.owner(w)
        return RaceError(
            self.plan.describe(e),
            f"{what} {tensor!r} (arena word {w}) against task {self._task(other)} "
            f"{self._name(other)!r}: {self.explain(self._task(other), self._task(e))}",
        )

    def on_read(self, words: np.ndarray) -> None:
        e = self.current
        flat = words.reshape(-1)
        if flat.size == 0:
            return
        prior = np.unique(self.writer[flat])
        for w in prior.tolist():
            if w >= 0 and not self.ordered(w, e):
                hit = flat[self.writer[flat] == w]
                raise self._race(e, w, "reads", hit)
        self.reads.append((e, int(flat.min()), int(flat.max()), flat))

    def on_write(self, words: np.ndarray) -> None:
        e = self.current
        flat = words.reshape(-1)
        if flat.size == 0:
            return
        prior = np.unique(self.writer[flat])
        for w in prior.tolist():
            if w >= 0 and not self.ordered(w, e):
                raise self._race(e, w, "overwrites (write after write)", flat)
        lo, hi = int(flat.min()), int(flat.max())
        t = self._task(e)
        for r, rlo, rhi, rw in self.reads:
            if r == e or rhi < lo or rlo > hi or self.ordered(r, e):
                continue
            hit = np.intersect1d(rw, flat)
            if hit.size:
                what = self.arena.owner(int(hit[0]))
                tr = self._task(r)
                if self.plan.packets[t].op < self.plan.packets[tr].op:
                    # the writer's op comes first: the reader consumed stale bytes
                    raise RaceError(
                        self.plan.describe(r),
                        f"read {what!r} (arena word {int(hit[0])}) before task {t} "
                        f"{self._name(e)!r} wrote it (a stale read): {self.explain(t, tr)}",
                    )
                raise RaceError(
                    self.plan.describe(e),
                    f"writes {what!r} (arena word {int(hit[0])}) that task {tr} "
                    f"{self._name(r)!r} read earlier in this step, and the protocol does not "
                    f"order that read before this write: {self.explain(tr, t)}",
                )
        self.writer[flat] = e


class _CheckedAccess(_PlainAccess):
    def __init__(
        self,
        arena: Arena,
        weights: Mapping[str, np.ndarray],
        chk: _Checker,
        counts: Counter[str] | None = None,
    ) -> None:
        super().__init__(arena, weights, counts)
        self.chk = chk
        self._wviews: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}

    def _words(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = (name, shape)
        if key not in self._wviews:
            self._wviews[key] = self.arena.words(name).reshape(shape)
        return self._wviews[key]

    def get(self, name: str, shape: tuple[int, ...], idx: Index) -> np.ndarray:
        self.chk.on_read(np.asarray(self._words(name, shape)[idx]))
        return super().get(name, shape, idx)

    def put(self, name: str, shape: tuple[int, ...], idx: Index, value: np.ndarray) -> None:
        self.chk.on_write(np.asarray(self._words(name, shape)[idx]))
        super().put(name, shape, idx, value)


def _blocked_report(plan: Plan, head: list[int], counters: list[int], limit: int = 8) -> str:
    st = plan.stream
    lines = []
    blocked = [w for w, q in enumerate(st.queues) if head[w] < len(q)]
    for w in blocked[:limit]:
        e = st.queues[w][head[w]]
        t = st.task_of[e]
        waits = [
            f"counter {c} {st.counter_names[c]!r} at {counters[c]}/{th}"
            for c, th in st.waits[e]
            if counters[c] < th
        ]
        at = f"task {t}" if st.runs[e] else f"nop packet {st.packet[e]} of task {t}"
        lines.append(f"worker {w} at {at} {st.task_names[t]!r} waits on {', '.join(waits)}")
    more = f"; and {len(blocked) - limit} more workers" if len(blocked) > limit else ""
    return f"{len(blocked)} workers blocked: " + "; ".join(lines) + more


class Machine:
    """Runs plans on an arena. `weights` are fp32 arrays by tensor name (read-only)."""

    def __init__(
        self,
        arena: Arena,
        weights: Mapping[str, np.ndarray],
        *,
        mode: Mode = "round_robin",
        seed: int = 0,
        check: bool = False,
    ) -> None:
        self.arena = arena
        self.weights = weights
        self.mode: Mode = mode
        self.seed = seed
        self.check = check
        self.dispatches = 0
        self.entries_run = 0  # queue entries run over all dispatches (task packets + nops)
        self.nops_run = 0  # nop packets run over all dispatches
        # per-op work the kernels report over all dispatches (`Access.count`), e.g.
        # `sample.scan` (logits elements scanned by the sample op), `lm_head.argmax`
        self.counts: Counter[str] = Counter()
        self._access: tuple[int, object, _PlainAccess] | None = None

    def _plain(self) -> _PlainAccess:
        key = id(self.arena.buf)
        if (
            self._access is None
            or self._access[0] != key
            or self._access[1] is not (self.arena.layout)
        ):
            self._access = (
                key,
                self.arena.layout,
                _PlainAccess(self.arena, self.weights, self.counts),
            )
        return self._access[2]

    def dispatch(
        self,
        plan: Plan,
        *,
        mode: Mode | None = None,
        seed: int | None = None,
        check: bool | None = None,
        on_task: Callable[[int], None] | None = None,
    ) -> DispatchStats:
        """Run every task of `plan` once (one step). See the module docstring."""
        mode = mode or self.mode
        check = self.check if check is None else check
        if self.arena.layout is not plan.layout:
            self.arena.use(plan.layout)
        st = plan.stream
        rng = np.random.default_rng(
            (self.seed if seed is None else seed, self.dispatches) if mode == "random" else 0
        )
        self.dispatches += 1
        chk = _Checker(plan, self.arena) if check else None
        acc: _PlainAccess = (
            _CheckedAccess(self.arena, self.weights, chk, self.counts)
            if chk is not None
            else self._plain()
        )
        waits, sigs, runs, task_of = st.waits, st.signals, st.runs, st.task_of
        counters = [0] * len(st.counter_names)
        head = [0] * len(st.queues)
        blocked: dict[tuple[int, int], list[int]] = {}  # (counter, threshold) -> workers
        ready: deque[int] = deque()
        pool: list[int] = []

        def try_ready(w: int) -> None:
            q = st.queues[w]
            if head[w] >= len(q):
                return
            for c, th in waits[q[head[w]]]:
                if counters[c] < th:
                    blocked.setdefault((c, th), []).append(w)
                    return
            if mode == "random":
                pool.append(w)
            else:
                ready.append(w)

        for w in range(len(st.queues)):
            try_ready(w)
        order: list[int] = []
        ran = 0
        while ready or pool:
            if mode == "random":
                i = int(rng.integers(len(pool)))
                pool[i], pool[-1] = pool[-1], pool[i]
                w = pool.pop()
            else:
                w = ready.popleft()
            e = st.queues[w][head[w]]
            if chk is not None:
                chk.start(e)
            if runs[e]:
                t = task_of[e]
                run_packet(plan, plan.packets[t], acc)
                order.append(t)
                if on_task is not None:
                    on_task(t)
            if chk is not None:
                chk.finish(e)
            ran += 1
            head[w] += 1
            for c in sigs[e]:
                counters[c] += 1
                for w2 in blocked.pop((c, counters[c]), []):
                    try_ready(w2)
            try_ready(w)
        if ran < len(runs):
            raise DeadlockError(f"bucket {plan.bucket.name}", _blocked_report(plan, head, counters))
        self.entries_run += ran
        self.nops_run += ran - len(order)
        return DispatchStats(len(order), tuple(order), ran, ran - len(order))
