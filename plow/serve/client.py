"""The engine-client interface: all the HTTP server (`plow.serve.http.Server`) may use of a
served model's engine side.

As vLLM v1's OpenAI server depends only on its `EngineClient`, never on an executor, the
server here submits requests, aborts them, reads their records and the metrics, and starts and
stops the loop, through this protocol alone; it never touches an `Engine`, a slot or a
sampler. `plow.serve.dispatcher.Dispatcher` implements it (in process, one thread per model);
another implementation (a dispatcher in another process or on another node) would plug in
without a change to the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from plow.serve.admission import AdmissionController, Decision
    from plow.serve.dispatcher import Request, RequestRecord
    from plow.serve.metrics import ModelMetrics


@runtime_checkable
class EngineClient(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def metrics(self) -> ModelMetrics: ...

    @property
    def admission(self) -> AdmissionController | None:
        """The admission controller (for `/debug/admission`), or None without one."""
        ...

    @property
    def tick(self) -> int: ...

    @property
    def alive(self) -> bool:
        """The loop is running (what `/health` reports)."""
        ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def new_id(self, prefix: str = "cmpl") -> str: ...

    def submit(self, req: Request, *, check: bool = True) -> Decision:
        """Queue `req` (its sink receives every event) unless admission refuses it."""
        ...

    def abort(self, request_id: str) -> None: ...

    def record(self, request_id: str) -> RequestRecord | None: ...

    def predicted_wait(self) -> float: ...
