"""Test fixtures: tiny but real HuggingFace checkpoints made here, never downloaded."""

from plow.testing.fixtures import TINY_FAMILIES, make_tiny_checkpoint, train_tokenizer

__all__ = ["TINY_FAMILIES", "make_tiny_checkpoint", "train_tokenizer"]
