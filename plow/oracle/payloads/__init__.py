"""Payload models, one module per checkpoint (pydantic, JSON on the wire to the oracle)."""
