"""`build_graph(spec, bucket)`: the decoder-only forward as an `OpGraph` with concrete dims."""

from __future__ import annotations

from typing import Any

from plow.checkpoint.spec import ModelSpec
from plow.errors import GraphError
from plow.graph.bucket import Bucket
from plow.graph.kda import kda_mixer
from plow.graph.mla import mla_attention
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
    logits = g.op(
        p + "router_logits", OpKind.linear, [h, g.weight(w + spec.ffn + "gate.weight")], {}, n
    )
    attrs: dict[str, Any] = {
        "top_k": moe.top_k,
        "norm_topk_prob": moe.norm_topk_prob,
        "experts": moe.experts,
    }
    ins = [logits]
    if moe.scoring == "sigmoid":  # DeepSeek-V3: the second input is the correction bias
        attrs.update(
            scoring="sigmoid",
            n_group=moe.n_group,
            topk_group=moe.topk_group,
            routed_scale=moe.routed_scale,
        )
        ins.append(g.weight(w + spec.ffn + "gate.e_score_correction_bias"))
    route = g.op(p + "router", OpKind.router, ins, attrs, n)
    out = _expert_mlp(g, spec, p, h, route, w + spec.ffn + "experts.", n)
    if moe.shared_intermediate:  # DeepSeek-V3's shared experts, on every token
        shared = _dense_mlp(g, spec, p + "shared_", w + spec.ffn + "shared_experts.", h, n, "")
        out = g.op(p + "experts_shared_sum", OpKind.residual_add, [out, shared], {}, n)
    return out


def _dense_mlp(
    g: _Builder, spec: ModelSpec, p: str, w: str, h: str, n: int, sub: str = "mlp."
) -> str:
    """down(act(gate(h)) * up(h)), the weights `w` + `sub` + gate_proj / up_proj / down_proj."""
    gate = g.op(p + "gate_proj", OpKind.linear, [h, g.weight(w + sub + "gate_proj.weight")], {}, n)
    up = g.op(p + "up_proj", OpKind.linear, [h, g.weight(w + sub + "up_proj.weight")], {}, n)
    act = g.op(
        p + "gated_mlp", OpKind.gated_mlp, [gate, up], {"activation": spec.activation.value}, n
    )
    down = g.weight(w + sub + "down_proj.weight")
    return g.op(p + "down_proj", OpKind.linear, [act, down], {}, n)


def _expert_mlp(g: _Builder, spec: ModelSpec, p: str, h: str, route: str, w: str, n: int) -> str:
    """Every expert's gate/up and activation, then the router-weighted down projection summed
    over the experts (`w` + gate_up_proj / down_proj: the stacked experts)."""
    moe = spec.moe
    assert moe is not None
    act = g.op(
        p + "experts_gate_up",
        OpKind.expert_linear,
        [h, route, g.weight(w + "gate_up_proj")],
        {"mode": "gate_up", "activation": spec.activation.value, "experts": moe.experts},
        n,
    )
    return g.op(
        p + "experts_down",
        OpKind.expert_linear,
        [act, route, g.weight(w + "down_proj")],
        {"mode": "down", "experts": moe.experts},
        n,
    )


def _experts_beside_mlp(
    g: _Builder, spec: ModelSpec, p: str, w: str, x: str, mlp: str, n: int
) -> str:
    """Gemma 4's feed-forward (`MoeSpec.layout == "gemma4"`): the dense MLP's output `mlp`
    normed, plus the experts' normed output. The router reads the residual stream `x`
    through RMSNorm times `router.scale` (logits scaled by hidden ** -0.5 in the router, its
    kept weights times `router.per_expert_scale`); the experts read their own norm of `x`."""
    moe = spec.moe
    assert moe is not None
    attrs: dict[str, Any] = {"eps": spec.norm_eps, "offset": spec.norm_offset}
    d1 = g.op(
        p + "post_mlp_norm_1",
        OpKind.rmsnorm,
        [mlp, g.weight(w + "post_feedforward_layernorm_1.weight")],
        attrs,
        n,
    )
    rn = g.op(p + "router_norm", OpKind.rmsnorm, [x, g.weight(w + "router.scale")], attrs, n)
    logits = g.op(
        p + "router_logits", OpKind.linear, [rn, g.weight(w + "router.proj.weight")], {}, n
    )
    route = g.op(
        p + "router",
        OpKind.router,
        [logits, g.weight(w + "router.per_expert_scale")],
        {
            "top_k": moe.top_k,
            "norm_topk_prob": moe.norm_topk_prob,
            "experts": moe.experts,
            "logit_scale": spec.hidden_size**-0.5,
        },
        n,
    )
    h2 = g.op(
        p + "experts_norm",
        OpKind.rmsnorm,
        [x, g.weight(w + "pre_feedforward_layernorm_2.weight")],
        attrs,
        n,
    )
    e = _expert_mlp(g, spec, p, h2, route, w + "experts.", n)
    d2 = g.op(
        p + "post_experts_norm",
        OpKind.rmsnorm,
        [e, g.weight(w + "post_feedforward_layernorm_2.weight")],
        attrs,
        n,
    )
    return g.op(p + "mlp_experts_sum", OpKind.residual_add, [d1, d2], {}, n)


def _ssm_mixer(g: _Builder, spec: ModelSpec, p: str, w: str, h: str, n: int) -> str:
    """A Mamba-2 mixer (`SsmSpec`): in_proj to [z | xBC | dt]; `ssm_conv` (the row's conv
    window in `conv_state`); `ssm_scan` (the row's `ssm_state`); `ssm_norm` gated by z;
    out_proj. The two states are `TensorRole.state` [B, ...]: one fixed-size block per row,
    read and rewritten by the op (a row's first position 0 starts from zeros)."""
    m = spec.ssm
    assert m is not None
    b = g.tensors[h].shape[0]
    ins = [h, g.weight(w + "mixer.in_proj.weight")]
    if m.proj_bias:
        ins.append(g.weight(w + "mixer.in_proj.bias"))
    proj = g.op(p + "in_proj", OpKind.linear, ins, {}, n)
    cst = g.declare(p + "conv_state", (b, m.conv_dim, m.conv_kernel - 1), TensorRole.state)
    sst = g.declare(p + "ssm_state", (b, m.heads, m.head_dim, m.state_size), TensorRole.state)
    conv_in = [proj, g.weight(w + "mixer.conv1d.weight")]
    if m.conv_bias:
        conv_in.append(g.weight(w + "mixer.conv1d.bias"))
    xbc = g.op(
        p + "ssm_conv",
        OpKind.ssm_conv,
        [*conv_in, cst, "positions"],
        {"channels": m.conv_dim, "kernel": m.conv_kernel, "offset": m.inner},
        n,
    )
    y = g.op(
        p + "ssm_scan",
        OpKind.ssm_scan,
        [
            xbc,
            proj,
            g.weight(w + "mixer.dt_bias"),
            g.weight(w + "mixer.A_log"),
            g.weight(w + "mixer.D"),
            sst,
            "positions",
        ],
        {
            "heads": m.heads,
            "head_dim": m.head_dim,
            "state_size": m.state_size,
            "groups": m.groups,
            "dt_offset": m.inner + m.conv_dim,
            "dt_min": m.dt_min,
            "dt_max": None if m.dt_max == float("inf") else m.dt_max,
        },
        n,
    )
    y = g.op(
        p + "ssm_norm",
        OpKind.ssm_norm,
        [y, proj, g.weight(w + "mixer.norm.weight")],
        {"group": m.inner // m.groups, "eps": spec.norm_eps},
        n,
    )
    out = [y, g.weight(w + "mixer.out_proj.weight")]
    if m.proj_bias:
        out.append(g.weight(w + "mixer.out_proj.bias"))
    return g.op(p + "out_proj", OpKind.linear, out, {}, n)


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

    def norm(name: str, x: str, w: str | None, layer: int | None, group: int | None = None) -> str:
        attrs: dict[str, Any] = {"eps": spec.norm_eps, "offset": spec.norm_offset}
        if group is not None:
            attrs["group"] = group
        if w is None:  # no weight: x / rms (Gemma 4's v_norm)
            return g.op(name, OpKind.rmsnorm, [x], {**attrs, "offset": 1.0}, layer)
        return g.op(name, OpKind.rmsnorm, [x, g.weight(w)], attrs, layer)

    def linear(name: str, x: str, w: str, layer: int | None, bias: str | None = None) -> str:
        ins = [x, g.weight(w)] + ([g.weight(bias)] if bias else [])
        return g.op(name, OpKind.linear, ins, {}, layer)

    x = g.op(
        "embed",
        OpKind.embedding,
        ["ids", g.weight(spec.embed_weight)],
        {"scale": spec.embed_scale},
    )
    for n, lspec in enumerate(spec.layers):
        p, w = f"L{n}.", f"model.layers.{n}."
        if lspec.mixer == "ssm":  # Mamba-2: x + mixer(norm(x)), no feed-forward
            w = f"backbone.layers.{n}."
            h = norm(p + "norm", x, w + "norm.weight", n)
            x = g.op(
                p + "residual", OpKind.residual_add, [x, _ssm_mixer(g, spec, p, w, h, n)], {}, n
            )
            continue
        h = norm(p + "attn_norm", x, w + "input_layernorm.weight", n)
        if spec.mla is not None:  # DeepSeek-V3's latent attention (plow/graph/mla.py)
            if lspec.mixer == "kda":  # Kimi-Linear's linear-attention layers
                o = kda_mixer(g, spec, n, h, b)
            else:
                o = mla_attention(g, spec, lspec, n, h, b, c)
            x = g.op(p + "attn_residual", OpKind.residual_add, [x, o], {}, n)
            h = norm(p + "mlp_norm", x, w + "post_attention_layernorm.weight", n)
            d = (
                _experts(g, spec, p, w, h, n)
                if lspec.moe
                else _dense_mlp(g, spec, p, w, h, n, spec.ffn)
            )
            x = g.op(p + "mlp_residual", OpKind.residual_add, [x, d], {}, n)
            continue
        bias = spec.attention_bias
        hd, kvh = spec.layer_head_dim(n), spec.layer_kv_heads(n)
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
        v = (
            k
            if lspec.k_eq_v
            else linear(
                p + "v_proj",
                h,
                w + "self_attn.v_proj.weight",
                n,
                w + "self_attn.v_proj.bias" if bias else None,
            )
        )
        if spec.v_norm:
            v = norm(p + "v_norm", v, None, n, hd)
        if spec.qk_norm:
            q = norm(p + "q_norm", q, w + "self_attn.q_norm.weight", n, hd)
            k = norm(p + "k_norm", k, w + "self_attn.k_norm.weight", n, hd)
        rope = {
            "theta": lspec.rope.theta,
            "kind": lspec.rope.kind,
            "factor": lspec.rope.factor,
            "low_freq_factor": lspec.rope.low_freq_factor,
            "high_freq_factor": lspec.rope.high_freq_factor,
            "original_max_position": lspec.rope.original_max_position,
            "head_dim": hd,
        }
        if lspec.rope.kind == "proportional":
            rope["partial_rotary_factor"] = lspec.rope.partial_rotary_factor
        q = g.op(p + "q_rope", OpKind.rope, [q, "positions"], {**rope, "heads": spec.num_heads}, n)
        k = g.op(p + "k_rope", OpKind.rope, [k, "positions"], {**rope, "heads": kvh}, n)
        kc = g.declare(p + "k_cache", (b, kvh, c, hd), TensorRole.cache)
        vc = g.declare(p + "v_cache", (b, kvh, c, hd), TensorRole.cache)
        a = g.op(
            p + "attn",
            OpKind.attention,
            [q, k, v, kc, vc, "positions"],
            {
                "heads": spec.num_heads,
                "kv_heads": kvh,
                "head_dim": hd,
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
        if lspec.moe and spec.moe is not None and spec.moe.layout != "gemma4":
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
            if lspec.moe and spec.moe is not None:
                d = _experts_beside_mlp(g, spec, p, w, x, d, n)
        if spec.sandwich_norms:
            d = norm(p + "post_mlp_norm", d, w + "post_feedforward_layernorm.weight", n)
        # Gemma 4: the layer's output times its layer_scalar [1] (residual_add's third input)
        scalar = [g.weight(w + "layer_scalar")] if spec.layer_scalar else []
        x = g.op(p + "mlp_residual", OpKind.residual_add, [x, d, *scalar], {}, n)
    x = norm("final_norm", x, spec.final_norm_weight, None)
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
