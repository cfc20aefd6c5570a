"""Checkpoint C payload: the on-chip page timeline of every worker.

Each worker holds on-chip allocations as pages; an allocation is a window of cycles
`[start, end)` holding `pages` pages. The oracle (Plow.Pages.check_pages) accepts when, on
every worker, the pages held at every cycle stay within `budget_pages`
(theorem Plow.Pagesproof.check_pages_sound). Integers only.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PageWindow(BaseModel):
    """One on-chip allocation: `pages` pages live during cycles `start <= t < end`."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)

    name: str
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    pages: int = Field(ge=0)


class WorkerTimeline(BaseModel):
    """The windows of one worker (`worker` is its id, e.g. the SM index)."""

    model_config = ConfigDict(frozen=True)

    worker: int = Field(ge=0)
    windows: list[PageWindow]


class PagePayload(BaseModel):
    """`budget_pages` is the page budget of each worker (on-chip bytes / page size)."""

    model_config = ConfigDict(frozen=True)

    budget_pages: int = Field(ge=0)
    workers: list[WorkerTimeline]
