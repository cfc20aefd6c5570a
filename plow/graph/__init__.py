"""The operator graph: ops with concrete shapes inside one bucket of the ladder."""

from plow.graph.bucket import Bucket, Phase
from plow.graph.build import build_graph
from plow.graph.ops import Op, OpGraph, OpKind, Tensor, TensorRole

__all__ = ["Bucket", "Op", "OpGraph", "OpKind", "Phase", "Tensor", "TensorRole", "build_graph"]
