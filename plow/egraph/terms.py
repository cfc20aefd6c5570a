"""The operator graph as e-graph terms: one egglog sort for tensors, one for output pairs.

Canonical constructors are the tensor primitives the Rocq semantics defines
(`Plow/Rewrites.v`): the lowering (`plow.egraph.lower`) writes each `OpGraph` op as one of
them, except two ops that plow's graph already holds in fused form: `attention` is written
`attend(q, kv_write(kc, k, pos), kv_write(vc, v, pos), pos)` and `gated_mlp` is written
`mul(act(gate), up)`, so the rules R8 and R13 that fold them back are the same kind of
statement as every other rule. Fused constructors are what the rules R1–R19 introduce;
layout constructors (`cat3`, `interleave`) denote weights re-laid-out at bundle time and
views (`part`, `fst`, `snd`) select an output of a multi-output op; neither is an op.

Attributes travel as one canonical string per op (`attrs`), so two ops fuse only when the
rule's side condition about them is a syntactic equality of their attributes; the two
integers a side condition compares (a norm's group, a rope's head dim) are separate `i64`
arguments.
"""

from __future__ import annotations

from egglog import Expr, StringLike, function, i64Like


class T(Expr):
    """A tensor-valued term."""

    @classmethod
    def leaf(cls, name: StringLike) -> T:  # type: ignore[empty-body]
        """A tensor no op writes in this step: an input, a weight or a key-value cache."""


class P(Expr):
    """A pair of tensors: the two outputs of a multi-output fused op."""


@function
def nobias() -> T:  # type: ignore[empty-body]
    """The absent bias of a linear (denotes the zero vector)."""


# ---- canonical primitives (what the lowering writes) ----
@function
def embedding(ids: T, table: T, attrs: StringLike) -> T: ...  # type: ignore[empty-body]
@function
def rmsnorm(x: T, w: T, attrs: StringLike, group: i64Like) -> T: ...  # type: ignore[empty-body]
@function
def linear(x: T, w: T, b: T) -> T: ...  # type: ignore[empty-body]
@function
def rope(x: T, pos: T, attrs: StringLike, head_dim: i64Like) -> T: ...  # type: ignore[empty-body]
@function
def kv_write(cache: T, x: T, pos: T) -> T: ...  # type: ignore[empty-body]
@function
def attend(q: T, kc: T, vc: T, pos: T, attrs: StringLike) -> T: ...  # type: ignore[empty-body]
@function
def act(x: T, kind: StringLike) -> T: ...  # type: ignore[empty-body]
@function
def mul(a: T, b: T) -> T: ...  # type: ignore[empty-body]
@function
def add(a: T, b: T) -> T: ...  # type: ignore[empty-body]
@function
def lm_head(x: T, w: T, attrs: StringLike) -> T: ...  # type: ignore[empty-body]
@function
def sample(logits: T, index: T, attrs: StringLike) -> T: ...  # type: ignore[empty-body]
# primitives of other model families (diffusion transformers, U-Nets); plow's decoder graph
# does not produce them yet, so R14–R16 match nothing in it
@function
def layernorm(x: T, attrs: StringLike) -> T: ...  # type: ignore[empty-body]
@function
def one_plus(x: T) -> T: ...  # type: ignore[empty-body]
@function
def groupnorm(x: T, w: T, b: T, attrs: StringLike) -> T: ...  # type: ignore[empty-body]


# ---- layouts (weights re-laid-out in the bundle) and views ----
@function
def cat3(a: T, b: T, c: T) -> T: ...  # type: ignore[empty-body]
@function
def interleave(gate: T, up: T) -> T: ...  # type: ignore[empty-body]
@function
def part(y: T, index: i64Like) -> T: ...  # type: ignore[empty-body]
@function
def fst(p: P) -> T: ...  # type: ignore[empty-body]
@function
def snd(p: P) -> T: ...  # type: ignore[empty-body]


# ---- fused ops (introduced by the rules) ----
@function
def attention(  # type: ignore[empty-body]
    q: T, k: T, v: T, kc: T, vc: T, pos: T, attrs: StringLike
) -> T: ...
@function
def glu(gate: T, up: T, kind: StringLike) -> T: ...  # type: ignore[empty-body]
@function
def glu_interleaved(y: T, kind: StringLike) -> T: ...  # type: ignore[empty-body]
@function
def linear_glu(x: T, w: T, b: T, kind: StringLike) -> T: ...  # type: ignore[empty-body]
@function
def add_rmsnorm(a: T, b: T, w: T, attrs: StringLike) -> P: ...  # type: ignore[empty-body]
@function
def linear_rope(  # type: ignore[empty-body]
    x: T, w: T, b: T, pos: T, attrs: StringLike, head_dim: i64Like
) -> T: ...
@function
def rmsnorm_rope(  # type: ignore[empty-body]
    x: T, w: T, nattrs: StringLike, pos: T, rattrs: StringLike, head_dim: i64Like
) -> T: ...
@function
def lm_head_argmax(x: T, w: T, index: T, attrs: StringLike, sattrs: StringLike) -> P: ...  # type: ignore[empty-body]
@function
def attention_rope(  # type: ignore[empty-body]
    q: T,
    k: T,
    v: T,
    kc: T,
    vc: T,
    pos: T,
    attrs: StringLike,
    qattrs: StringLike,
    kattrs: StringLike,
    head_dim: i64Like,
) -> T: ...
@function
def linear_residual(x: T, w: T, b: T, r: T) -> T: ...  # type: ignore[empty-body]
@function
def rmsnorm_linear(x: T, nw: T, nattrs: StringLike, w: T, b: T) -> T: ...  # type: ignore[empty-body]
@function
def rmsnorm_residual(r: T, y: T, w: T, attrs: StringLike) -> T: ...  # type: ignore[empty-body]
@function
def gated_residual(x: T, gate: T, y: T) -> T: ...  # type: ignore[empty-body]
@function
def adaln_modulate(x: T, scale: T, shift: T, attrs: StringLike) -> T: ...  # type: ignore[empty-body]
@function
def groupnorm_act(x: T, w: T, b: T, attrs: StringLike, kind: StringLike) -> T: ...  # type: ignore[empty-body]
@function
def linear_act(x: T, w: T, b: T, kind: StringLike) -> T: ...  # type: ignore[empty-body]
@function
def embedding_rmsnorm(  # type: ignore[empty-body]
    ids: T, table: T, eattrs: StringLike, w: T, nattrs: StringLike
) -> P: ...
@function
def rmsnorm_lm_head(x: T, nw: T, nattrs: StringLike, w: T, attrs: StringLike) -> T: ...  # type: ignore[empty-body]
