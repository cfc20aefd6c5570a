"""Checkpoint A payload: the model's canonical op table, the bundle's op table, and the
rewrites the bundle says it applied (docs/egraph.md "Checkpoint A", docs/oracle.md).

Derived from the bundle only (`rewrites_payload`):

- `canonical`: the op table the graph lowering (`plow.graph.build_graph`, the one the
  differential tests check against transformers) builds from the bundle's own
  `config.json` for the rung's bucket;
- `bundle`: the rung's `plan/<bucket>.ops.json` as it is on disk (ops: kind, attributes,
  operand and output tensor names in order; tensors: shapes);
- `blocks` / `layouts`: the bundle's `rewrites.json` (section "The applied-rewrites file"
  of docs/egraph.md); no file means no rewrites;
- `outputs`: the canonical tensors a step leaves behind (roles output, cache, state).

The oracle (Plow.Rewritescheck.check_checkpoint_a) accepts when every op of the bundle's
table is its canonical op exactly (a pass-through: kind, every attribute, operands in
order, the weight tensors by name) or the fused op of a block that is an instance of its
rule over the canonical ops it names (theorem Plow.Rewritescheckproof.checkpoint_a_sound).
The reader here only reads and checks the file's shape; every comparison is the oracle's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

REWRITES_FILE = "rewrites.json"
# Canonical tensors whose value outlives a step: no rewrite may fuse one away.
OUTPUT_ROLES = ("output", "cache", "state")


class RwOp(BaseModel):
    """One op of an op table: what checkpoint A compares."""

    model_config = ConfigDict(frozen=True)

    name: str
    kind: str
    attrs: dict[str, Any]
    inputs: list[str]  # operand tensor names, in order (activations and weights)
    outputs: list[str]


class RwTable(BaseModel):
    model_config = ConfigDict(frozen=True)

    ops: list[RwOp]
    shapes: dict[str, list[int]]  # every tensor an op names


class RwBlock(BaseModel):
    """One applied rewrite: `rule` replaced the canonical ops `canonical` (indices into the
    canonical table, in order) by the bundle op `fused` (an index into the bundle's)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rule: str
    canonical: list[int]
    fused: int = Field(ge=0)


class RwLayout(BaseModel):
    """A bundle weight stored re-laid-out from the model's `sources`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    weight: str
    layout: Literal["interleave", "cat3"]
    sources: list[str]


class RewritesFile(BaseModel):
    """`rewrites.json` (docs/egraph.md "The applied-rewrites file")."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    blocks: list[RwBlock] = Field(default_factory=list)
    layouts: list[RwLayout] = Field(default_factory=list)


class RewritesPayload(BaseModel):
    model_config = ConfigDict(frozen=True)

    canonical: RwTable
    bundle: RwTable
    blocks: list[RwBlock]
    layouts: list[RwLayout]
    outputs: list[str]


def _table(ops: Iterable[Any], shape_of: dict[str, list[int]]) -> RwTable:
    rows = [
        RwOp(
            name=o.name,
            kind=o.kind if isinstance(o.kind, str) else o.kind.value,
            attrs=dict(o.attrs),
            inputs=list(o.inputs),
            outputs=list(o.outputs),
        )
        for o in ops
    ]
    named = {t for r in rows for t in (*r.inputs, *r.outputs)}
    return RwTable(ops=rows, shapes={t: shape_of[t] for t in sorted(named) if t in shape_of})


def read_rewrites(bundle: Path) -> RewritesFile | str:
    """The bundle's applied rewrites (none without the file), or a one-line problem."""
    p = Path(bundle) / REWRITES_FILE
    if not p.is_file():
        return RewritesFile()
    try:
        return RewritesFile.model_validate_json(p.read_bytes())
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "top level"
        return f"{REWRITES_FILE}: {where}: {err['msg']}"


def block_problems(rw: RewritesFile, n_canonical: int, n_bundle: int) -> str | None:
    """What makes the file's blocks unreadable as blocks (an index outside its table, an op
    claimed by two blocks); the oracle checks everything else."""
    seen_c: dict[int, int] = {}
    seen_f: dict[int, int] = {}
    for b, blk in enumerate(rw.blocks):
        if blk.fused >= n_bundle:
            return (
                f"{REWRITES_FILE}: block {b} ({blk.rule}): fused op {blk.fused} is outside "
                f"the op table's {n_bundle} ops"
            )
        if blk.fused in seen_f:
            return (
                f"{REWRITES_FILE}: block {b} ({blk.rule}): fused op {blk.fused} is already "
                f"block {seen_f[blk.fused]}'s"
            )
        seen_f[blk.fused] = b
        if not blk.canonical:
            return f"{REWRITES_FILE}: block {b} ({blk.rule}): no canonical ops"
        for c in blk.canonical:
            if not 0 <= c < n_canonical:
                return (
                    f"{REWRITES_FILE}: block {b} ({blk.rule}): canonical op {c} is outside "
                    f"the model graph's {n_canonical} ops"
                )
            if c in seen_c:
                return (
                    f"{REWRITES_FILE}: block {b} ({blk.rule}): canonical op {c} is already "
                    f"block {seen_c[c]}'s"
                )
            seen_c[c] = b
    return None


def rewrites_payload(bundle: Path, ops_file: Path, bucket: Any) -> RewritesPayload | str:
    """Checkpoint A's payload for one rung, from the bundle's files: `config.json` (lowered
    for `bucket`), the rung's op table file `ops_file` and `rewrites.json`. Returns a
    one-line problem when a file cannot be read as what it should be."""
    from plow.checkpoint import load_spec
    from plow.errors import PlowError
    from plow.graph.build import build_graph

    bundle = Path(bundle)
    try:
        graph = build_graph(load_spec(bundle / "config.json"), bucket)
    except PlowError as e:
        return f"config.json: cannot lower the model's graph: {e.problem}"
    try:  # a tensor-parallel bundle: the canonical graph is the shard pass's (docs/parallel.md)
        from plow.graph.shard import shard_graph

        target = json.loads((bundle / "manifest.json").read_bytes()).get("target", {})
        graph = shard_graph(graph, int(target.get("gpus", 1)))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        return f"manifest.json: cannot read the target's gpus: {e}"
    except PlowError as e:
        return f"config.json: cannot shard the model's graph: {e.problem}"
    try:
        doc = json.loads(Path(ops_file).read_bytes())
        ops = [_FileOp(o) for o in doc["ops"]]
        bshapes = {n: list(t["shape"]) for n, t in doc["tensors"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{Path(ops_file).name}: cannot read the op table: {e}"
    rw = read_rewrites(bundle)
    if isinstance(rw, str):
        return rw
    problem = block_problems(rw, len(graph.ops), len(ops))
    if problem is not None:
        return problem
    cshapes = {n: list(t.shape) for n, t in graph.tensors.items()}
    return RewritesPayload(
        canonical=_table(graph.ops, cshapes),
        bundle=_table(ops, bshapes),
        blocks=list(rw.blocks),
        layouts=list(rw.layouts),
        outputs=sorted(n for n, t in graph.tensors.items() if t.role.value in OUTPUT_ROLES),
    )


class _FileOp:
    """An op entry of the op table file, as read (no defaults filled in)."""

    def __init__(self, o: dict[str, Any]) -> None:
        self.name = str(o["name"])
        self.kind = str(o["kind"])
        self.attrs = dict(o.get("attrs", {}))
        self.inputs = [str(x) for x in o["inputs"]]
        self.outputs = [str(x) for x in o["outputs"]]
