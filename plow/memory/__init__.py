"""Memory planning of one bucket (docs/memory.md): on-chip pages with lifetimes per worker
(checkpoint C) and the one arena every tensor lives in (checkpoint F)."""

from plow.memory.arena import (
    ALIGN,
    Arena,
    Buffer,
    alloc_payload,
    arena_payload,
    live_ranges,
    partial_bytes,
    plan_arena,
)
from plow.memory.onchip import (
    PagePlan,
    TaskPages,
    page_payload,
    page_windows,
    peak_pages,
    plan_pages,
    split_timeline,
)

__all__ = [
    "ALIGN",
    "Arena",
    "Buffer",
    "PagePlan",
    "TaskPages",
    "alloc_payload",
    "arena_payload",
    "live_ranges",
    "page_payload",
    "page_windows",
    "partial_bytes",
    "peak_pages",
    "plan_arena",
    "plan_pages",
    "split_timeline",
]
