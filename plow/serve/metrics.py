"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand.

Names follow vLLM's where the meaning is the same, under the `plow:` prefix; every series
carries a `model_name` label. Thread-safe: the dispatcher thread records, the HTTP thread
renders.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""

    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    inner = ",".join(f'{k}="{esc(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


@dataclass
class Histogram:
    name: str
    help: str
    buckets: Sequence[float] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.total += v
        self.n += 1

    def render(self, labels: dict[str, str]) -> list[str]:
        out = []
        for b, c in zip(self.buckets, self.counts, strict=True):
            out.append(f"{self.name}_bucket{_labels({**labels, 'le': _fmt(b)})} {c}")
        out.append(f"{self.name}_bucket{_labels({**labels, 'le': '+Inf'})} {self.n}")
        out.append(f"{self.name}_sum{_labels(labels)} {_fmt(self.total)}")
        out.append(f"{self.name}_count{_labels(labels)} {self.n}")
        return out


@dataclass
class ModelMetrics:
    """The series of one served model. Gauges are read through callables at render time."""

    model_name: str
    gauges: dict[str, tuple[str, Callable[[], float]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.ttft = Histogram("plow:time_to_first_token_seconds", "Time to first token.")
        self.itl = Histogram("plow:inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = Histogram("plow:e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = Histogram("plow:request_queue_time_seconds", "Arrival to slot admission.")
        self.prefill = Histogram(
            "plow:request_prefill_time_seconds", "Admission to first token (prefill)."
        )
        self.tick = Histogram("plow:engine_tick_seconds", "Wall time of one dispatcher tick.")
        self.counters: dict[str, tuple[str, float]] = {
            "plow:prompt_tokens_total": ("Prefilled prompt tokens.", 0.0),
            "plow:generation_tokens_total": ("Generated tokens.", 0.0),
            "plow:request_success_total": ("Requests finished (stop or length).", 0.0),
            "plow:request_aborted_total": ("Requests aborted (client disconnect).", 0.0),
            "plow:request_refused_total": ("Requests refused by admission control (429).", 0.0),
            "plow:engine_ticks_total": ("Dispatcher ticks that ran an engine launch.", 0.0),
            "plow:prefill_launches_total": ("Prefill launches.", 0.0),
        }

    def inc(self, name: str, v: float = 1.0) -> None:
        with self.lock:
            h, old = self.counters[name]
            self.counters[name] = (h, old + v)

    def observe(self, hist: Histogram, v: float) -> None:
        with self.lock:
            hist.observe(v)

    def gauge(self, name: str, help: str, fn: Callable[[], float]) -> None:
        self.gauges[name] = (help, fn)

    def families(self) -> list[tuple[str, str, str, list[str]]]:
        """(name, type, help, sample lines) per metric family."""
        labels = {"model_name": self.model_name}
        fams: list[tuple[str, str, str, list[str]]] = []
        with self.lock:
            for name, (h, fn) in self.gauges.items():
                fams.append((name, "gauge", h, [f"{name}{_labels(labels)} {_fmt(float(fn()))}"]))
            for name, (h, v) in self.counters.items():
                fams.append((name, "counter", h, [f"{name}{_labels(labels)} {_fmt(v)}"]))
            for hist in (self.ttft, self.itl, self.e2e, self.queue, self.prefill, self.tick):
                fams.append((hist.name, "histogram", hist.help, hist.render(labels)))
        return fams


def render_all(models: Sequence[ModelMetrics]) -> str:
    """Several models in one exposition, each family's samples together."""
    order: list[str] = []
    merged: dict[str, tuple[str, str, list[str]]] = {}
    for m in models:
        for name, kind, h, lines in m.families():
            if name not in merged:
                order.append(name)
                merged[name] = (kind, h, [])
            merged[name][2].extend(lines)
    out: list[str] = []
    for name in order:
        kind, h, lines = merged[name]
        out += [f"# HELP {name} {h}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` → value for every sample line (for tests and benchmarks)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        out[key] = float(val)
    return out
