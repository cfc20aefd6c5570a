"""The engine protocol the dispatcher drives, re-exported from `plow.runtime.engine` (where the
executors implement it) so that serving code and its tests name it in one place."""

from plow.runtime.engine import (
    DEFAULT_PAGE_SIZE,
    Engine,
    EngineError,
    KVUsage,
    PrefillChunk,
    ReferenceEngine,
    check_new_slot,
)

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "Engine",
    "EngineError",
    "KVUsage",
    "PrefillChunk",
    "ReferenceEngine",
    "check_new_slot",
]
