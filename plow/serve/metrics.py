"""Prometheus metrics through `prometheus_client`.

Names are vLLM's where the meaning is the same (`vllm:num_requests_running`,
`vllm:time_to_first_token_seconds`, `vllm:prompt_tokens_total`, ...) so that dashboards and
`vllm bench`-style scrapers work unchanged; series with no vLLM counterpart (slots, key-value
pages, dispatcher ticks, admission refusals and estimates) keep the `plow:` prefix. Every
series carries a `model_name` label, as vLLM's do.

Each served model records into its own `CollectorRegistry` (a dispatcher can run without a
server, and two servers in one process must not share counters); `render_all` merges the
models' registries into one exposition with each family's samples together. The library's
metric objects are thread-safe: the dispatcher thread records, the HTTP thread renders.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

__all__ = ["CONTENT_TYPE_LATEST", "LATENCY_BUCKETS", "ModelMetrics", "parse_metrics", "render_all"]

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


def _token_buckets(top: int = 1 << 20) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `top` (vLLM's `build_1_2_5_buckets`)."""
    out: list[float] = []
    k = 1
    while True:
        for m in (1, 2, 5):
            if m * k > top:
                return out
            out.append(float(m * k))
        k *= 10


class ModelMetrics:
    """The series of one served model, in a registry of its own."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg, name = self.registry, model_name

        def hist(metric: str, doc: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
            h = Histogram(metric, doc, ["model_name"], registry=reg, buckets=buckets)
            return h.labels(name)

        def counter(metric: str, doc: str) -> Counter:
            return Counter(metric, doc, ["model_name"], registry=reg).labels(name)

        # vLLM's request-level histograms
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token in seconds.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.")
        self.tpot = hist(
            "vllm:time_per_output_token_seconds",
            "Time per output token in seconds (each gap between two output tokens).",
        )
        self.request_tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1), seconds.",
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to last token, seconds.")
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to slot admission, seconds.")
        self.prefill = hist(
            "vllm:request_prefill_time_seconds", "Admission to first token (prefill), seconds."
        )
        self.decode = hist("vllm:request_decode_time_seconds", "First to last token, seconds.")
        self.inference = hist(
            "vllm:request_inference_time_seconds", "Admission to last token, seconds."
        )
        tokens = _token_buckets()
        self.request_prompt = hist(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", tokens
        )
        self.request_generation = hist(
            "vllm:request_generation_tokens", "Output tokens per finished request.", tokens
        )
        self.request_max_tokens = hist(
            "vllm:request_params_max_tokens", "The max_tokens of each queued request.", tokens
        )
        # vLLM's counters
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        for reason in ("stop", "length", "abort"):
            self._success.labels(name, reason)  # present at 0 from the start
        # plow-only
        self.tick = hist("plow:engine_tick_seconds", "Wall time of one dispatcher tick.")
        self.engine_ticks = counter(
            "plow:engine_ticks", "Dispatcher ticks that ran an engine launch."
        )
        self.prefill_launches = counter("plow:prefill_launches", "Prefill launches.")
        self._refused = Counter(
            "plow:request_refused",
            "Requests refused by admission control (429): at arrival (predicted wait over the "
            "bound) or at the deadline (still waiting for a slot when the bound ran out).",
            ["model_name", "at"],
            registry=reg,
        )
        for at in ("arrival", "deadline"):
            self._refused.labels(name, at)

    def finished(self, reason: str) -> None:
        """Count a finished request (`stop`, `length` or `abort`)."""
        self._success.labels(self.model_name, reason).inc()

    def refused(self, at: str) -> None:
        self._refused.labels(self.model_name, at).inc()

    def gauge(self, name: str, help: str, fn: Callable[[], float]) -> None:
        """A gauge read through `fn` at scrape time."""
        Gauge(name, help, ["model_name"], registry=self.registry).labels(
            self.model_name
        ).set_function(fn)


class _Merged:
    """Several registries as one collector: each family once, its samples from every model;
    the `_created` timestamps prometheus_client adds to counters and histograms are dropped."""

    def __init__(self, models: Sequence[ModelMetrics]) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for m in self.models:
            for fam in m.registry.collect():
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                out.samples.extend(s for s in fam.samples if not s.name.endswith("_created"))
        yield from merged.values()


def render_all(models: Sequence[ModelMetrics]) -> bytes:
    """Several models in one exposition (Prometheus text format 0.0.4)."""
    return generate_latest(_Merged(models))


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` → value for every sample line (for tests and benchmarks)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        out[key] = float(val)
    return out
