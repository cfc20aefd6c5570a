"""The fusion rules R1–R19 as one named egglog ruleset, and their catalogue.

Each rule is written as a match on canonical (or already fused) terms and a union with the
fused form, never a deletion: the e-graph keeps both sides and the extractor chooses by
cost. A side condition is part of the pattern (a shared variable, a literal such as the
full-width norm's group 0), so a rule cannot fire where its condition fails. The catalogue
`RULES` gives each rule its name, a one-line statement, its side condition, the Rocq lemma
that proves the equality (`Plow/Rewritesproof.v`) and whether the emitter implements the
fused op yet; `docs/egraph.md` lists the same table.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from egglog import RewriteOrRule, String, eq, i64, rule, ruleset, union, var

from plow.egraph import terms as t
from plow.egraph.terms import T

GREEDY = '{"mode": "greedy"}'  # the sample op's attrs when it takes the argmax


@dataclass(frozen=True, slots=True)
class RuleInfo:
    id: str
    name: str
    statement: str
    side_condition: str
    lemma: str  # in Plow/Rewritesproof.v
    fused: tuple[str, ...]  # the constructors the rule introduces (e-node ops)
    emitter: bool  # the emitter has an opcode for the fused op


RULES: tuple[RuleInfo, ...] = (
    RuleInfo(
        "R1",
        "add_rmsnorm",
        "rmsnorm(a + b) = snd(add_rmsnorm(a, b)), a + b = fst(...)",
        "full-width norm (group 0) of the sum",
        "add_rmsnorm_sound",
        ("add_rmsnorm",),
        True,  # with --fuse (plow/egraph/apply.py)
    ),
    RuleInfo(
        "R2",
        "gate_up_interleave",
        "glu(x·Wgᵀ, x·Wuᵀ) = glu_interleaved(x·interleave(Wg, Wu)ᵀ)",
        "gate and up read the same input; equal shapes",
        "gate_up_interleave_sound",
        ("glu_interleaved", "interleave"),
        True,  # with --fuse (plow/egraph/apply.py)
    ),
    RuleInfo(
        "R3",
        "linear_glu",
        "glu_interleaved(x·Wᵀ + b) = linear_glu(x, W, b)",
        "the linear's rows are interleaved gate/up pairs (R2's layout)",
        "linear_glu_sound",
        ("linear_glu",),
        True,  # with --fuse (plow/egraph/apply.py)
    ),
    RuleInfo(
        "R4",
        "qkv_concat",
        "x·Wqᵀ, x·Wkᵀ, x·Wvᵀ = the three parts of x·cat3(Wq, Wk, Wv)ᵀ",
        "q, k, v of one attention read the same input x (optionally through per-head "
        "norms before the ropes)",
        "qkv_concat_sound",
        ("cat3", "part"),
        True,  # with --fuse (plow/egraph/apply.py)
    ),
    RuleInfo(
        "R5",
        "linear_rope",
        "rope(x·Wᵀ + b) = linear_rope(x, W, b)",
        "none beyond the rope's shape rule (columns = heads · head_dim)",
        "linear_rope_sound",
        ("linear_rope",),
        False,
    ),
    RuleInfo(
        "R6",
        "rmsnorm_rope",
        "rope(rmsnorm_g(x)) = rmsnorm_rope(x)",
        "the norm's group equals the rope's head_dim",
        "rmsnorm_rope_sound",
        ("rmsnorm_rope",),
        False,
    ),
    RuleInfo(
        "R7",
        "lm_head_argmax",
        "argmax(lm_head(x)) = snd(lm_head_argmax(x)), lm_head(x) = fst(...)",
        "the sample op is greedy",
        "lm_head_argmax_sound",
        ("lm_head_argmax",),
        False,
    ),
    RuleInfo(
        "R8",
        "attention_cache_write",
        "attend(q, write(Kc, k), write(Vc, v)) = attention(q, k, v, Kc, Vc)",
        "both caches written at the positions the attention reads",
        "attention_cache_write_sound",
        ("attention",),
        True,
    ),
    RuleInfo(
        "R9",
        "attention_rope",
        "attention(rope(q), rope(k), v) = attention_rope(q, k, v)",
        "q and k roped at the attention's positions, same head_dim",
        "attention_rope_sound",
        ("attention_rope",),
        False,
    ),
    RuleInfo(
        "R10",
        "linear_residual",
        "r + (x·Wᵀ + b) = linear_residual(x, W, b, r)",
        "the residual stream is the first operand",
        "linear_residual_sound",
        ("linear_residual",),
        False,
    ),
    RuleInfo(
        "R11",
        "rmsnorm_linear",
        "rmsnorm(x)·Wᵀ + b = rmsnorm_linear(x, W, b)",
        "full-width norm (group 0)",
        "rmsnorm_linear_sound",
        ("rmsnorm_linear",),
        False,
    ),
    RuleInfo(
        "R12",
        "rmsnorm_residual",
        "r + rmsnorm(y) = rmsnorm_residual(r, y)",
        "full-width norm (group 0); the residual stream is the first operand",
        "rmsnorm_residual_sound",
        ("rmsnorm_residual",),
        False,
    ),
    RuleInfo(
        "R13",
        "glu",
        "act(g) ⊙ u = glu(g, u)",
        "equal shapes (the mul's shape rule)",
        "glu_sound",
        ("glu",),
        True,
    ),
    RuleInfo(
        "R14",
        "gated_residual",
        "x + g ⊙ y = gated_residual(x, g, y)",
        "equal shapes",
        "gated_residual_sound",
        ("gated_residual",),
        False,
    ),
    RuleInfo(
        "R15",
        "adaln_modulate",
        "layernorm(x) ⊙ (1 + s) + t = adaln_modulate(x, s, t)",
        "scale and shift broadcast over the normalised axis",
        "adaln_modulate_sound",
        ("adaln_modulate",),
        False,
    ),
    RuleInfo(
        "R16",
        "groupnorm_act",
        "act(groupnorm(x)) = groupnorm_act(x)",
        "act is elementwise",
        "groupnorm_act_sound",
        ("groupnorm_act",),
        False,
    ),
    RuleInfo(
        "R17",
        "linear_act",
        "act(x·Wᵀ + b) = linear_act(x, W, b)",
        "act is elementwise",
        "linear_act_sound",
        ("linear_act",),
        False,
    ),
    RuleInfo(
        "R18",
        "embedding_rmsnorm",
        "rmsnorm(embed(ids)) = snd(embedding_rmsnorm(ids)), embed(ids) = fst(...)",
        "full-width norm (group 0) of the embedding",
        "embedding_rmsnorm_sound",
        ("embedding_rmsnorm",),
        True,  # an embedding with the norm's weight (plow/egraph/apply.py)
    ),
    RuleInfo(
        "R19",
        "rmsnorm_lm_head",
        "lm_head(rmsnorm(x)) = rmsnorm_lm_head(x)",
        "full-width norm (group 0)",
        "rmsnorm_lm_head_sound",
        ("rmsnorm_lm_head",),
        True,  # an lm_head with the norm's weight (plow/egraph/apply.py; no softcap)
    ),
)
RULE_BY_ID = {r.id: r for r in RULES}


def rule_id(egglog_name: str) -> str:
    """`R4.norm` → `R4`: variants of one rule share its id."""
    return egglog_name.split(".", 1)[0]


def _rules() -> Iterator[RewriteOrRule]:
    a, b, x, y, h, w, bb, pos, o, n, q, k, v = (
        var(z, T) for z in ("a", "b", "x", "y", "h", "w", "bb", "pos", "o", "n", "q", "k", "v")
    )
    kc, vc, wq, wk, wv, bq, bk, bv, nq, nk, g, u = (
        var(z, T) for z in ("kc", "vc", "wq", "wk", "wv", "bq", "bk", "bv", "nq", "nk", "g", "u")
    )
    s, s1, s2, s3, s4 = (var(z, String) for z in ("s", "s1", "s2", "s3", "s4"))
    d = var("d", i64)
    full = i64(0)

    # R1: a + b feeding a full-width norm
    pair = t.add_rmsnorm(a, b, w, s)
    yield rule(eq(o).to(t.rmsnorm(n, w, s, full)), eq(n).to(t.add(a, b)), name="R1").then(
        union(o).with_(t.snd(pair)), union(n).with_(t.fst(pair))
    )
    # R2: gate and up of one input into one interleaved linear
    yield rule(eq(o).to(t.glu(t.linear(h, wq, bq), t.linear(h, wk, bk), s)), name="R2").then(
        union(o).with_(
            t.glu_interleaved(t.linear(h, t.interleave(wq, wk), t.interleave(bq, bk)), s)
        )
    )
    # R3: the glu in the interleaved linear's epilogue
    yield rule(eq(o).to(t.glu_interleaved(t.linear(h, w, bb), s)), name="R3").then(
        union(o).with_(t.linear_glu(h, w, bb, s))
    )
    # R4: q/k/v of one attention, without and with per-head norms before the ropes
    lq, lk, lv = t.linear(h, wq, bq), t.linear(h, wk, bk), t.linear(h, wv, bv)
    qkv = t.linear(h, t.cat3(wq, wk, wv), t.cat3(bq, bk, bv))
    for name, qpat, kpat in (
        ("R4", lq, lk),
        ("R4.norm", t.rmsnorm(lq, nq, s3, d), t.rmsnorm(lk, nk, s4, d)),
        # one key-value head: the k norm's group is its whole width (written 0)
        ("R4.norm1", t.rmsnorm(lq, nq, s3, d), t.rmsnorm(lk, nk, s4, full)),
    ):
        yield rule(
            eq(o).to(t.attend(q, t.kv_write(kc, k, pos), t.kv_write(vc, lv, pos), pos, s)),
            eq(q).to(t.rope(qpat, pos, s1, d)),
            eq(k).to(t.rope(kpat, pos, s2, d)),
            name=name,
        ).then(
            union(lq).with_(t.part(qkv, 0)),
            union(lk).with_(t.part(qkv, 1)),
            union(lv).with_(t.part(qkv, 2)),
        )
    # R5: rope in the projection's epilogue
    yield rule(eq(o).to(t.rope(t.linear(x, w, bb), pos, s, d)), name="R5").then(
        union(o).with_(t.linear_rope(x, w, bb, pos, s, d))
    )
    # R6: per-head norm then rope, one pass over each head
    yield rule(eq(o).to(t.rope(t.rmsnorm(x, w, s1, d), pos, s2, d)), name="R6").then(
        union(o).with_(t.rmsnorm_rope(x, w, s1, pos, s2, d))
    )
    # R7: greedy sampling in the lm_head's epilogue
    greedy = String(GREEDY)
    lmp = t.lm_head_argmax(x, w, y, s, greedy)
    yield rule(eq(o).to(t.sample(n, y, greedy)), eq(n).to(t.lm_head(x, w, s)), name="R7").then(
        union(o).with_(t.snd(lmp)), union(n).with_(t.fst(lmp))
    )
    # R8: the cache writes inside the attention (plow's attention op)
    yield rule(
        eq(o).to(t.attend(q, t.kv_write(kc, k, pos), t.kv_write(vc, v, pos), pos, s)),
        name="R8",
    ).then(union(o).with_(t.attention(q, k, v, kc, vc, pos, s)))
    # R9: rope of q and k in the attention's prologue
    yield rule(
        eq(o).to(t.attention(a, b, v, kc, vc, pos, s)),
        eq(a).to(t.rope(q, pos, s1, d)),
        eq(b).to(t.rope(k, pos, s2, d)),
        name="R9",
    ).then(union(o).with_(t.attention_rope(q, k, v, kc, vc, pos, s, s1, s2, d)))
    # R10: the residual add in the projection's epilogue
    yield rule(eq(o).to(t.add(y, t.linear(x, w, bb))), name="R10").then(
        union(o).with_(t.linear_residual(x, w, bb, y))
    )
    # R11: the norm in the projection's prologue
    yield rule(eq(o).to(t.linear(t.rmsnorm(x, g, s, full), w, bb)), name="R11").then(
        union(o).with_(t.rmsnorm_linear(x, g, s, w, bb))
    )
    # R12: a post-norm (sandwich norm) and the residual add
    yield rule(eq(o).to(t.add(y, t.rmsnorm(x, w, s, full))), name="R12").then(
        union(o).with_(t.rmsnorm_residual(y, x, w, s))
    )
    # R13: act(g) * u is the gated-MLP op
    yield rule(eq(o).to(t.mul(t.act(g, s), u)), name="R13").then(union(o).with_(t.glu(g, u, s)))
    # R14: gated residual
    yield rule(eq(o).to(t.add(x, t.mul(g, y))), name="R14").then(
        union(o).with_(t.gated_residual(x, g, y))
    )
    # R15: adaptive layer-norm modulation
    yield rule(eq(o).to(t.add(t.mul(t.layernorm(x, s), t.one_plus(a)), b)), name="R15").then(
        union(o).with_(t.adaln_modulate(x, a, b, s))
    )
    # R16: group norm then activation
    yield rule(eq(o).to(t.act(t.groupnorm(x, w, bb, s1), s2)), name="R16").then(
        union(o).with_(t.groupnorm_act(x, w, bb, s1, s2))
    )
    # R17: activation in the projection's epilogue
    yield rule(eq(o).to(t.act(t.linear(x, w, bb), s)), name="R17").then(
        union(o).with_(t.linear_act(x, w, bb, s))
    )
    # R18: the first norm beside the embedding gather
    ep = t.embedding_rmsnorm(x, y, s1, w, s2)
    yield rule(
        eq(o).to(t.rmsnorm(n, w, s2, full)), eq(n).to(t.embedding(x, y, s1)), name="R18"
    ).then(union(o).with_(t.snd(ep)), union(n).with_(t.fst(ep)))
    # R19: the final norm in the lm_head's prologue
    yield rule(eq(o).to(t.lm_head(t.rmsnorm(x, g, s1, full), w, s2)), name="R19").then(
        union(o).with_(t.rmsnorm_lm_head(x, g, s1, w, s2))
    )


fusion = ruleset(*_rules(), name="fusion")
