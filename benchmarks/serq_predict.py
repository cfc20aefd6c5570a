"""Benchmark: does serQ predict plow's own server? (issue 16, item 4)

**Needs a quiet machine.** It times a real server; on a contended machine (other jobs on the
cores) the measured side is noise, and the numbers must not be published.

For one tiny fixture checkpoint (the same as ``serving_overhead.py``), in one run:

1. start ``plow serve`` (native executor, 4 slots, 256-token budget) on 127.0.0.1 and read its
   own startup calibration from ``/debug/admission``: the decode tick ``d0 + d1 * rows``
   (``StepTimes``) and the prefill fit ``launch + per_row * rows`` (``PrefillFit``);
2. at each offered load, send Poisson arrivals (prompts of 8..48 tokens, 16..48 output
   tokens, ``ignore_eos``) and record each request's send time, first streamed token, end and
   token counts (TTFT, TPOT, end-to-end, as ``vllm bench serve`` defines them);
3. run ``examples/plow_serve.sq`` (the dispatcher as a serQ program) through the reference
   interpreter on **the same arrivals**: the measured send times and token counts are fed to
   it as its arrival and length streams, its costs set to the server's calibration (``--set``)
   and its chunk to the one plow's priced chooser picks for the mean prompt;
4. compare p50 / p90 / p99 of TTFT, TPOT and end-to-end: relative error of the prediction.

The calibration prices the launches only. What a tick costs the host besides them (HTTP
streaming, sampling, detokenisation, bookkeeping) is measured by a probe of the running server
before the loads: 1 and then ``SLOTS`` concurrent requests (16-token prompts, 32 tokens out,
the load's temperature); their TPOT beyond the calibrated decode tick ``d0 + d1 * rows`` is
fitted as ``tick_us + row_us_host * rows`` and set in the program, and a lone request's TTFT
at the client beyond the server's own TTFT for it is ``http_us``, added to the predicted TTFT
and end-to-end. Each load runs the program with the batch-formation window the server chose
during it (``/debug/admission``, polled).

Usage: ``python benchmarks/serq_predict.py [--quick] [--loads 0.3,0.6] [--out DIR]``.
Writes ``serq_predict.json`` and ``serq_predict.md`` (with a Limits section) into ``--out``
(default ``results/benchmarks``).
"""

# ruff: noqa: E501  (report tables)
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: shared cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import serving_overhead as so  # noqa: E402

from plow.serve.prefill_cost import choose_chunk_size  # noqa: E402
from serq import interp  # noqa: E402
from serq.checker import check  # noqa: E402
from serq.parser import parse_file  # noqa: E402

PROGRAM = ROOT / "examples" / "plow_serve.sq"
NAME = "smollm2-135m"  # plow's default model (SmolLM2-135M-Instruct), native executor
BUDGET = 256  # --max-num-batched-tokens
PROMPTS, OUTPUTS = (8, 48), (8, 32)
MEAN_OUT = sum(OUTPUTS) / 2
LOAD_SECONDS = 90.0  # at most about this long of arrivals per load
MAX_REQUESTS = 300
TICKS = 50_000  # --debug-ticks: the ring holds every tick of a run
PRED_SEEDS = 8  # the program's runs per load (its tick jitter is drawn): pooled


def start_server(model_dir: Path) -> so.ServerProc:
    """`plow serve` on the default model with the tick records on (serving_overhead's
    start_server, plus --debug-ticks and one host thread: the cores are shared)."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "plow.cli", "serve", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--max-num-seqs", str(so.SLOTS), "--max-num-batched-tokens",
           str(BUDGET), "--served-model-name", NAME, "--api-key", so.KEY, "--seed", "0",
           "--log-level", "warning", "--threads", "1", "--debug-ticks", str(TICKS)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # a first run compiles and verifies the bundle
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise SystemExit(f"serq_predict: plow serve exited: {err}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return so.ServerProc(proc, url)
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("serq_predict: plow serve did not come up")
        time.sleep(0.5)


def server_ticks(srv: so.ServerProc) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = httpx.get(
        f"{srv.url}/debug/ticks", headers=srv.headers(), timeout=30
    ).json()[NAME]
    return out


def tick_costs(ticks: list[dict[str, Any]], chunk: int) -> dict[str, float]:
    """The program's per-iteration cost fitted to the server's own ticks of one load.

    An iteration of the program is a tick from its start to the next tick's start when the
    engine stayed busy (the loop's own work between ticks counted), else the tick's measured
    duration plus the median busy gap. Least squares over the features the program's
    ``execute`` reads, ``span = tick_us + d1_us * decoders + [prefill] (launch_us + row_us *
    chunk * prefill requests)`` (a negative coefficient's feature is dropped and the rest
    refitted); the ratio of each tick to the fit is the jitter, drawn per iteration from 12
    bins (deciles, the top one split 5/4/1 %), each worth the mean ratio in its band."""
    gaps = [u["start_s"] - t["start_s"] - t["dur_s"] for t, u in zip(ticks, ticks[1:], strict=False)
            if u["tick"] == t["tick"] + 1]  # fmt: skip
    busy = [g for g in gaps if 0 <= g < 2e-3]
    g0 = float(np.median(busy)) if busy else 0.0
    rows, ys = [], []
    for i, t in enumerate(ticks):
        nxt = ticks[i + 1] if i + 1 < len(ticks) else None
        span = t["dur_s"] + g0
        if nxt is not None and nxt["tick"] == t["tick"] + 1:
            gap = nxt["start_s"] - t["start_s"] - t["dur_s"]
            if 0 <= gap < 2e-3:
                span = nxt["start_s"] - t["start_s"]
        pf = 1.0 if t["prefill_tokens"] > 0 else 0.0
        rows.append([1.0, t["decode_rows"], pf, chunk * t["prefill_chunks"]])
        ys.append(span * 1e6)
    X, y = np.asarray(rows, dtype=float), np.asarray(ys, dtype=float)
    keep = [0, 1, 2, 3]
    while True:
        coef, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        neg = [k for k, c in zip(keep, coef, strict=True) if c < 0 and k != 0]
        if not neg:
            break
        keep.remove(neg[0])
    full = np.zeros(4)
    full[keep] = coef
    fit = X @ full
    q = np.sort(y / np.maximum(fit, 1.0))
    # the program's 12 bins (examples/plow_serve.sq): the mean ratio in each quantile band
    edges = np.round(np.cumsum([0.0, *[0.1] * 9, 0.05, 0.04, 0.01]) * len(q)).astype(int)
    bins = {f"jq{k + 1}": float(q[a:b].mean()) if b > a else float(q[min(a, len(q) - 1)])
            for k, (a, b) in enumerate(zip(edges, edges[1:], strict=False))}  # fmt: skip
    return {"tick_us": max(0.0, float(full[0])), "d0_us": 0.0, "d1_us": float(full[1]),
            "launch_us": float(full[2]), "row_us": float(full[3]), "row_us_host": 0.0,
            "jitter": 1.0, **bins,
            "ticks": float(len(ticks)), "busy_gap_us": g0 * 1e6,
            "fit_mape_pct": float(np.mean(np.abs(q - 1)) * 100)}  # fmt: skip


def calibration(srv: so.ServerProc) -> dict[str, float]:
    adm = httpx.get(f"{srv.url}/debug/admission", headers=srv.headers(), timeout=30).json()[NAME]
    step, fit = adm["step"], adm["prefill_fit"]
    launch_rows = fit["launch_s"] / fit["per_row_s"]
    mean_prompt = round(sum(PROMPTS) / 2)
    chunk = choose_chunk_size([mean_prompt], max(1, BUDGET - so.SLOTS), launch_rows).chunk
    return {
        "slots": so.SLOTS,
        "budget": BUDGET,
        "chunk": chunk,
        "d0_us": step["d0_s"] * 1e6,
        "d1_us": step["d1_s"] * 1e6,
        "launch_us": fit["launch_s"] * 1e6,
        "row_us": fit["per_row_s"] * 1e6,
    }


PROBE_PROMPT, PROBE_OUT, PROBE_TEMP = 16, 32, 0.7  # the Poisson load samples at 0.7 too
HIDDEN = ("http_us", "probe_tpot1_us", "probe_tpot_full_us", "ticks", "busy_gap_us",
          "fit_mape_pct")  # not program parameters


async def _probe(srv: so.ServerProc, conc: int, seed: int) -> list[so.Result]:
    rng = np.random.default_rng(seed)
    async with so.client(srv) as c:
        return await asyncio.gather(*(
            so.one_request(c, NAME, [int(x) for x in rng.integers(3, 300, size=PROBE_PROMPT)],
                           PROBE_OUT, seed * 16 + i, PROBE_TEMP)
            for i in range(conc)
        ))  # fmt: skip


def host_costs(srv: so.ServerProc, costs: dict[str, float], reps: int) -> dict[str, float]:
    """The host's costs beyond the priced launches, measured on the running server: the TPOT
    of 1 and of SLOTS concurrent requests beyond the calibrated decode tick, fitted as
    tick_us + row_us_host * rows; and http_us, a lone request's TTFT at the client beyond the
    server's own TTFT for it (vllm:time_to_first_token_seconds), so the batch-formation
    window the server may hold a lone request for is not counted in it."""
    tpot: dict[int, float] = {}
    http: list[float] = []
    for conc in (1, so.SLOTS):
        asyncio.run(_probe(srv, conc, 99))  # warm-up, not counted
        vals: list[float] = []
        for r in range(reps):
            m0 = srv.metrics(NAME)
            res = asyncio.run(_probe(srv, conc, 100 + r))
            m1 = srv.metrics(NAME)
            vals += [t for x in res if x.ok and (t := x.tpot) is not None]
            key = "vllm:time_to_first_token_seconds"
            served = m1[key + "_count"] - m0[key + "_count"]
            if conc == 1 and served == 1 and res[0].ok:
                http.append(res[0].ttft - (m1[key + "_sum"] - m0[key + "_sum"]))
        if not vals or (conc == 1 and not http):
            raise SystemExit(f"serq_predict: the probe at concurrency {conc} got no tokens back")
        tpot[conc] = float(np.median(vals)) * 1e6
    over1 = tpot[1] - (costs["d0_us"] + costs["d1_us"])
    over_full = tpot[so.SLOTS] - (costs["d0_us"] + costs["d1_us"] * so.SLOTS)
    row_host = max(0.0, (over_full - over1) / (so.SLOTS - 1))
    tick = max(0.0, over1 - row_host)
    return {"tick_us": tick, "row_us_host": row_host,
            "http_us": max(0.0, float(np.median(http)) * 1e6),
            "probe_tpot1_us": tpot[1], "probe_tpot_full_us": tpot[so.SLOTS]}  # fmt: skip


async def _load(srv: so.ServerProc, rate: float, n: int, seed: int) -> tuple[list[so.Result], float, list[float]]:
    """The Poisson load, polling the server's batch-formation window (its M/D/1 choice at the
    arrival rate it sees) every half second while it runs."""
    windows: list[float] = []
    done = asyncio.Event()

    async def poll() -> None:
        async with httpx.AsyncClient(base_url=srv.url, headers=srv.headers(), timeout=30) as c:
            while not done.is_set():
                with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                    windows.append((await c.get("/debug/admission")).json()[NAME]["prediction"]["window_s"])
                await asyncio.sleep(0.5)

    task = asyncio.create_task(poll())
    try:
        res, dur = await so.poisson(srv, NAME, rate, n, seed, PROMPTS, OUTPUTS)
    finally:
        done.set()
        await task
    return res, dur, windows


def predict(arrivals: list[tuple[float, int, int]], costs: dict[str, float],
            seeds: int = 1) -> dict[str, list[float]]:
    """Run plow_serve.sq on exactly these arrivals: (time s, prompt tokens, output tokens);
    with a drawn jitter (``jexp > 0``), ``seeds`` runs of them pooled (seeded 0, 1, ...)."""
    program, text = parse_file(PROGRAM)
    http_ms = costs.get("http_us", 0.0) / 1e3
    params = {k: v for k, v in costs.items() if k not in HIDDEN}
    sets = {"window_us": 0.0, **params, "plo": 0, "phi": 0, "olo": 0, "ohi": 0, "rate": 1.0}
    spec = interp.prepare(check(program, str(PROGRAM), text), sets)
    times = [a[0] * 1e6 for a in arrivals]
    out: dict[str, list[float]] = {"ttft": [], "tpot": [], "e2e": []}
    for seed in range(seeds if costs.get("jitter", 0.0) > 0 else 1):
        gaps = iter([t - s for s, t in zip([0.0, *times], times, strict=False)] + [1e30] * 4)
        # plen = floor(~uniform(0, 1)) and olen likewise: feed the length itself, plus a half
        lengths = iter([x + 0.5 for _, p, o in arrivals for x in (p, o)])
        # execute's ~exp: the tick's jitter
        jitter = iter(np.random.default_rng(seed).standard_exponential(1 << 20).tolist())
        rec = interp.run(spec, 1e15, 0.0, gaps.__next__, lengths.__next__, jitter.__next__,
                         [math.inf])  # fmt: skip
        out["ttft"] += [t / 1e3 + http_ms for t in rec["ttft"]]
        out["tpot"] += [t / 1e3 for t in rec["tbt"]]
        out["e2e"] += [t / 1e3 + http_ms for t in rec["resp"]]
    return out


def pcts(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    p50, p90, p99 = np.percentile(np.asarray(xs, dtype=float), [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def one_load(srv: so.ServerProc, costs: dict[str, float], rho: float, n: int, seed: int,
             seconds: float = LOAD_SECONDS) -> dict[str, Any]:
    # a slot is held for ~32 tokens at full batch, each a tick as the probe measured it (the
    # calibrated launch alone, d0 + d1 * slots, is a quarter of it: loads defined from it were
    # overloads, see `_analysis`)
    tick_us = max(costs["d0_us"] + costs["d1_us"] * so.SLOTS,
                  costs.get("probe_tpot_full_us", 0.0))  # fmt: skip
    hold = tick_us / 1e6 * MEAN_OUT
    rate = rho * so.SLOTS / hold
    n = max(12, min(n, int(rate * seconds)))  # a slow calibration must not stretch the run
    before = max((t["tick"] for t in server_ticks(srv)), default=0)
    uptime_before = os.getloadavg()[0]
    res, dur, windows = asyncio.run(_load(srv, rate, n, seed))
    ticks = [t for t in server_ticks(srv) if t["tick"] > before]
    window_us = float(np.median(windows)) * 1e6 if windows else 0.0
    ok = sorted((r for r in res if r.ok), key=lambda r: r.start)
    t0 = ok[0].start
    raw = {
        "arrivals": [(r.start - t0, r.prompt_tokens, r.output_tokens) for r in ok],
        "measured": {
            "ttft": [r.ttft * 1e3 for r in ok],
            "tpot": [t * 1e3 for r in ok if (t := r.tpot) is not None],
            "e2e": [r.e2el * 1e3 for r in ok],
        },
        "ticks": ticks,
        "window_us": window_us,
    }
    run = {"load": rho, "request_rate_per_s": rate, "requests": len(ok), "window_us": window_us,
           "failed": len(res) - len(ok), "duration_s": dur,
           "loadavg_before": uptime_before, "loadavg_after": os.getloadavg()[0], "raw": raw}  # fmt: skip
    return evaluate(run, costs)


def tick_chunk(ticks: list[dict[str, Any]], default: int) -> int:
    """The program's one chunk: the largest chunk the server's ticks launched (plow's chooser
    re-prices it every tick; a prompt up to it is prefilled in one tick, as plow does)."""
    sizes = [math.ceil(t["prefill_tokens"] / t["prefill_chunks"]) for t in ticks if t["prefill_chunks"]]
    return max(sizes) if sizes else default


def evaluate(run: dict[str, Any], costs: dict[str, float]) -> dict[str, Any]:
    """The program's predictions for one load's raw record, against its measurements."""
    raw = run["raw"]
    arrivals, measured, ticks = raw["arrivals"], raw["measured"], raw["ticks"]
    window_us = raw["window_us"]
    chunk = tick_chunk(ticks, int(costs["chunk"]))
    fitted = {**tick_costs(ticks, chunk), "chunk": chunk}
    # the startup calibration plus the probe (as before), and the same run's ticks
    startup = predict(arrivals, {**costs, "window_us": window_us})
    ticked = {**costs, **fitted, "window_us": window_us}
    predicted = predict(arrivals, ticked, PRED_SEEDS)
    no_jitter = predict(arrivals, {**ticked, "jitter": 0.0})
    rows = {}
    for key in ("ttft", "tpot", "e2e"):
        m, p = pcts(measured[key]), pcts(predicted[key])
        rows[key] = {
            "measured_ms": m,
            "predicted_ms": p,
            "error_pct": {q: (p[q] / m[q] - 1) * 100 for q in m},
            "no_jitter_error_pct": {q: (v / m[q] - 1) * 100 for q, v in pcts(no_jitter[key]).items()},
            "startup_error_pct": {q: (v / m[q] - 1) * 100 for q, v in pcts(startup[key]).items()},
        }
    return {**run, "tick_fit": fitted, "metrics": rows}


def _trip(d: dict[str, float], fmt: str = "{:.0f}") -> str:
    return " / ".join(fmt.format(d[q]) for q in ("p50", "p90", "p99"))


def _tick_notes(data: dict[str, Any]) -> list[str]:
    out = []
    for run in data["runs"]:
        ticks = run["raw"]["ticks"]
        pf = np.array([t["dur_s"] for t in ticks if t["prefill_chunks"]]) * 1e3
        dec = {r: np.array([t["dur_s"] for t in ticks if not t["prefill_chunks"]
                            and t["decode_rows"] == r]) * 1e3 for r in (1, so.SLOTS)}  # fmt: skip
        d = ", ".join(f"{r} row{'s' if r > 1 else ''} p50 {np.median(v):.0f} ms (mean {v.mean():.0f}, "
                      f"{len(v)} ticks)" for r, v in dec.items() if len(v))  # fmt: skip
        p = (f"prefill ticks p50 {np.median(pf):.0f} ms, mean {pf.mean():.0f}, max {pf.max():.0f} "
             f"({len(pf)} ticks)") if len(pf) else "no prefill ticks"  # fmt: skip
        out.append(f"- Load {run['load']:.2f}: decode-only ticks at {d}; {p}; the linear fit's "
                   f"mean absolute error {run['tick_fit']['fit_mape_pct']:.0f}% per tick.")  # fmt: skip
    out.append(
        "- Where a load's ticks are far from linear in the batch (another job's burst landing on "
        "some ticks and not others) or their spread is heavy-tailed (a prefill tick's mean well "
        "above its median), the fitted prices are means and the i.i.d. jitter does not recreate "
        "the correlated slow spells: the tails and the low-load medians are off by more than the "
        "goal there.")
    return out


def write_md(data: dict[str, Any], path: Path) -> None:
    c = data["costs"]
    L = ["# serQ predicting plow serve", "",
         f"{data['when']} on {data['machine']} (`uptime` load averages beside each load below; "
         "the machine is shared with other jobs, so this is a contended machine, not a quiet "
         f"one). Model {NAME} (plow's default model, SmolLM2-135M-Instruct), native executor "
         f"with one host thread, {so.SLOTS} slots, budget {BUDGET}, prompts "
         f"{PROMPTS[0]}..{PROMPTS[1]} tokens, outputs {OUTPUTS[0]}..{OUTPUTS[1]} (`ignore_eos`, "
         "temperature 0.7), Poisson arrivals seeded 11, 12, ... per load.", "",
         "**Prediction**: `examples/plow_serve.sq` through the reference interpreter on the "
         "measured arrivals (send times, token counts), its per-iteration cost fitted to the "
         "same load's tick records (`plow serve --debug-ticks`, `GET /debug/ticks`): "
         "`(tick_us + d1_us * decoders + [prefill] (launch_us + row_us * chunk * prefills)) * "
         "jitter`, the jitter drawn per iteration from the fit's ratios (12 bins: deciles, the "
         "top one split 5/4/1 %, each its band's mean ratio), "
         f"{PRED_SEEDS} seeded runs pooled; plus `http_us` {c['http_us'] / 1e3:.1f} ms (a lone "
         "request's client TTFT beyond the server's) on TTFT and end-to-end.", "",
         "| load | metric | measured p50 / p90 / p99 ms | predicted p50 / p90 / p99 ms | error % | error %, no jitter | error %, startup calibration |",
         "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for run in data["runs"]:
        for key, row in run["metrics"].items():
            L.append(f"| {run['load']:.2f} ({run['requests']} req, {run['request_rate_per_s']:.2f}/s) | {key} | "
                     f"{_trip(row['measured_ms'], '{:.1f}')} | {_trip(row['predicted_ms'], '{:.1f}')} | "
                     f"{_trip(row['error_pct'], '{:+.0f}')} | {_trip(row['no_jitter_error_pct'], '{:+.0f}')} | "
                     f"{_trip(row['startup_error_pct'], '{:+.0f}')} |")  # fmt: skip
    errs = [abs(e) for run in data["runs"] for row in run["metrics"].values()
            for e in row["error_pct"].values()]  # fmt: skip
    tails = [abs(row["error_pct"][q]) for run in data["runs"] for row in run["metrics"].values()
             for q in ("p90", "p99")]  # fmt: skip
    L += ["", f"Goal: TTFT, TPOT and end-to-end p90/p99 within 10% (Vidur reports < 9%) — "
          f"{'met' if max(tails) <= 10 else 'NOT met'} in this run (largest |error| at p90/p99 "
          f"{max(tails):.0f}%, at any percentile {max(errs):.0f}%)."]
    L += ["", "Tick fits (µs; per load, from that load's ticks):", "",
          "| load | ticks | chunk | tick_us | d1_us | launch_us | row_us | jitter bins (x fit) | busy gap us | fit mean abs error % | `uptime` load before / after |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for run in data["runs"]:
        f = run["tick_fit"]
        jq = " ".join(f"{f[f'jq{k}']:.2f}" for k in range(1, 13))
        L.append(f"| {run['load']:.2f} | {f['ticks']:.0f} | {f['chunk']} | {f['tick_us']:.0f} | {f['d1_us']:.0f} | "
                 f"{f['launch_us']:.0f} | {f['row_us']:.1f} | {jq} | "
                 f"{f['busy_gap_us']:.0f} | {f['fit_mape_pct']:.0f} | {run['loadavg_before']:.1f} / "
                 f"{run['loadavg_after']:.1f} |")  # fmt: skip
    L += ["", "Startup calibration and probe (the previous method, the 'startup' column): "
          + ", ".join(f"{k} {v:.4g}" for k, v in c.items())]
    L += ["", "## Limits", "",
          "- A contended machine: 2 cores shared with other jobs (load averages above). The "
          "prediction uses the same run's ticks, so it sees the tick durations the contention "
          "gave; the 'startup calibration' column shows what a calibration taken before the "
          "loads predicts instead.",
          f"- Few requests: each load sends at most {MAX_REQUESTS} requests and about "
          f"{data.get('seconds', LOAD_SECONDS):.0f} s of arrivals; with ticks this slow that is tens of requests, so a "
          "p99 is one or two requests' worth and a p90 a handful.",
          "- The cost model is fitted and evaluated on the same load (in-sample): it is a test "
          "of the program's queueing and batching given the right per-tick prices, not of "
          "predicting the prices. The jitter is i.i.d. per iteration; the machine's real "
          "slow-downs are correlated over many ticks (another job's burst), which an i.i.d. "
          "draw averages out within a request.",
          "- plow re-prices the prefill chunk every tick (`choose_chunk_size`); the program uses "
          "one chunk, the largest the server launched in that load. plow packs at most `budget // chunk` "
          "chunks; the program fills the budget with a partial last chunk. plow admits into a "
          "free slot even when the tick's prefill launch is full; the program admits only "
          "requests that get prefill tokens in that tick.",
          "- The batch-formation window is dynamic in plow (re-chosen every 100 ms); the program "
          "runs each load with one `window_us`, the median of the server's choice polled every "
          "0.5 s. The admission bound (429 refusals) is not modelled.",
          "- HTTP's request-side latency is one constant `http_us`, measured by the probe before "
          "the loads.",
          "- plow streams a request's first token right after the tick's prefill launch, before "
          "the decode launch; serQ's first token is at the end of the iteration (the whole "
          "tick), so at low load the predicted TTFT carries the decode launch too.",
          "- One jitter distribution for every tick (pooled ratios); prefill and decode ticks "
          "are not jittered separately."]  # fmt: skip
    L += ["", "## What the ticks show", "", *_tick_notes(data)]
    path.write_text("\n".join(L) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few requests per load (a smoke run)")
    ap.add_argument("--loads", default="0.3,0.6", help="offered loads, fractions of the slots")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "benchmarks")
    ap.add_argument("--seconds", type=float, default=LOAD_SECONDS,
                    help="about this long of arrivals per load (at most 300 requests)")
    ap.add_argument("--md-only", action="store_true", help="rewrite the .md from the .json")
    ap.add_argument("--repredict", action="store_true",
                    help="recompute the predictions from the .json's raw records, rewrite both")
    args = ap.parse_args()
    if args.md_only or args.repredict:
        data = json.loads((args.out / "serq_predict.json").read_text())
        if args.repredict:
            data["runs"] = [evaluate(r, data["costs"]) for r in data["runs"]]
            (args.out / "serq_predict.json").write_text(json.dumps(data, indent=1) + "\n")
        write_md(data, args.out / "serq_predict.md")
        return
    loads = [float(x) for x in args.loads.split(",")]
    n = 12 if args.quick else MAX_REQUESTS
    from plow.default_model import ensure_default_model

    with contextlib.nullcontext():
        srv = start_server(ensure_default_model())
        try:
            costs = calibration(srv)
            costs.update(host_costs(srv, costs, 2 if args.quick else 5))
            print(f"costs: {json.dumps({k: round(v, 2) for k, v in costs.items()})}", flush=True)
            runs = []
            for i, rho in enumerate(loads):
                runs.append(one_load(srv, costs, rho, n, seed=11 + i, seconds=args.seconds))
                print(json.dumps(runs[-1]["metrics"]), flush=True)
        finally:
            srv.stop()
    data = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": args.seconds,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}",
            "costs": costs, "runs": runs}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serq_predict.json").write_text(json.dumps(data, indent=1) + "\n")
    write_md(data, args.out / "serq_predict.md")
    print(f"wrote {args.out / 'serq_predict.md'}")


if __name__ == "__main__":
    main()
