"""What a weight costs to read: its stored bytes, not its logical dtype's (docs/tiling.md).

The graph's weight tensors carry the model's logical dtype (the config's: float32 for the
GGUF default model, bfloat16 for an fp8 or int4 checkpoint), but the bundle stores a
block-quantized weight as its blocks (q4_0: 18 bytes per 32 weights, q4_1: 20, q8_0: 34;
compressed-tensors int4 repacked as q4_0) and an fp8 weight as 1 byte per weight plus its
scale tensor. A tile that reads a weight moves those bytes, so the tiler prices a weight at
`stored_weight_bytes` (the bytes the bundle writer stores for it: the checkpoint's entry,
re-laid-out or sliced as the bundle stores it, plus an fp8 weight's scales) and a box of
`e` of its `n` elements at `ceil(e * stored / n)` (`box_bytes`: proportional, so the
tiles of a weight together are charged at least its stored bytes).

Checkpoint B checks the plan against the same numbers, read back from the bundle's own
weights file (`plow.emit.verify.expected_numbers`: a step reads at least the stored bytes of
every weight it reads whole, T6), so the bound stays sound: the tiler's bytes are never
below what B derives. Without weights to ask (`--plan-only`, a config.json) a weight is
priced at its logical dtype, and B derives the same from the op table's shapes and dtypes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from plow.errors import PlowError
from plow.tiles.cost import cdiv


def box_bytes(stored: int, numel: int, elems: int) -> int:
    """Bytes charged for reading `elems` of a weight's `numel` elements stored in `stored`
    bytes (proportional, rounded up)."""
    return cdiv(elems * stored, max(1, numel))


def entry_bytes(store: object, name: str) -> int:
    """The bytes one weight occupies in the bundle: its entry's (as `store` resolves it:
    a `WeightStore`, or the bundle writer's `Resolved` over one) plus its fp8 scales'."""
    e = store.entry(name)  # type: ignore[attr-defined]
    n = int(e.nbytes)
    scale = store.fp8_scale(name)  # type: ignore[attr-defined]
    if scale is not None:
        n += int(store.entry(scale).nbytes)  # type: ignore[attr-defined]
    return n


def stored_weight_bytes(
    source: Path,
    names: Iterable[str],
    layouts: Mapping[str, tuple[str, tuple[str, ...]]] | None = None,
) -> dict[str, int] | None:
    """Per weight of `names`, the bytes the bundle stores for it (module docstring), from
    the checkpoint at `source`; `layouts`: the re-laid-out and sliced weights (name ->
    (layout, sources)) the bundle writer builds. None when `source` has no weights (a
    config.json). A name the writer could not resolve is left out (priced at its dtype)."""
    from plow.checkpoint.loader import weight_files
    from plow.checkpoint.weights import WeightStore
    from plow.emit.bundle import Resolved

    if not Path(source).is_dir():
        return None
    try:
        store = WeightStore.open(weight_files(Path(source)), where=source)
    except PlowError:
        return None
    resolved = Resolved(store, dict(layouts or {}))
    out: dict[str, int] = {}
    for n in names:
        try:
            out[n] = entry_bytes(resolved, n)
        except (PlowError, KeyError):
            continue
    return out


def header_weight_bytes(entries: Mapping[str, object]) -> dict[str, int]:
    """Per tensor of a bundle's weights file (`read_header`), its stored bytes plus those of
    its fp8 scale tensor (`<name>_scale_inv` / `<name>_scale`, stored beside it)."""
    from plow.checkpoint.fp8 import FP8, SCALE_SUFFIXES

    out: dict[str, int] = {}
    for n, e in entries.items():
        b = int(e.nbytes)  # type: ignore[attr-defined]
        scale = next((n + s for s in SCALE_SUFFIXES if n + s in entries), None)
        if e.dtype == FP8 and scale is not None:  # type: ignore[attr-defined]
            b += int(entries[scale].nbytes)  # type: ignore[attr-defined]
        out[n] = b
    return out
