"""Operator graph: concrete dims per bucket, typed errors for bad buckets and configs."""

from __future__ import annotations

import dataclasses

import pytest

from plow.checkpoint.loader import spec_from_config
from plow.errors import GraphError
from plow.graph import Bucket, OpKind, build_graph
from plow.graph.ops import OpGraph

CFG = {
    "model_type": "llama",
    "vocab_size": 101,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def test_every_dim_is_concrete_and_consistent() -> None:
    spec = spec_from_config(CFG, "config.json")
    g = build_graph(spec, Bucket.decode(batch=3, context=64))
    assert g.tensor("ids").shape == (3, 1)
    assert g.tensor("L0.k_cache").shape == (3, 2, 64, 8)
    assert g.tensor("lm_head").shape == (3, 1, 101)
    assert all(isinstance(d, int) and d > 0 for t in g.tensors.values() for d in t.shape)
    kinds = [op.kind for op in g.ops]
    assert kinds.count(OpKind.attention) == 2 and kinds[-1] is OpKind.sample
    p = build_graph(spec, Bucket.prefill(batch=2, seq=16, context=64))
    assert p.tensor("L1.q_rope").shape == (2, 16, 32)


def test_every_edge_goes_forward() -> None:
    g = build_graph(spec_from_config(CFG, "config.json"), Bucket.decode(1, 16))
    order = {op.name: i for i, op in enumerate(g.ops)}
    edges = g.edges()
    assert edges and all(order[a] < order[b] for a, b in edges)


def test_invalid_buckets_raise_graph_errors() -> None:
    spec = spec_from_config(CFG, "config.json")
    with pytest.raises(GraphError, match="batch and seq must be at least 1"):
        Bucket.decode(0, 16)
    with pytest.raises(GraphError, match="context 8 is below seq 16"):
        Bucket.prefill(1, 16, 8)
    with pytest.raises(GraphError, match="exceeds max_position_embeddings 128"):
        build_graph(spec, Bucket.decode(1, 256))


def test_validate_catches_a_tampered_shape() -> None:
    g = build_graph(spec_from_config(CFG, "config.json"), Bucket.decode(1, 16))
    tensors = dict(g.tensors)
    tensors["L0.o_proj"] = dataclasses.replace(tensors["L0.o_proj"], shape=(1, 1, 31))
    with pytest.raises(GraphError, match="L0.o_proj"):
        OpGraph(g.ops, tensors).validate()


def test_validate_catches_a_read_before_write() -> None:
    g = build_graph(spec_from_config(CFG, "config.json"), Bucket.decode(1, 16))
    ops = list(g.ops)
    ops[1], ops[2] = ops[2], ops[1]  # q_proj before the norm it reads
    with pytest.raises(GraphError, match="before any op writes it"):
        OpGraph(tuple(ops), g.tensors).validate()
