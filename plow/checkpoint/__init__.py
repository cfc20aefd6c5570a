"""Checkpoint import: a HuggingFace directory → `ModelSpec` + `WeightStore` + `Tokenizer`."""

from plow.checkpoint.loader import Checkpoint, load_checkpoint, load_spec
from plow.checkpoint.spec import Activation, LayerSpec, ModelSpec, MoeSpec, RopeSpec

__all__ = [
    "Activation",
    "Checkpoint",
    "LayerSpec",
    "ModelSpec",
    "MoeSpec",
    "RopeSpec",
    "load_checkpoint",
    "load_spec",
]
