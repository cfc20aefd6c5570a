"""Routed experts in the schedule: expected and worst-case task costs, sampled routings, and
the collapse decision's estimate for edges whose slice costs depend on the router.

The plan is static: every expert's tiles are in the stream, a tile whose expert no row of it
chose does no work but still signals (it costs `tile_overhead_ns`). Which tiles are idle is
decided by the router at run time, so an expert task's cost is a random variable.

Routing model (an assumption, stated in every decision it drives): each row picks `top_k` of
the `E` experts uniformly at random, independently of the other rows and layers. Then a tile
of `r` rows is busy with probability `1 - (1 - k/E)^r` (`plow.tiles.cost.busy_probability`)
and an expert expects `rows * k / E` tokens. Worst case: every tile busy — what the task est
times (and the schedule's makespan) are, a bound on every routing.

C7 / C8 are about one fixed table of slice costs. A routing fixes the table, so when an
edge's consumer slices cost the same in every routing (no routed consumer), C8 certifies
coarse counters in every routing. When the consumer slices are routed, their costs differ
from routing to routing and, in almost every routing, from slice to slice: C8 certifies
nothing there. `two_stage_gain` prices such an edge on C7's own model (two stages, every
slice on its own worker, arrivals at 0) over sampled routings: the expected time by which
fine gates open the barrier earlier than coarse ones — an estimate, not a theorem. What is
proved per routing: where some costliest consumer slice waits on a latest producer slice
(`latest_gated`), fine gates open that model's barrier exactly when coarse ones do
(`Plow.Gatedproof.latest_gated_sound`, C7r); the decision counts the sampled routings where
that holds. For all routings: where the edge's structure satisfies `coupled_ok` (each
consumer slice's expert tiles are keys of producers in its gate, each producer's expert is
some consumer's, uniform idle / busy costs; `coupled_edge` reads it off the tasks),
`Plow.Gatedproof.coupled_c7r_all_routings` gives `latest_gated` in every busy set of
experts, so every routing: the decision certifies coarse there and samples nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from plow.graph.ops import OpGraph
from plow.schedule.regions import tile_ranges
from plow.tiles.cost import busy_probability
from plow.tiles.ir import TileGraph

SAMPLES = 20  # sampled routings per decision (uniform top-k), fixed seed: deterministic
SEED = 0


@dataclass(frozen=True, slots=True)
class RoutedOp:
    """An `expert_linear` op's tiles as the router sees them: the expert of each tile and its
    row range (rows = tokens of the bucket)."""

    op: str
    layer: int
    experts: int
    top_k: int
    rows: int
    expert: npt.NDArray[np.int64]  # per tile
    r0: npt.NDArray[np.int64]
    r1: npt.NDArray[np.int64]

    def busy_probability(self) -> npt.NDArray[np.float64]:
        """Per tile: the probability that some row of it chose its expert."""
        sizes, inv = np.unique(self.r1 - self.r0, return_inverse=True)
        by_size = [busy_probability(int(r), self.top_k, self.experts) for r in sizes]
        return np.array(by_size, dtype=np.float64)[inv.reshape(-1)]

    def busy(self, chosen: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
        """Per sampled routing (`chosen[s, row, expert]`), which tiles do work: [S, tiles]."""
        # rows r0..r1 chose expert e: an `any` per segment between the tiles' row bounds,
        # then a prefix count over the (few) segments
        bounds = np.unique(np.concatenate([self.r0, self.r1]))
        seg = np.logical_or.reduceat(chosen, bounds[:-1], axis=1)
        pre = np.zeros((chosen.shape[0], len(bounds), chosen.shape[2]), dtype=np.int32)
        np.cumsum(seg, axis=1, out=pre[:, 1:])
        i0, i1 = np.searchsorted(bounds, self.r0), np.searchsorted(bounds, self.r1)
        return (pre[:, i1, self.expert] - pre[:, i0, self.expert]) > 0


def routed_ops(tg: TileGraph, graph: OpGraph) -> dict[str, RoutedOp]:
    """The routed (`expert_linear`) ops of a tile graph, with their router's top-k."""
    top_k = {op.outputs[0]: int(op.attrs["top_k"]) for op in graph.ops if op.kind.value == "router"}
    ops = {op.name: op for op in graph.ops}
    out: dict[str, RoutedOp] = {}
    for top in tg.ops:
        if top.kind != "expert_linear":
            continue
        op = ops[top.name]
        n_exp, wn, k_in = graph.tensor(op.inputs[2]).shape
        ranges = tile_ranges(top)  # the tiler's enumeration, from the axes
        if ranges is None:
            ranges = np.array([t.ranges for t in top.tiles], dtype=np.int64).reshape(-1, 3, 2)
        if op.attrs["mode"] == "gate_up":
            expert = ranges[:, 1, 0] // (wn // 2)
        else:
            expert = ranges[:, 2, 0] // k_in
        out[top.name] = RoutedOp(
            top.name,
            int(op.layer or 0),
            int(n_exp),
            top_k.get(op.inputs[1], int(n_exp)),
            int(top.axes[0].extent),
            expert.astype(np.int64),
            ranges[:, 0, 0].copy(),
            ranges[:, 0, 1].copy(),
        )
    return out


def sample_routings(
    samples: int, rows: int, experts: int, top_k: int, seed: int
) -> npt.NDArray[np.bool_]:
    """`samples` uniform top-k routings: `chosen[s, row, e]` (each row exactly `top_k` experts)."""
    rng = np.random.default_rng(seed)
    draw = rng.random((samples, rows, experts))
    pick = np.argpartition(draw, top_k - 1, axis=2)[:, :, :top_k]  # the k smallest: a uniform k-set
    chosen = np.zeros((samples, rows, experts), dtype=bool)
    np.put_along_axis(chosen, pick, True, axis=2)
    return chosen


@dataclass(frozen=True, slots=True)
class TaskLoad:
    """Costs of routed compute tasks: worst case (every tile busy), expected, and one per
    sampled routing. Tasks of other ops (and the merges of routed ops, which sum every
    expert's partial) cost their est time in every routing."""

    worst: dict[int, float]
    expected: dict[int, float]
    sampled: dict[int, npt.NDArray[np.float64]]  # [S]
    note: dict[str, str]  # routed op -> the routing model, e.g. "batch 8, top-8 of 128"
    # per routed task, its cost in every routing (not only the sampled ones): (atom of each
    # tile, all-idle base ns, ns a busy tile adds, floor ns); the task costs
    # max(floor, base + add * busy tiles). An atom is one (layer, expert, row range): the
    # tiles of one atom are busy together.
    shape: dict[int, tuple[tuple[int, ...], float, float, float]] = field(default_factory=dict)

    def costs(self, tasks: Sequence[int], est: Sequence[float]) -> npt.NDArray[np.float64]:
        """[S, len(tasks)]: each task's cost per sampled routing."""
        s = next(iter(self.sampled.values())).shape[0] if self.sampled else 1
        out = np.empty((s, len(tasks)), dtype=np.float64)
        for j, t in enumerate(tasks):
            v = self.sampled.get(t)
            out[:, j] = est[t] if v is None else v
        return out


def task_load(
    routed: dict[str, RoutedOp],
    tasks: Sequence[tuple[int, str, Sequence[int], float, float]],
    idle_ns: float,
    samples: int = SAMPLES,
    seed: int = SEED,
    independent_layers: bool = True,
) -> TaskLoad:
    """`tasks`: (task id, op, tile indices, est ns, ns per tile) of the compute tasks of
    routed ops. A busy tile costs its `ns per tile`, an idle one `idle_ns` (its signal). One
    set of sampled routings per layer (the layer's gate_up and down see the same routing);
    `independent_layers=False` draws one set for all layers of the same shape (layer 0's):
    enough for per-edge decisions, and a prefill bucket's thousands of rows are drawn once."""
    chosen: dict[object, npt.NDArray[np.bool_]] = {}
    worst: dict[int, float] = {}
    expected: dict[int, float] = {}
    sampled: dict[int, npt.NDArray[np.float64]] = {}
    note: dict[str, str] = {}
    shape: dict[int, tuple[tuple[int, ...], float, float, float]] = {}
    atom_id: dict[tuple[int, int, int, int], int] = {}
    by_op: dict[str, list[tuple[int, Sequence[int], float, float]]] = {}
    for tid, op, units, est, tile_ns in tasks:
        by_op.setdefault(op, []).append((tid, units, est, tile_ns))
    for op, rows in by_op.items():
        r = routed[op]
        key: object = r.layer if independent_layers else (r.rows, r.experts, r.top_k)
        if key not in chosen:
            layer = r.layer if independent_layers else 0
            chosen[key] = sample_routings(
                samples, r.rows, r.experts, r.top_k, seed * 1_000_003 + layer
            )
        idle_t = ~r.busy(chosen[key])  # [S, tiles]
        spare = 1.0 - r.busy_probability()
        note[op] = (
            f"uniform top-{r.top_k} of {r.experts} experts over {r.rows} row(s): "
            f"{r.rows * r.top_k / r.experts:.3g} expected token(s) per expert"
        )
        # per task: its idle tiles (sampled) and expected idle tiles, one gather per op
        flat = np.concatenate([np.asarray(u, dtype=np.int64) for _, u, _, _ in rows])
        starts = np.cumsum([0, *[len(u) for _, u, _, _ in rows[:-1]]]).astype(np.int64)
        idle = np.add.reduceat(idle_t[:, flat].astype(np.int64), starts, axis=1)  # [S, tasks]
        spare_t = np.add.reduceat(spare[flat], starts)
        tile_atom = [
            atom_id.setdefault((r.layer, int(e), int(a), int(b)), len(atom_id))
            for e, a, b in zip(r.expert.tolist(), r.r0.tolist(), r.r1.tolist(), strict=True)
        ]
        for j, (tid, units, est, tile_ns) in enumerate(rows):
            save = max(0.0, tile_ns - idle_ns)  # what an idle tile does not spend
            shape[tid] = (
                tuple(tile_atom[u] for u in units),
                est - len(units) * save,
                save,
                idle_ns * len(units),
            )
            worst[tid] = est
            expected[tid] = est - float(spare_t[j]) * save
            sampled[tid] = np.maximum(est - idle[:, j] * save, idle_ns * len(units))
    return TaskLoad(worst, expected, sampled, note, shape)


def two_stage_gain(
    producers: Sequence[int],
    subsets: Sequence[Sequence[int]],
    consumers: Sequence[int],
    load: TaskLoad,
    est: Sequence[float],
) -> tuple[float, float, float, int]:
    """C7's model of one edge over the sampled routings: producer slices start at 0 and
    finish at their cost; consumer slice `j` starts when its gate opens (fine: the producers
    in `subsets[j]`; coarse: all `producers`) and runs for its cost; the barrier opens when
    the last consumer finishes. Returns (expected coarse barrier, expected fine barrier,
    largest per-routing gain (ns), the number of sampled routings in which `latest_gated`
    holds on the costs rounded to ns — there fine gates provably open the barrier exactly
    when coarse ones do, `Plow.Gatedproof.latest_gated_sound`)."""
    f = load.costs(producers, est)
    c = load.costs(consumers, est)
    pos = {t: i for i, t in enumerate(producers)}
    flat = np.array([pos[u] for sub in subsets for u in sub], dtype=np.int64)
    starts = np.cumsum([0, *[len(sub) for sub in subsets[:-1]]]).astype(np.int64)
    gate = np.maximum.reduceat(f[:, flat], starts, axis=1)  # [S, consumers]
    fine = (gate + c).max(axis=1)
    coarse = f.max(axis=1) + c.max(axis=1)
    fn, cn = np.rint(f).astype(np.int64), np.rint(c).astype(np.int64)
    gated = latest_gated(fn, cn, flat, starts)
    return float(coarse.mean()), float(fine.mean()), float((coarse - fine).max()), int(gated.sum())


def latest_gated(
    f: npt.NDArray[np.int64],
    c: npt.NDArray[np.int64],
    flat: npt.NDArray[np.int64],
    starts: npt.NDArray[np.int64],
) -> npt.NDArray[np.bool_]:
    """`Plow.Gated.latest_gated` per routing (rows of `f` [S, producers], `c` [S, consumers];
    consumer `j`'s gate is `flat[starts[j]:starts[j+1]]`): some consumer of the largest cost
    has a producer of the latest finish in its gate."""
    latest = f == f.max(axis=1, keepdims=True)  # [S, producers]
    has = np.add.reduceat(latest[:, flat].astype(np.int64), starts, axis=1) > 0
    costliest = c == c.max(axis=1, keepdims=True)
    return (costliest & has).any(axis=1)


def coupled_ok(
    keys: Sequence[int],
    hi: int,
    cw: int,
    atoms: Sequence[Sequence[int]],
    gates: Sequence[Sequence[int]],
) -> bool:
    """`Plow.Gated.coupled_ok`, clause for clause: one non-empty in-range gate per consumer
    slice; and either the producers cost the same in every routing (`hi == 0`) or a busy
    consumer tile costs more (`cw > 0`), every producer's key atom is an atom of some
    consumer, and every atom of a consumer is the key of a producer in its gate. Where it
    holds, `Plow.Gatedproof.coupled_c7r_all_routings`: in every routing (every busy set of
    atoms, so every top-k routing) a costliest consumer slice waits on a latest producer
    slice, and fine gates open C7's two-stage barrier exactly when coarse gates do."""
    if not (len(atoms) > 0 and len(gates) == len(atoms)):
        return False
    if not all(len(p) > 0 and all(k < len(keys) for k in p) for p in gates):
        return False
    if hi == 0:
        return True
    if not cw > 0:
        return False
    touched = {a for at in atoms for a in at}
    if not all(e in touched for e in keys):
        return False
    return all(
        all(any(keys[k] == a for k in p) for a in at) for at, p in zip(atoms, gates, strict=True)
    )


@dataclass(frozen=True, slots=True)
class CoupledEdge:
    """A routed edge on `Plow.Gated`'s structured model, in whole ns: producer slice `k` has
    key atom `keys[k]` and costs `lo` idle, `lo + hi` busy; consumer slice `j` costs
    `clo + cw * (its busy tiles)`, its tiles' atoms `atoms[j]`; `gates[j]` indexes
    producers."""

    keys: tuple[int, ...]
    lo: int
    hi: int
    clo: int
    cw: int
    atoms: tuple[tuple[int, ...], ...]
    gates: tuple[tuple[int, ...], ...]

    def ok(self) -> bool:
        return coupled_ok(self.keys, self.hi, self.cw, self.atoms, self.gates)

    def costs(self, busy: set[int]) -> tuple[list[int], list[int]]:
        """(producer costs, consumer costs) in the routing whose busy atoms are `busy`."""
        f = [self.lo + (self.hi if e in busy else 0) for e in self.keys]
        c = [self.clo + self.cw * sum(a in busy for a in at) for at in self.atoms]
        return f, c


def coupled_edge(
    producers: Sequence[int],
    subsets: Sequence[Sequence[int]],
    consumers: Sequence[int],
    load: TaskLoad,
    est: Sequence[float],
) -> tuple[CoupledEdge | None, str]:
    """An edge on the structured model of `Plow.Gated` (`coupled_ok`), or None and why it
    is not one: producer slices all routed with one atom each and the same idle / busy cost,
    or all unrouted at one cost; consumer slices routed, of one base and one busy-tile cost,
    their floor never reached (the cost is affine in the busy tiles)."""
    pos = {t: i for i, t in enumerate(producers)}
    gates = tuple(tuple(pos[u] for u in sub) for sub in subsets)
    routed_p = [t in load.shape for t in producers]
    if not any(routed_p):
        cost = {round(est[t]) for t in producers}
        if len(cost) != 1:
            return None, f"unrouted producer slices of unequal cost ({min(cost)}..{max(cost)} ns)"
        lo, hi, keys = cost.pop(), 0, tuple(0 for _ in producers)
    elif not all(routed_p):
        return None, "producer slices partly routed"
    else:
        key: list[int] = []
        lohi: set[tuple[int, int]] = set()
        for t in producers:
            at, base, add, floor = load.shape[t]
            if len(set(at)) != 1:
                return None, "a producer slice spans several experts or row ranges"
            busy, idle = round(base + add * len(at)), round(max(floor, base))
            key.append(at[0])
            lohi.add((idle, busy - idle))
        if len(lohi) != 1:
            return None, "producer slices of unequal idle or busy cost"
        (lo, hi), keys = lohi.pop(), tuple(key)
    catoms: list[tuple[int, ...]] = []
    base_add: set[tuple[int, int]] = set()
    for t in consumers:
        if t not in load.shape:
            return None, "a consumer slice is not routed"
        at, base, add, floor = load.shape[t]
        if base < floor - 0.5:
            return None, "a consumer slice's cost floor is reached (not affine in its busy tiles)"
        catoms.append(at)
        base_add.add((round(base), round(add)))
    if len(base_add) != 1:
        return None, "consumer slices of unequal base or busy-tile cost"
    clo, cw = base_add.pop()
    edge = CoupledEdge(keys, lo, hi, clo, cw, tuple(catoms), gates)
    if edge.ok():
        return edge, ""
    touched = {a for at in catoms for a in at}
    if not all(len(p) > 0 for p in gates):
        why = "a consumer slice waits on no producer"
    elif cw <= 0:
        why = "a busy consumer tile costs no more than an idle one"
    elif not all(e in touched for e in keys):
        why = "a producer slice's expert is in no consumer slice"
    else:
        why = "a consumer slice's experts are not all keys of producers in its gate"
    return None, why
