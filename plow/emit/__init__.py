"""Emit: schedules to packet streams (wire format: plow.emit.wire, docs/wire.md)."""
