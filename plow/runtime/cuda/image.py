"""A lowered plan (`plow.runtime.native.lower.Lowered`, host pointers) as the CUDA kernel reads
it: the same `PlowPlan` / `PlowOp` descriptors with every pointer moved to device memory, plus
what the host build derives when it loads a plan (kernels/host.cpp `plow_plan_new`), computed
here once: each worker's queue (record indices in file order), signals per step of each
counter, each counter's scope (the scope its signalling records carry), the attention scratch.

`build_image` takes an `upload(array, cache) -> device address` callable, so it runs without a
GPU: the tests give it a recording fake and check every pointer the kernel will follow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plow.checkpoint.quant import QuantTensor
from plow.errors import PlowError
from plow.runtime.cuda.abi import NO_COUNTER
from plow.runtime.native.library import KINDS, PlowOp, PlowPlan
from plow.runtime.native.lower import Lowered

Upload = Callable[[np.ndarray, bool], int]
PAGE_WORDS = 8  # int32 words per record of the kernel's page table (device.cu PLOW_PAGE_WORDS)
OP_POINTERS = ("w0", "w1", "table", "merge")


@dataclass
class DeviceImage:
    """Device addresses of one plan's descriptors and tables, and their host copies."""

    plan: int
    queue: int
    queue_start: int
    per_step: int
    counter_scope: int
    n_workers: int
    n_counters: int
    n_ops: int
    scratch_floats: int
    per_step_host: np.ndarray
    scope_host: np.ndarray
    queue_host: np.ndarray
    queue_start_host: np.ndarray
    plan_host: PlowPlan  # the PlowPlan uploaded (device pointers)
    ops_host: Any  # the PlowOp array uploaded (device pointers)
    records_host: np.ndarray  # the plan file's records (PACKET_DTYPE)
    keep: list[Any] = field(default_factory=list)


def _address(v: Any) -> int:
    return int(v) if v else 0


def queues(records: np.ndarray, n_workers: int) -> tuple[np.ndarray, np.ndarray]:
    """Record indices grouped by worker, file order inside a worker (int32), and the
    `n_workers + 1` offsets of each worker's run (int64)."""
    w = records["worker"].astype(np.int64)
    order = np.argsort(w, kind="stable").astype(np.int32)
    starts = np.searchsorted(w[order], np.arange(n_workers + 1), side="left").astype(np.int64)
    return order, starts


def counter_tables(records: np.ndarray, n_counters: int) -> tuple[np.ndarray, np.ndarray]:
    """Signals per step of each counter (uint64) and its scope (uint8: the widest scope of
    its signalling records; device for a counter nothing signals)."""
    sig = records["signal_counter"].astype(np.int64)
    live = sig != NO_COUNTER
    per_step = np.bincount(sig[live], minlength=n_counters).astype(np.uint64)[:n_counters]
    scope = np.zeros(n_counters, dtype=np.uint8)
    np.maximum.at(scope, sig[live], records["scope"][live].astype(np.uint8))
    scope[per_step == 0] = 1
    return per_step, scope


def scratch_floats(ops: Any, n_ops: int) -> int:
    """Floats of scratch one attention thread needs (tiles.h's attention_scratch_floats with
    the device build's PLOW_ATTN_ROWS = 1: keys of a tile + head dim), with the host's slack."""
    need = 0
    for i in range(n_ops):
        o = ops[i]
        if o.kind == KINDS["attention"]:
            keys = o.tile[1] if o.tile[1] > 0 else o.ext[1]
            need = max(need, int(keys + o.d[4]))
    return need + 16


def build_image(low: Lowered, upload: Upload) -> DeviceImage:
    """Upload `low`'s descriptors and everything they point into (`upload(array, cache)`;
    `cache`: the array may be shared with other plans — weights — and uploaded once)."""
    by_address: dict[int, np.ndarray] = {}
    for obj in low.keep:
        if isinstance(obj, QuantTensor):  # GGML blocks: the kernel points at the raw bytes
            obj = obj.blocks
        if isinstance(obj, np.ndarray) and obj.nbytes:
            by_address.setdefault(int(obj.ctypes.data), obj)
    moved: dict[int, int] = {}

    def device(addr: Any, what: str) -> int:
        a = _address(addr)
        if a == 0:
            return 0
        got = moved.get(a)
        if got is not None:
            return got
        arr = by_address.get(a)
        if arr is None:
            raise PlowError(what, "points at memory the lowered plan does not hold (loader bug)")
        moved[a] = upload(np.ascontiguousarray(arr), True)
        return moved[a]

    p = low.plan
    n_ops = int(p.n_ops)
    src_ops = (PlowOp * max(1, n_ops)).from_address(int(p.ops))
    ops = (PlowOp * max(1, n_ops)).from_buffer_copy(src_ops)
    for i in range(n_ops):
        for f in OP_POINTERS:
            setattr(ops[i], f, device(getattr(ops[i], f), f"op {i} {f}") or None)
    records = by_address.get(_address(p.records))
    if records is None or len(records) != int(p.n_records):
        raise PlowError("records", "the lowered plan does not hold its records (loader bug)")
    n_workers, n_counters = int(p.n_workers), int(p.n_counters)
    order, starts = queues(records, n_workers)
    per_step, scope = counter_tables(records, n_counters)
    ops_bytes = np.frombuffer(bytes(ops), dtype=np.uint8).copy()
    plan = PlowPlan.from_buffer_copy(p)
    plan.records = device(p.records, "records") or None
    plan.ops = upload(ops_bytes, False) or None
    plan.bounds = device(p.bounds, "bounds") or None
    plan_bytes = np.frombuffer(bytes(plan), dtype=np.uint8).copy()
    img = DeviceImage(
        plan=upload(plan_bytes, False),
        queue=upload(order, False),
        queue_start=upload(starts, False),
        per_step=upload(per_step, False),
        counter_scope=upload(scope, False),
        n_workers=n_workers,
        n_counters=n_counters,
        n_ops=n_ops,
        scratch_floats=scratch_floats(ops, n_ops),
        per_step_host=per_step,
        scope_host=scope,
        queue_host=order,
        queue_start_host=starts,
        plan_host=plan,
        ops_host=ops,
        records_host=records,
    )
    img.keep += [ops_bytes, plan_bytes, order, starts, per_step, scope]
    return img


# -- on-chip pages (the plan's page timeline in the CTA's dynamic shared memory) -------------
@dataclass(frozen=True)
class PageTable:
    """Each record's activation window in its CTA's dynamic shared memory, as the plan's page
    timeline assigns it: `table[record] = (byte offset, bytes)` (0 bytes: none), and
    `weights[record]` likewise for the weight slab (the kernel copies a linear tile's weights
    there when they fit it, and the tile reads them from there). `smem_bytes`: the budget,
    what a launch asks for."""

    table: np.ndarray  # int32 [n_records, 2]
    weights: np.ndarray  # int32 [n_records, 2]
    smem_bytes: int
    page_bytes: int
    # per record: the record whose weight load the plan hoists to this one's start (the next
    # task on the worker's queue, when its weight window opens before it starts), else -1
    prefetch: np.ndarray | None = None

    def device_table(self) -> np.ndarray:
        """What the kernel reads (PLOW_PAGE_WORDS = 8 int32 per record): {activation window
        offset, bytes, the record whose first weight tile this one loads ahead (its hoisted
        load; -1: none), 1 where the record before loads this one's (else 0), weight window
        offset, bytes, 0, 0}."""
        out = np.zeros((len(self.table), PAGE_WORDS), dtype=np.int32)
        out[:, :2] = self.table
        out[:, 2] = -1 if self.prefetch is None else self.prefetch
        if self.prefetch is not None:
            out[self.prefetch[self.prefetch >= 0], 3] = 1
        out[:, 4:6] = self.weights
        return out


def assign_pages(
    records: np.ndarray,
    budget_pages: int,
    page_bytes: int,
    start: Any,
    finish: Any,
    load: Any,
    weight_pages: Any,
    act_pages: Any,
) -> PageTable:
    """Pages of every task's windows from the schedule file's `pages` columns (task `i` is the
    `i`-th non-nop record): per worker, windows in order of opening (closings first at one
    instant) take the lowest run of free pages; a window frees its pages when it closes. Two
    windows live at the same time on one worker never share a page, and none goes past the
    budget (checkpoint C certified the timeline's occupancy; a run the fragmentation could not
    place is a `PlowError`, never an overlap)."""
    n = len(records)
    table = np.zeros((n, 2), dtype=np.int32)
    weights = np.zeros((n, 2), dtype=np.int32)
    task_rec = np.flatnonzero(records["opcode"] != 0)
    if len(task_rec) != len(act_pages):
        raise PlowError(
            "pages", f"{len(act_pages)} tasks in the page timeline, {len(task_rec)} in the plan"
        )
    per: dict[int, list[tuple[int, int, int, int, int]]] = {}  # worker -> windows
    for i, rec in enumerate(task_rec.tolist()):
        w = int(records["worker"][rec])
        if weight_pages[i]:
            per.setdefault(w, []).append(
                (int(load[i]), int(finish[i]), int(weight_pages[i]), rec, 1)
            )
        if act_pages[i]:
            per.setdefault(w, []).append((int(start[i]), int(finish[i]), int(act_pages[i]), rec, 0))
    for w, wins in per.items():
        free_at = [-1] * budget_pages  # the time each page's window closes (-1: never used)
        for st, en, pg, rec, is_w in sorted(wins, key=lambda x: (x[0], x[1])):
            if en <= st:
                en = st + 1  # an empty window still holds its pages while the task runs
            base = -1
            for p0 in range(budget_pages - pg + 1):
                if all(free_at[p] <= st for p in range(p0, p0 + pg)):
                    base = p0
                    break
            if base < 0:
                raise PlowError("pages", f"worker {w}: no {pg} free pages at {st} ns")
            for p in range(base, base + pg):
                free_at[p] = en
            dst = weights if is_w else table
            dst[rec] = (base * page_bytes, pg * page_bytes)
    # hoisted weight loads: a task's load opens before its start, at the start of the task
    # before it on the same queue (plow.memory.onchip.plan_pages) — that record prefetches it
    prefetch = np.full(n, -1, dtype=np.int32)
    last: dict[int, tuple[int, int]] = {}  # worker -> (its previous task, that task's record)
    for i, rec in enumerate(task_rec.tolist()):
        w = int(records["worker"][rec])
        prev = last.get(w)
        if prev is not None and weight_pages[i] and int(load[i]) < int(start[i]):
            prefetch[prev[1]] = rec
        last[w] = (i, rec)
    return PageTable(table, weights, budget_pages * page_bytes, page_bytes, prefetch)


def op_modes(ops: Any, n_ops: int, tensor_cores: bool) -> np.ndarray:
    """One byte per op for the kernel: MODE_TC for a linear, lm_head, linear_qkv or linear_glu
    whose weights are stored bf16 (the plan's precision) when tensor cores are asked for; 0
    (the scalar path) else."""
    from plow.runtime.cuda.abi import MODE_TC
    from plow.runtime.native.library import DTYPE_BF16
    from plow.runtime.native.lower import FUSED_KINDS

    out = np.zeros(max(1, n_ops), dtype=np.uint8)
    if not tensor_cores:
        return out
    lin = {KINDS["linear"], KINDS["lm_head"], FUSED_KINDS["linear_qkv"], FUSED_KINDS["linear_glu"]}
    for i in range(n_ops):
        o = ops[i]
        if o.kind in lin and o.w0_dtype == DTYPE_BF16:
            out[i] = MODE_TC
    return out
