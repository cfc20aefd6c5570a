"""Emit: schedules to packet streams (wire format: plow.bundle.wire, docs/wire.md)."""
