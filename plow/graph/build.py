"""`build_graph(spec, bucket)`: the decoder-only forward as an `OpGraph` with concrete dims."""

from __future__ import annotations

from typing import Any

from plow.checkpoint.spec import ModelSpec
from plow.errors import GraphError
from plow.graph.bucket import Bucket
from plow.graph.ops import Op, OpGraph, OpKind, Tensor, TensorRole, infer_shapes


class _Builder:
    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.ops: list[Op] = []
        self.tensors: dict[str, Tensor] = {}

    def declare(
        self, name: str, shape: tuple[int, ...], role: TensorRole, dtype: str = "float32"
    ) -> str:
        self.tensors[name] = Tensor(name, shape, role, dtype)
        return name

    def weight(self, name: str) -> str:
        shapes = self.spec.weight_shapes()
        if name not in self.tensors:
            self.declare(name, shapes[name], TensorRole.weight, self.spec.dtype)
        return name

    def op(
        self,
        name: str,
        kind: OpKind,
        inputs: list[str],
        attrs: dict[str, Any] | None = None,
        layer: int | None = None,
        role: TensorRole = TensorRole.activation,
    ) -> str:
        attrs = attrs or {}
        shapes = infer_shapes(kind, name, [self.tensors[t].shape for t in inputs], attrs)
        out = self.declare(name, shapes[0], role, "int32" if kind is OpKind.sample else "float32")
        self.ops.append(Op(name, kind, tuple(inputs), (out,), attrs, layer))
        return out


def _experts(g: _Builder, spec: ModelSpec, p: str, w: str, h: str, n: int) -> str:
    """A routed feed-forward: router logits (a linear), the router (softmax, top-k, optional
    renormalisation: dense weights, 0 off the top-k), every expert's gate/up and activation
    (`expert_linear` gate_up), and the router-weighted down projection summed over the
    experts (`expert_linear` down, a reduction over the expert axis). Every expert's tiles
    are in the plan; a tile whose expert no token of its rows chose computes nothing."""
    moe = spec.moe
    assert moe is not None
    logits = g.op(p + "router_logits", OpKind.linear, [h, g.weight(w + "mlp.gate.weight")], {}, n)
    route = g.op(
        p + "router",
        OpKind.router,
        [logits],
        {"top_k": moe.top_k, "norm_topk_prob": moe.norm_topk_prob, "experts": moe.experts},
        n,
    )
    act = g.op(
        p + "experts_gate_up",
        OpKind.expert_linear,
        [h, route, g.weight(w + "mlp.experts.gate_up_proj")],
        {"mode": "gate_up", "activation": spec.activation.value, "experts": moe.experts},
        n,
    )
    return g.op(
        p + "experts_down",
        OpKind.expert_linear,
        [act, route, g.weight(w + "mlp.experts.down_proj")],
        {"mode": "down", "experts": moe.experts},
        n,
    )


def build_graph(spec: ModelSpec, bucket: Bucket) -> OpGraph:
    """The forward of one step of `bucket`: token ids in, logits and sampled ids out.

    Inputs: `ids[B,T]`, `positions[B,T]` (−1 marks a padded slot: it neither writes the
    cache nor attends), `sample_index[B]` (which of the T positions is sampled).
    """
    if bucket.context > spec.max_position:
        raise GraphError(
            bucket.name,
            f"context {bucket.context} exceeds max_position_embeddings {spec.max_position}",
        )
    b, t, c = bucket.batch, bucket.tokens_per_row, bucket.context
    g = _Builder(spec)
    g.declare("ids", (b, t), TensorRole.input, "int32")
    g.declare("positions", (b, t), TensorRole.input, "int32")
    g.declare("sample_index", (b,), TensorRole.input, "int32")

    def norm(name: str, x: str, w: str, layer: int | None, group: int | None = None) -> str:
        attrs: dict[str, Any] = {"eps": spec.norm_eps, "offset": spec.norm_offset}
        if group is not None:
            attrs["group"] = group
        return g.op(name, OpKind.rmsnorm, [x, g.weight(w)], attrs, layer)

    def linear(name: str, x: str, w: str, layer: int | None, bias: str | None = None) -> str:
        ins = [x, g.weight(w)] + ([g.weight(bias)] if bias else [])
        return g.op(name, OpKind.linear, ins, {}, layer)

    x = g.op(
        "embed",
        OpKind.embedding,
        ["ids", g.weight("model.embed_tokens.weight")],
        {"scale": spec.embed_scale},
    )
    for n, lspec in enumerate(spec.layers):
        p, w = f"L{n}.", f"model.layers.{n}."
        h = norm(p + "attn_norm", x, w + "input_layernorm.weight", n)
        bias = spec.attention_bias
        q = linear(
            p + "q_proj",
            h,
            w + "self_attn.q_proj.weight",
            n,
            w + "self_attn.q_proj.bias" if bias else None,
        )
        k = linear(
            p + "k_proj",
            h,
            w + "self_attn.k_proj.weight",
            n,
            w + "self_attn.k_proj.bias" if bias else None,
        )
        v = linear(
            p + "v_proj",
            h,
            w + "self_attn.v_proj.weight",
            n,
            w + "self_attn.v_proj.bias" if bias else None,
        )
        if spec.qk_norm:
            q = norm(p + "q_norm", q, w + "self_attn.q_norm.weight", n, spec.head_dim)
            k = norm(p + "k_norm", k, w + "self_attn.k_norm.weight", n, spec.head_dim)
        rope = {
            "theta": lspec.rope.theta,
            "kind": lspec.rope.kind,
            "factor": lspec.rope.factor,
            "low_freq_factor": lspec.rope.low_freq_factor,
            "high_freq_factor": lspec.rope.high_freq_factor,
            "original_max_position": lspec.rope.original_max_position,
            "head_dim": spec.head_dim,
        }
        q = g.op(p + "q_rope", OpKind.rope, [q, "positions"], {**rope, "heads": spec.num_heads}, n)
        k = g.op(
            p + "k_rope", OpKind.rope, [k, "positions"], {**rope, "heads": spec.num_kv_heads}, n
        )
        kc = g.declare(p + "k_cache", (b, spec.num_kv_heads, c, spec.head_dim), TensorRole.cache)
        vc = g.declare(p + "v_cache", (b, spec.num_kv_heads, c, spec.head_dim), TensorRole.cache)
        a = g.op(
            p + "attn",
            OpKind.attention,
            [q, k, v, kc, vc, "positions"],
            {
                "heads": spec.num_heads,
                "kv_heads": spec.num_kv_heads,
                "head_dim": spec.head_dim,
                "scale": spec.attention_scale,
                "window": lspec.window,
                "softcap": spec.attn_logit_softcap,
            },
            n,
        )
        o = linear(p + "o_proj", a, w + "self_attn.o_proj.weight", n)
        if spec.sandwich_norms:
            o = norm(p + "post_attn_norm", o, w + "post_attention_layernorm.weight", n)
        x = g.op(p + "attn_residual", OpKind.residual_add, [x, o], {}, n)
        mlp_norm = (
            "pre_feedforward_layernorm" if spec.sandwich_norms else "post_attention_layernorm"
        )
        h = norm(p + "mlp_norm", x, w + mlp_norm + ".weight", n)
        if lspec.moe and spec.moe is not None:
            d = _experts(g, spec, p, w, h, n)
        else:
            gate = linear(p + "gate_proj", h, w + "mlp.gate_proj.weight", n)
            up = linear(p + "up_proj", h, w + "mlp.up_proj.weight", n)
            act = g.op(
                p + "gated_mlp",
                OpKind.gated_mlp,
                [gate, up],
                {"activation": spec.activation.value},
                n,
            )
            d = linear(p + "down_proj", act, w + "mlp.down_proj.weight", n)
        if spec.sandwich_norms:
            d = norm(p + "post_mlp_norm", d, w + "post_feedforward_layernorm.weight", n)
        x = g.op(p + "mlp_residual", OpKind.residual_add, [x, d], {}, n)
    x = norm("final_norm", x, "model.norm.weight", None)
    logits = g.op(
        "lm_head",
        OpKind.lm_head,
        [x, g.weight(spec.lm_head_weight)],
        {"softcap": spec.final_logit_softcap},
        role=TensorRole.output,
    )
    g.op(
        "sample",
        OpKind.sample,
        [logits, "sample_index"],
        {"mode": "greedy"},
        role=TensorRole.output,
    )
    graph = OpGraph(tuple(g.ops), dict(g.tensors), bucket.name)
    graph.validate()
    return graph
