"""Greedy sampling fused into lm_head, decided by the compiler (docs/wire.md `FUSED_ARGMAX`).

A bucket whose graph has a `sample` op reading the logits of an `lm_head` op is compiled
fused: both ops' op-table entries name `<lm_head>#argmax` (`OpEntry.argmax`), the arena map
places it (fp32 `[chunks, M]`, the chunk's maximum per logits row) and
`<lm_head>#argmax.index` (int32 `[chunks, M]`, the lowest column of that maximum) after every
other buffer, and every non-load packet of both ops carries the `FUSED_ARGMAX` flag
(checkpoint E checks the flag per op against the op table; D derives the chunks' writes and
reads; F places the two buffers).

Chunk `i` is the logits columns `[bounds[i], bounds[i + 1])`; `bounds` (`argmax_bounds`) are
every column boundary of the units that write the logits — the compute tiles of an unsplit
lm_head, the merge units of a k-split one — computed from the op table alone, so each unit
covers whole chunks and each chunk has exactly one writer. The executors (the CPU kernels,
the native library, the CUDA source) read the same rule from the same op table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from plow.bundle.files import OpEntry, OpTable


class _Op(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def inputs(self) -> Sequence[str]: ...
    @property
    def outputs(self) -> Sequence[str]: ...


def argmax_name(lm_head: str) -> str:
    return lm_head + "#argmax"


def index_name(lm_head: str) -> str:
    return lm_head + "#argmax.index"


def fused_pair(ops: Sequence[_Op]) -> tuple[int, int] | None:
    """(lm_head op index, sample op index) when the first sample op reads an lm_head's
    logits; None otherwise (nothing to fuse)."""
    si = next((i for i, o in enumerate(ops) if o.kind == "sample"), None)
    if si is None or not ops[si].inputs:
        return None
    lm = next(
        (i for i, o in enumerate(ops) if o.kind == "lm_head" and ops[si].inputs[0] in o.outputs),
        None,
    )
    return None if lm is None else (lm, si)


def argmax_bounds(ot: OpTable, lm: OpEntry, workers: int) -> tuple[int, ...]:
    """The chunk bounds of a fused lm_head (module docstring): sorted, from 0 to the logits
    width `N` (the op's second axis), every writer unit's column range cut out."""
    from plow.oracle.payloads.dataflow import merge_boxes

    if len(lm.axes) < 3:
        raise ValueError(f"op {lm.name!r}: an lm_head has axes (m, n, k)")
    n_ax, k_ax = lm.axes[1], lm.axes[2]
    width = n_ax.extent
    bounds = {0, width}
    if k_ax.steps > 1:  # k-split: the merges write the logits
        for _r0, _r1, c0, c1 in merge_boxes(ot, lm, workers):
            c0, c1 = max(0, min(width, c0)), max(0, min(width, c1))
            if c1 > c0:
                bounds.update((c0, c1))
    else:
        step = max(1, n_ax.tile)
        bounds.update(range(0, width, step))
    return tuple(sorted(bounds))


def argmax_rows(lm: OpEntry) -> int:
    """Rows of the logits view (`M`, the lm_head's first axis)."""
    return lm.axes[0].extent


def argmax_problem(ot: OpTable, workers: int) -> str | None:
    """What is wrong with an op table's fused greedy, or None (`plow verify`'s cross-check
    and the executors' loader): `argmax` is named by exactly the lm_head and the sample op
    reading its logits (`fused_pair`), as `<lm_head>#argmax`, and both buffers are tensors
    of shape `[chunks, M]` (fp32 values, int32 index) for the chunks of `argmax_bounds`. An op
    table that names none is not fused (the sample op scans the logits): nothing to check."""
    named = [o for o in ot.ops if o.argmax is not None]
    if not named:
        return None
    pair = fused_pair(ot.ops)
    want = {} if pair is None else {ot.ops[i].name: i for i in pair}
    for o in named:
        if o.name not in want:
            return (
                f"op {o.name!r} ({o.kind}) names the argmax buffer {o.argmax!r} but is not an "
                "lm_head or the sample op reading its logits"
            )
    assert pair is not None
    lm = ot.ops[pair[0]]
    for i in pair:
        o = ot.ops[i]
        if o.argmax != argmax_name(lm.name):
            return f"op {o.name!r} ({o.kind}): argmax {o.argmax!r}, not {argmax_name(lm.name)!r}"
    shape = [len(argmax_bounds(ot, lm, workers)) - 1, argmax_rows(lm)]
    for name, dtype in ((argmax_name(lm.name), "float32"), (index_name(lm.name), "int32")):
        t = ot.tensors.get(name)
        if t is None:
            return f"the fused argmax buffer {name!r} is not a tensor of the op table"
        if t.shape != shape or t.dtype != dtype:
            return f"tensor {name!r} is {t.dtype} {t.shape}, the fused argmax needs {dtype} {shape}"
    return None
