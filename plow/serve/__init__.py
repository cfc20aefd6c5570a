"""Serving: the engine protocol, per-model dispatchers, admission control and the
OpenAI-compatible HTTP server (docs/serving.md)."""

from plow.serve.engine import Engine, EngineError, KVUsage, PrefillChunk, ReferenceEngine

__all__ = ["Engine", "EngineError", "KVUsage", "PrefillChunk", "ReferenceEngine"]
