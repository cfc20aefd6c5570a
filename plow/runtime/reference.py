"""The reference executor: a plain per-op numpy forward over the operator graph, fp32,
with a contiguous key-value cache. Independent of tiling, scheduling and the plan."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from plow.checkpoint import Checkpoint, ModelSpec
from plow.graph import Bucket, OpGraph, OpKind, TensorRole, build_graph
from plow.runtime import numpy_ops as K

F32 = np.float32


def run_graph(
    graph: OpGraph,
    weights: Mapping[str, np.ndarray],
    inputs: Mapping[str, np.ndarray],
    caches: dict[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Evaluate every op in order; caches are updated in place. Returns the outputs."""
    env: dict[str, np.ndarray] = {}
    env.update(inputs)
    env.update(caches)

    def val(name: str) -> np.ndarray:
        if name not in env:
            env[name] = np.asarray(weights[name], dtype=F32)
        return env[name]

    for op in graph.ops:
        a = [val(t) for t in op.inputs]
        if op.kind is OpKind.embedding:
            out = (a[1][a[0]] * F32(op.attrs["scale"])).astype(F32)
        elif op.kind is OpKind.rmsnorm:
            out = K.rmsnorm(a[0], a[1] if len(a) > 1 else None, op.attrs)
        elif op.kind is OpKind.linear:
            out = K.linear(a[0], a[1], a[2] if len(a) == 3 else None)
        elif op.kind is OpKind.rope:
            out = K.rope(a[0], a[1], op.attrs)
        elif op.kind is OpKind.attention:
            out = K.attention(a[0], a[1], a[2], a[3], a[4], a[5], op.attrs)
        elif op.kind is OpKind.gated_mlp:
            out = K.gated_mlp(a[0], a[1], op.attrs)
        elif op.kind is OpKind.residual_add:
            out = K.residual_add(a[0], a[1], a[2] if len(a) > 2 else None)
        elif op.kind is OpKind.lm_head:
            out = K.lm_head(a[0], a[1], op.attrs)
        elif op.kind is OpKind.sample:
            out = K.greedy(a[0], a[1])
        elif op.kind is OpKind.router:
            out = K.router(a[0], op.attrs, a[1] if len(a) > 1 else None)
        elif op.kind is OpKind.expert_linear and op.attrs["mode"] == "gate_up":
            out = K.experts_gate_up(a[0], a[1], a[2], op.attrs)
        elif op.kind is OpKind.expert_linear:
            out = K.experts_down(a[0], a[1], a[2])
        elif op.kind is OpKind.ssm_conv:
            bias = a[2] if len(a) == 5 else None
            out = K.ssm_conv(a[0], a[1], bias, a[-2], a[-1], op.attrs)
        elif op.kind is OpKind.ssm_scan:
            out = K.ssm_scan(a[0], a[1], a[2], a[3], a[4], a[5], a[6], op.attrs)
        elif op.kind is OpKind.ssm_norm:
            out = K.ssm_norm(a[0], a[1][..., : a[0].shape[-1]], a[2], op.attrs)
        elif op.kind is OpKind.kda:
            out = K.kda(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], op.attrs)
        else:  # pragma: no cover - OpKind is closed
            raise AssertionError(op.kind)
        env[op.outputs[0]] = out
    return {n: env[n] for n, t in graph.tensors.items() if t.role is TensorRole.output}


@dataclass
class ReferenceSession:
    """One request's state: the contiguous cache and how many positions it holds."""

    spec: ModelSpec
    weights: Mapping[str, np.ndarray]
    context: int
    caches: dict[str, np.ndarray] = field(default_factory=dict)
    length: int = 0
    _graphs: dict[Bucket, OpGraph] = field(default_factory=dict)

    def _graph(self, bucket: Bucket) -> OpGraph:
        if bucket not in self._graphs:
            self._graphs[bucket] = build_graph(self.spec, bucket)
        return self._graphs[bucket]

    def step(self, ids: list[int]) -> np.ndarray:
        """Feed `ids` (a prefill chunk or one decode token); returns logits [len(ids), V]."""
        n = len(ids)
        if self.length + n > self.context:
            raise ValueError(f"context {self.context} exceeded ({self.length} + {n})")
        bucket = Bucket.prefill(1, n, self.context) if n > 1 else Bucket.decode(1, self.context)
        graph = self._graph(bucket)
        if not self.caches:
            self.caches = {
                name: np.zeros(t.shape, dtype=F32)
                for name, t in graph.tensors.items()
                if t.role in (TensorRole.cache, TensorRole.state)
            }
        inputs = {
            "ids": np.asarray([ids], dtype=np.int32),
            "positions": np.arange(self.length, self.length + n, dtype=np.int32)[None, :],
            "sample_index": np.asarray([n - 1], dtype=np.int32),
        }
        out = run_graph(graph, self.weights, inputs, self.caches)
        self.length += n
        return out["lm_head"][0]


def forward_logits(ckpt: Checkpoint, ids: list[int]) -> np.ndarray:
    """Logits for every position of `ids` in one prefill: [len(ids), vocab]."""
    session = ReferenceSession(ckpt.spec, ckpt.weights, context=len(ids))
    return session.step(ids)


def generate_greedy(
    ckpt: Checkpoint,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    stop_ids: tuple[int, ...] = (),
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Greedy generation: the new token ids (stops early at a stop id, which is included)."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    session = ReferenceSession(ckpt.spec, ckpt.weights, context=len(prompt_ids) + max_new_tokens)
    logits = session.step(list(prompt_ids))
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(np.argmax(logits[-1]))
        out.append(tok)
        if on_token:
            on_token(tok)
        if tok in stop_ids or len(out) == max_new_tokens:
            break
        logits = session.step([tok])
    return out
