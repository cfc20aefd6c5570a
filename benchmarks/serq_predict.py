"""Benchmark: does serQ predict plow's own server? (issue 16, item 4)

**Needs a quiet machine** for publishable numbers: it times a real server, and on a contended
machine (other jobs on the cores) the tick's price moves between loads.

In one run, one ``plow serve`` (plow's default model, native executor, one host thread, 4
slots, 256-token budget, ``--debug-ticks``):

1. read its startup calibration (``/debug/admission``) and probe its host costs (the earlier
   method, kept as the 'startup' comparison);
2. at each offered load, send Poisson arrivals (prompts of 8..48 tokens, 8..32 output tokens,
   ``ignore_eos``) and record each request's send time, first streamed token, end and token
   counts (TTFT, TPOT, end-to-end, as ``vllm bench serve`` defines them), the server's own
   record of each request (``/debug/requests/ID``: arrival, first token, finish) and the
   load's ticks (``/debug/ticks``: start, duration, prefill launch seconds, rows, tokens);
3. fit the program's per-iteration cost to each load's ticks (``tick_costs``: the prefill
   launch to ``prefill_s`` by prompt tokens, the rest by decode rows; the tick / fit ratios as
   a jitter with 12 quantile bins and an AR(1)-plus-noise serial correlation);
4. run ``examples/plow_serve.sq`` through the reference interpreter on each load's arrivals
   **with the costs fitted to another load** (out of sample), its jitter chain's ``~exp(1)``
   stream a ``JitterStream`` (correlated bins, each iteration's draws of the program's law),
   a request's first token at its tick's prefill launch (where plow emits it);
5. compare p50 / p90 / p99 of TTFT, TPOT and end-to-end, client-side and server-side, beside
   the in-sample fit, i.i.d. jitter, serQ's end-of-tick first token, prices scaled by the
   machine's load average (processor sharing), and the startup calibration.

Usage: ``python benchmarks/serq_predict.py [--quick] [--loads 0.3,0.6] [--seconds S] [--out DIR]``;
``--repredict`` recomputes the predictions from the JSON's raw records.
Writes ``NAME.json`` and ``NAME.md`` (with a Limits section; ``--name``, default
``serq_predict``) into ``--out`` (default ``results/benchmarks``).
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


# the program's jitter chain (examples/plow_serve.sq): bin k is taken when the k-th ~exp(1) is
# below THRESH[k - 1] (the ones before it were not); bin 12 when all 11 were not. Bin k has
# probability BIN_P[k - 1]: the deciles, the top one split 5 / 4 / 1 %.
THRESH = (0.105361, 0.117783, 0.133531, 0.154151, 0.182322, 0.223144, 0.287682, 0.405465,
          0.693147, 0.693147, 1.609438)  # fmt: skip
BIN_P = (*[0.1] * 9, 0.05, 0.04, 0.01)
LAGS = 20  # the jitter's autocorrelation is fitted over lags 1..LAGS ticks


def _spans(ticks: list[dict[str, Any]]) -> tuple[list[float], float]:
    """Each tick's span (s): from its start to the next tick's start when the engine stayed
    busy (the loop's own work between ticks counted), else its duration plus the median busy
    gap; and that gap."""
    gaps = [u["start_s"] - t["start_s"] - t["dur_s"] for t, u in zip(ticks, ticks[1:], strict=False)
            if u["tick"] == t["tick"] + 1]  # fmt: skip
    busy = [g for g in gaps if 0 <= g < 2e-3]
    g0 = float(np.median(busy)) if busy else 0.0
    spans = []
    for i, t in enumerate(ticks):
        nxt = ticks[i + 1] if i + 1 < len(ticks) else None
        span = t["dur_s"] + g0
        if nxt is not None and nxt["tick"] == t["tick"] + 1:
            gap = nxt["start_s"] - t["start_s"] - t["dur_s"]
            if 0 <= gap < 2e-3:
                span = nxt["start_s"] - t["start_s"]
        spans.append(span)
    return spans, g0


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares, a feature with a negative coefficient dropped (the first column, the
    intercept, kept) and the rest refitted."""
    keep = list(range(X.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        neg = [k for k, c in zip(keep, coef, strict=True) if c < 0 and k != 0]
        if not neg:
            break
        keep.remove(neg[0])
    full = np.zeros(X.shape[1])
    full[keep] = coef
    return full


def _normal_scores(x: np.ndarray) -> np.ndarray:
    from statistics import NormalDist

    inv = NormalDist().inv_cdf
    ranks = np.argsort(np.argsort(x, kind="stable"), kind="stable")
    return np.array([inv((r + 0.5) / len(x)) for r in ranks])


def _autocorr_fit(ticks: list[dict[str, Any]], ratio: np.ndarray) -> dict[str, float]:
    """The jitter's serial correlation: the normal scores z of the tick / fit ratios (in tick
    order) are modelled as a Gaussian AR(1) slow-spell level plus independent per-tick noise,
    z_t = sqrt(c) a_t + sqrt(1 - c) e_t, a_t = rho a_(t-1) + sqrt(1 - rho^2) n_t, so
    corr(z_t, z_(t+k)) = c rho^k; c and rho are fitted by least squares to the measured
    autocorrelation over lags 1..LAGS (pairs of ticks exactly k ticks apart)."""
    z = _normal_scores(ratio)
    ids = [t["tick"] for t in ticks]
    pos = {tid: i for i, tid in enumerate(ids)}
    acf = []
    for k in range(1, LAGS + 1):
        pairs = [(i, pos[tid + k]) for i, tid in enumerate(ids) if tid + k in pos]
        if len(pairs) < 10:
            break
        a, b = np.array(pairs).T
        acf.append(float(np.corrcoef(z[a], z[b])[0, 1]))
    if not acf:
        return {"jc": 0.0, "jrho": 0.0, "acf1": float("nan"), "acf_last": float("nan")}
    lags = np.arange(1, len(acf) + 1)
    best = (math.inf, 0.0, 0.0)
    for rho in np.linspace(0.0, 0.999, 334):
        basis = rho**lags
        c = float(np.clip(np.dot(basis, acf) / max(np.dot(basis, basis), 1e-12), 0.0, 1.0))
        err = float(np.sum((c * basis - np.asarray(acf)) ** 2))
        if err < best[0]:
            best = (err, c, float(rho))
    return {"jc": best[1], "jrho": best[2], "acf1": acf[0], "acf_last": acf[-1]}


def tick_costs(ticks: list[dict[str, Any]], chunk: int) -> dict[str, float]:
    """The program's per-iteration cost fitted to the server's own ticks of one load.

    The prefill launch ``launch_us + row_us * chunk * chunks + tok_us * prompt tokens`` is
    fitted to the ticks' measured prefill launch (``prefill_s``), the rest ``tick_us + [a row
    decodes] (d0_us + d1_us * decoders)`` to each tick's span (``_spans``) less its prefill
    launch, by least squares (a negative coefficient's feature dropped). The ratio of each span to the fit is the tick's jitter:
    its marginal is the program's 12 bins (deciles, the top one split 5/4/1 %, each worth the
    mean ratio in its band), its serial correlation ``jc``, ``jrho`` (``_autocorr_fit``)."""
    spans, g0 = _spans(ticks)
    pf = [t for t in ticks if t["prefill_chunks"]]
    launch_us = row_us = tok_us = 0.0
    if pf:
        # a column of chunks that never varies is the intercept again: left out (row_us 0)
        varied = len({t["prefill_chunks"] for t in pf}) > 1
        Xp = np.array([[1.0, t["prefill_tokens"], *([chunk * t["prefill_chunks"]] if varied else [])]
                       for t in pf])  # fmt: skip
        cp = _nonneg_lstsq(Xp, np.array([t["prefill_s"] * 1e6 for t in pf]))
        launch_us, tok_us = float(cp[0]), float(cp[1])
        row_us = float(cp[2]) if varied else 0.0
    # the rest of the tick: the host's own work, and the decode launch when a row decodes
    Xd = np.array([[1.0, float(t["decode_rows"] > 0), t["decode_rows"]] for t in ticks])
    rest = np.array([(s - t["prefill_s"]) * 1e6 for s, t in zip(spans, ticks, strict=True)])
    tick_us, d0_us, d1_us = (float(c) for c in _nonneg_lstsq(Xd, rest))
    tick_us = max(0.0, tick_us)

    def pre(t: dict[str, Any]) -> float:
        return (launch_us + row_us * chunk * t["prefill_chunks"] + tok_us * t["prefill_tokens"]
                if t["prefill_chunks"] else 0.0)  # fmt: skip

    fit = np.array([tick_us + (d0_us + d1_us * t["decode_rows"] if t["decode_rows"] else 0.0) + pre(t)
                    for t in ticks])  # fmt: skip
    ratio = np.asarray(spans) * 1e6 / np.maximum(fit, 1.0)
    ratio = ratio / ratio.mean()  # a mean factor of 1: the model's ticks keep the fit's total
    q = np.sort(ratio)
    # the program's 12 bins (examples/plow_serve.sq): the mean ratio in each quantile band
    edges = np.round(np.cumsum([0.0, *BIN_P]) * len(q)).astype(int)
    bins = {f"jq{k + 1}": float(q[a:b].mean()) if b > a else float(q[min(a, len(q) - 1)])
            for k, (a, b) in enumerate(zip(edges, edges[1:], strict=False))}  # fmt: skip
    return {"tick_us": tick_us, "d0_us": d0_us, "d1_us": d1_us,
            "launch_us": launch_us, "row_us": row_us, "tok_us": tok_us, "row_us_host": 0.0,
            "jitter": 1.0, **bins, **_autocorr_fit(ticks, ratio),
            "ticks": float(len(ticks)), "busy_gap_us": g0 * 1e6,
            "fit_mape_pct": float(np.mean(np.abs(q - 1)) * 100)}  # fmt: skip


class JitterStream:
    """The program's ``~exp(1)`` stream for its jitter chain, with correlated bins.

    Iteration t's quantile level is u_t = Phi(z_t), z_t the AR(1)-plus-noise process of
    ``_autocorr_fit`` (``jc``, ``jrho``); its bin is the band of u_t (so bin k is taken with
    probability ``BIN_P[k]``, as under independent draws), and the chain's draws are drawn
    from their laws given that bin: a draw the chain passes over is ``THRESH[j] + Exp(1)``
    (exponential, conditioned on not falling below its threshold), the one that stops it an
    exponential conditioned below its threshold. Every iteration's draws therefore have the
    joint law the program states (independent ``~exp(1)``); only their dependence across
    iterations is added. With ``jc = 0`` the stream is exactly i.i.d. ``~exp(1)`` in law.
    ``bins`` records each iteration's bin (0-based), for the first token's time."""

    def __init__(self, jc: float, jrho: float, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.c, self.rho = float(jc), float(jrho)
        self.a = float(self.rng.standard_normal())
        self.bins: list[int] = []
        self.pending: list[float] = []
        self.cum = np.cumsum(BIN_P)

    def _iteration(self) -> None:
        from statistics import NormalDist

        self.a = self.rho * self.a + math.sqrt(1 - self.rho**2) * float(self.rng.standard_normal())
        z = math.sqrt(self.c) * self.a + math.sqrt(1 - self.c) * float(self.rng.standard_normal())
        k = min(int(np.searchsorted(self.cum, NormalDist().cdf(z), side="right")), len(BIN_P) - 1)
        self.bins.append(k)
        draws = [t + float(self.rng.standard_exponential()) for t in THRESH[:k]]
        if k < len(THRESH):  # the draw that stops the chain: Exp(1) given < THRESH[k]
            v = float(self.rng.random())
            draws.append(-math.log1p(-v * -math.expm1(-THRESH[k])))
        self.pending = draws[::-1]

    def __call__(self) -> float:
        if not self.pending:
            self._iteration()
        return self.pending.pop()


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
          "fit_mape_pct", "jc", "jrho", "acf1", "acf_last")  # not program parameters


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


async def _load(srv: so.ServerProc, rate: float, n: int, seed: int) -> tuple[list[so.Result], float, list[float], list[float]]:
    """The Poisson load, polling the server's batch-formation window (its M/D/1 choice at the
    arrival rate it sees) every half second while it runs."""
    windows: list[float] = []
    loads: list[float] = []
    done = asyncio.Event()

    async def poll() -> None:
        async with httpx.AsyncClient(base_url=srv.url, headers=srv.headers(), timeout=30) as c:
            while not done.is_set():
                loads.append(os.getloadavg()[0])
                with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                    windows.append((await c.get("/debug/admission")).json()[NAME]["prediction"]["window_s"])
                await asyncio.sleep(0.5)

    task = asyncio.create_task(poll())
    try:
        res, dur = await so.poisson(srv, NAME, rate, n, seed, PROMPTS, OUTPUTS)
    finally:
        done.set()
        await task
    return res, dur, windows, loads


def predict(arrivals: list[tuple[float, int, int]], costs: dict[str, float],
            seeds: int = 1, correlated: bool = True,
            first_at: str = "server") -> dict[str, list[float]]:
    """Run plow_serve.sq on exactly these arrivals: (time s, prompt tokens, output tokens);
    with a drawn jitter (``jitter > 0``), ``seeds`` runs of them pooled (seeded 0, 1, ...),
    its ``~exp(1)`` stream a :class:`JitterStream` (``correlated``: with the fit's ``jc``,
    ``jrho``; else i.i.d.).

    ``first_at="server"``: a request's first token is taken where plow emits it, right after
    its tick's prefill launch, before the decode launch (``dispatcher._prefill_update``): the
    iteration's start, plus the window when nothing was decoding, plus the prefill term of
    ``execute`` times the iteration's jitter; its TPOT is then (end - that) / (tokens - 1).
    ``"end"``: serQ's own first token, at the end of the iteration (the whole tick)."""
    program, text = parse_file(PROGRAM)
    http_ms = costs.get("http_us", 0.0) / 1e3
    params = {k: v for k, v in costs.items() if k not in HIDDEN}
    sets = {"window_us": 0.0, **params, "plo": 0, "phi": 0, "olo": 0, "ohi": 0, "rate": 1.0}
    spec = interp.prepare(check(program, str(PROGRAM), text), sets)
    jittered = costs.get("jitter", 0.0) > 0
    jq = [float(costs.get(f"jq{k}", 1.0)) for k in range(1, 13)]
    chunk, launch, row = float(sets["chunk"]), float(sets["launch_us"]), float(sets["row_us"])
    tok = float(sets.get("tok_us", 0.0))
    window = float(sets["window_us"])
    times = [a[0] * 1e6 for a in arrivals]
    out: dict[str, list[float]] = {"ttft": [], "tpot": [], "e2e": []}
    for seed in range(seeds if jittered else 1):
        gaps = iter([t - s for s, t in zip([0.0, *times], times, strict=False)] + [1e30] * 4)
        # plen = floor(~uniform(0, 1)) and olen likewise: feed the length itself, plus a half
        lengths = iter([x + 0.5 for _, p, o in arrivals for x in (p, o)])
        # execute's ~exp: the tick's jitter chain
        jc = float(costs.get("jc", 0.0)) if correlated else 0.0
        stream = JitterStream(jc, float(costs.get("jrho", 0.0)), seed)
        steps: list[tuple[Any, ...]] = []
        final: list[interp.State] = []
        rec = interp.run(spec, 1e15, 0.0, gaps.__next__, lengths.__next__, stream, [math.inf],
                         steps=steps, final=final)  # fmt: skip
        # the chain is read once per iteration, whole: the k-th bin is the k-th iteration's
        assert not jittered or (len(stream.bins) == rec["iterations"] and not stream.pending)
        st = final[0]
        ended = dict(st.ended)
        for r in st.requests:
            if r.rid not in ended or r.first_token is None:
                continue
            end, first = ended[r.rid], r.first_token
            if first_at == "server" and r.first_iter >= 0:
                row_ = steps[r.first_iter][0]
                start, tokens, requests, decoders = row_[1], row_[3], row_[4], row_[5]
                f = jq[stream.bins[r.first_iter]] if jittered else 1.0
                pre = (launch + row * chunk * (requests - decoders) + tok * (tokens - decoders)
                       if tokens > decoders else 0.0)  # fmt: skip
                first = start + (window if decoders == 0 else 0.0) + pre * f
            out["ttft"].append((first - r.arrival) / 1e3 + http_ms)
            out["e2e"].append((end - r.arrival) / 1e3 + http_ms)
            if r.tbt_gaps > 0:
                out["tpot"].append((end - first) / r.tbt_gaps / 1e3)
    return out


def pcts(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    p50, p90, p99 = np.percentile(np.asarray(xs, dtype=float), [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def server_records(srv: so.ServerProc, ok: list[so.Result]) -> list[tuple[float, float, float]] | None:
    """Each request's arrival, first token and finish on the server's clock (the dispatcher's
    record, GET /debug/requests/ID), in the order of ``ok``; None if one is missing."""
    out = []
    with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=30) as c:
        for r in ok:
            resp = c.get(f"/debug/requests/{r.id}")
            if resp.status_code != 200:
                return None
            rec = resp.json()
            if rec.get("first_token_t") is None or rec.get("finish_t") is None:
                return None
            out.append((rec["arrival_t"], rec["first_token_t"], rec["finish_t"]))
    return out


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
    res, dur, windows, loads = asyncio.run(_load(srv, rate, n, seed))
    ticks = [t for t in server_ticks(srv) if t["tick"] > before]
    window_us = float(np.median(windows)) * 1e6 if windows else 0.0
    ok = sorted((r for r in res if r.ok), key=lambda r: r.start)
    t0 = ok[0].start
    server = server_records(srv, ok)
    raw = {
        "arrivals": [(r.start - t0, r.prompt_tokens, r.output_tokens) for r in ok],
        "measured": {
            "ttft": [r.ttft * 1e3 for r in ok],
            "tpot": [t * 1e3 for r in ok if (t := r.tpot) is not None],
            "e2e": [r.e2el * 1e3 for r in ok],
        },
        "ticks": ticks,
        "window_us": window_us,
        # the server's own timeline of each request (monotonic s, the ticks' clock):
        # arrival, first token, finish (/debug/requests)
        "server": server,
    }
    run = {"load": rho, "request_rate_per_s": rate, "requests": len(ok), "window_us": window_us,
           "failed": len(res) - len(ok), "duration_s": dur,
           "loadavg_before": uptime_before, "loadavg_after": os.getloadavg()[0],
           "loadavg_during": float(np.mean(loads)) if loads else None, "raw": raw}  # fmt: skip
    return run


def tick_chunk(ticks: list[dict[str, Any]], default: int) -> int:
    """The program's one chunk: the largest chunk the server's ticks launched (plow's chooser
    re-prices it every tick; a prompt up to it is prefilled in one tick, as plow does)."""
    sizes = [math.ceil(t["prefill_tokens"] / t["prefill_chunks"]) for t in ticks if t["prefill_chunks"]]
    return max(sizes) if sizes else default


def fitted_costs(run: dict[str, Any], costs: dict[str, float]) -> dict[str, float]:
    """The program's costs fitted to one load's ticks, its chunk the largest it launched."""
    ticks = run["raw"]["ticks"]
    chunk = tick_chunk(ticks, int(costs["chunk"]))
    return {**tick_costs(ticks, chunk), "chunk": chunk}


def _views(raw: dict[str, Any], http_us: float) -> dict[str, tuple[list[Any], dict[str, list[float]], float]]:
    """What is compared: ``client``, the arrivals as sent and the latencies the client
    measured (the prediction plus ``http_us``); ``server``, when recorded, the arrivals and
    latencies on the server's own clock (its dispatcher's record of each request: arrival,
    first token, finish), with no HTTP term."""
    out = {"client": (raw["arrivals"], raw["measured"], http_us)}
    srv = raw.get("server")
    if srv:
        a0 = min(a for a, _, _ in srv)
        arrivals = sorted((a - a0, p, o) for (a, _, _), (_, p, o) in zip(srv, raw["arrivals"], strict=True))
        measured = {
            "ttft": [(f - a) * 1e3 for a, f, _ in srv],
            "tpot": [(e - f) * 1e3 / (o - 1) for (_, f, e), (_, _, o) in zip(srv, raw["arrivals"], strict=True) if o > 1],
            "e2e": [(e - a) * 1e3 for a, _, e in srv],
        }  # fmt: skip
        out["server"] = (arrivals, measured, 0.0)
    return out


PRICES = ("tick_us", "d0_us", "d1_us", "launch_us", "tok_us", "row_us")


def contention(run: dict[str, Any]) -> float:
    """The machine's slowdown during a load under processor sharing, max(1, L / cores), L the
    1-minute load average: its mean polled during the load, else the mean of before and after."""
    during = run.get("loadavg_during")
    lav = during if during is not None else (run["loadavg_before"] + run["loadavg_after"]) / 2
    return max(1.0, lav / (os.cpu_count() or 1))


def evaluate(run: dict[str, Any], costs: dict[str, float],
             source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The program's predictions for one load's raw record, against its measurements.

    The prediction is out of sample: its costs and jitter are fitted to another load's ticks
    (``source``, a second load of the same server run) and only the arrivals (send times,
    token counts) and the server's batch-formation window come from this load. Beside it, for
    comparison: the same with the cost fitted to this load's own ticks (in sample), with
    i.i.d. jitter, with serQ's first token at the end of the tick, and (client view) the
    startup calibration and probe (the earlier method)."""
    raw = run["raw"]
    window_us = raw["window_us"]
    source = source or run
    oos = {**costs, **fitted_costs(source, costs), "window_us": window_us}
    own = {**costs, **fitted_costs(run, costs), "window_us": window_us}
    scale = contention(run) / contention(source)
    scaled = {**oos, **{k: oos[k] * scale for k in PRICES if k in oos}}
    metrics: dict[str, Any] = {}
    for view, (arrivals, measured, http_us) in _views(raw, costs.get("http_us", 0.0)).items():
        h = {"http_us": http_us}
        variants = {
            "predicted": predict(arrivals, {**oos, **h}, PRED_SEEDS),
            "in_sample": predict(arrivals, {**own, **h}, PRED_SEEDS),
            "contention": predict(arrivals, {**scaled, **h}, PRED_SEEDS),
            "iid": predict(arrivals, {**oos, **h}, PRED_SEEDS, correlated=False),
            "end_of_tick": predict(arrivals, {**oos, **h}, PRED_SEEDS, first_at="end"),
        }
        if view == "client":
            variants["startup"] = predict(arrivals, {**costs, "window_us": window_us}, first_at="end")
        for key in ("ttft", "tpot", "e2e"):
            m = pcts(measured[key])
            row: dict[str, Any] = {"measured_ms": m, "predicted_ms": pcts(variants["predicted"][key])}
            for name, pred in variants.items():
                row[f"{name}_error_pct"] = {q: (v / m[q] - 1) * 100 for q, v in pcts(pred[key]).items()}
            row["error_pct"] = row.pop("predicted_error_pct")
            metrics[key if view == "client" else f"{key} (server)"] = row
    return {**run, "fit_from_load": source["load"], "tick_fit": oos, "own_tick_fit": own,
            "contention_scale": scale, "metrics": metrics}  # fmt: skip


def evaluate_all(runs: list[dict[str, Any]], costs: dict[str, float]) -> list[dict[str, Any]]:
    """Each load predicted from the next load's fit (the last from the first): out of sample
    whenever there are two loads or more."""
    return [evaluate(r, costs, runs[(i + 1) % len(runs)]) for i, r in enumerate(runs)]


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
        full = np.mean([t["decode_rows"] + t["prefill_chunks"] >= so.SLOTS for t in ticks]) * 100
        out.append(f"- Load {run['load']:.2f}: decode-only ticks at {d}; {p}; every slot busy in "
                   f"{full:.0f}% of the ticks (a queue waits for a slot there); the linear fit's "
                   f"mean absolute error {run.get('own_tick_fit', run['tick_fit'])['fit_mape_pct']:.0f}% per tick.")  # fmt: skip
    out.append(
        "- A prefill tick's launch follows the prompt tokens it carries (`tok_us`), not the padded "
        "chunk: plow launched one chunk a tick here, so a chunk price cannot be told from the "
        "launch's own. The tick / fit ratios are serially correlated (lag-1 and lag-20 "
        "autocorrelation above): other jobs' bursts slow many ticks in a row.")
    return out


ERR_COLUMNS = (("error_pct", "error % (out of sample)"),
               ("contention_error_pct", "out of sample, prices x contention"),
               ("in_sample_error_pct", "in sample"),
               ("iid_error_pct", "i.i.d. jitter"), ("end_of_tick_error_pct", "first token at tick end"),
               ("startup_error_pct", "startup calibration"))  # fmt: skip


def _goal(data: dict[str, Any], view: str) -> tuple[float, float] | None:
    """The largest |error| at p90/p99 and at any percentile of one view's out-of-sample
    prediction (``client`` or ``server``)."""
    rows = [row for run in data["runs"] for k, row in run["metrics"].items()
            if k.endswith("(server)") == (view == "server")]  # fmt: skip
    if not rows:
        return None
    tails = [abs(r["error_pct"][q]) for r in rows for q in ("p90", "p99")]
    return max(tails), max(abs(v) for r in rows for v in r["error_pct"].values())


def write_md(data: dict[str, Any], path: Path) -> None:
    c = data["costs"]
    L = ["# serQ predicting plow serve", "",
         f"{data['when']} on {data['machine']} (`uptime` load averages beside each load below; "
         "the machine is shared with other jobs, so this is a contended machine, not a quiet "
         f"one). Model {NAME} (plow's default model, SmolLM2-135M-Instruct), native executor "
         f"with one host thread, {so.SLOTS} slots, budget {BUDGET}, prompts "
         f"{PROMPTS[0]}..{PROMPTS[1]} tokens, outputs {OUTPUTS[0]}..{OUTPUTS[1]} (`ignore_eos`, "
         "temperature 0.7), Poisson arrivals seeded 11, 12, ... per load, one server for all "
         "loads.", "",
         "**Prediction, out of sample**: `examples/plow_serve.sq` through the reference "
         "interpreter on a load's measured arrivals (send times, token counts), its "
         "per-iteration cost fitted to **another load's** tick records of the same server "
         "(`plow serve --debug-ticks`, `GET /debug/ticks`; the 'fit from' column): the prefill "
         "launch `launch_us + tok_us * prompt tokens` fitted to the ticks' measured launch "
         "(`prefill_s`), the rest `tick_us + [decoding] (d0_us + d1_us * decoders)` to the "
         "tick's span less its launch; times a jitter whose marginal is the fit's ratios (12 "
         "bins: deciles, the top one split 5/4/1 %) and whose bins are correlated across "
         "iterations (a Gaussian AR(1) slow-spell level plus per-tick noise, `corr(k) = c "
         "rho^k` fitted to the ratios' autocorrelation over 1..20 ticks: `benchmarks/serq_predict.py`, "
         "`JitterStream`, each iteration's draws keeping the program's i.i.d. `~exp(1)` law); "
         "a request's first token at its tick's start plus the jittered prefill launch, where "
         f"plow emits it, not at the tick's end; {PRED_SEEDS} seeded runs pooled. Only the "
         "arrivals and the server's batch-formation window come from the predicted load. "
         "Two views: **client** (the latencies the load generator measured; the prediction "
         f"plus `http_us` {c['http_us'] / 1e3:.1f} ms, a lone request's client TTFT beyond the "
         "server's, on TTFT and end-to-end) and **server** (the dispatcher's own record of "
         "each request, `GET /debug/requests/ID`: arrival, first token, finish; the program "
         "on the server's arrival times, no HTTP term).", "",
         "| load | fit from | metric | measured p50 / p90 / p99 ms | predicted p50 / p90 / p99 ms | "
         + " | ".join(h for _, h in ERR_COLUMNS) + " |",
         "| --- " * (5 + len(ERR_COLUMNS)) + "|"]  # fmt: skip
    for run in data["runs"]:
        for key, row in run["metrics"].items():
            errs = " | ".join(_trip(row[k], "{:+.0f}") if k in row else "" for k, _ in ERR_COLUMNS)
            L.append(f"| {run['load']:.2f} ({run['requests']} req, {run['request_rate_per_s']:.2f}/s) | "
                     f"{run.get('fit_from_load', run['load']):.2f} | {key} | "
                     f"{_trip(row['measured_ms'], '{:.1f}')} | {_trip(row['predicted_ms'], '{:.1f}')} | "
                     f"{errs} |")  # fmt: skip
    L.append("")
    for view in ("client", "server"):
        g = _goal(data, view)
        if g is not None:
            L.append(f"Goal, {view} view: TTFT, TPOT and end-to-end p90/p99 within 10% out of "
                     f"sample (Vidur reports < 9%) — {'met' if g[0] <= 10 else 'NOT met'} in "
                     f"this run (largest |error| at p90/p99 {g[0]:.0f}%, at any percentile "
                     f"{g[1]:.0f}%).")  # fmt: skip
    L += ["", "Tick fits (µs; per load, from that load's ticks; a load's prediction uses the other's):", "",
          "| load | ticks | chunk | tick_us | d0_us | d1_us | launch_us | tok_us | row_us | jitter bins (x fit) | c | rho | lag-1 / lag-20 autocorr | busy gap us | fit mean abs error % | `uptime` load before / during / after |",
          "| --- " * 16 + "|"]  # fmt: skip
    for run in data["runs"]:
        f = run.get("own_tick_fit", run["tick_fit"])
        jq = " ".join(f"{f[f'jq{k}']:.2f}" for k in range(1, 13))
        L.append(f"| {run['load']:.2f} | {f['ticks']:.0f} | {f['chunk']} | {f['tick_us']:.0f} | {f['d0_us']:.0f} | "
                 f"{f['d1_us']:.0f} | {f['launch_us']:.0f} | {f.get('tok_us', 0):.0f} | {f['row_us']:.1f} | {jq} | "
                 f"{f.get('jc', 0):.2f} | {f.get('jrho', 0):.3f} | {f.get('acf1', 0):.2f} / {f.get('acf_last', 0):.2f} | "
                 f"{f['busy_gap_us']:.0f} | {f['fit_mape_pct']:.0f} | {run['loadavg_before']:.1f} / "
                 f"{run['loadavg_during'] if run.get('loadavg_during') is not None else float('nan'):.1f} / "
                 f"{run['loadavg_after']:.1f} |")  # fmt: skip
    L += ["", "Startup calibration and probe (the previous method, the 'startup' column): "
          + ", ".join(f"{k} {v:.4g}" for k, v in c.items())]
    L += ["", "## Limits", "",
          "- A contended machine: 2 cores shared with other jobs (load averages above), which "
          "move the tick's price between loads: an out-of-sample prediction carries that drift "
          "(compare the tick fits of the two loads), the in-sample column does not.",
          f"- Few requests: each load sends at most {MAX_REQUESTS} requests and about "
          f"{data.get('seconds', LOAD_SECONDS):.0f} s of arrivals; with ticks this slow that is tens of requests, so a "
          "p99 is one or two requests' worth and a p90 a handful. The prediction pools "
          f"{PRED_SEEDS} jitter seeds on the same arrivals; the measurement is one draw of "
          "the machine's slow spells, so its tail percentiles move by tens of % between runs "
          "whatever the model.",
          "- Near saturation (a load whose queue grows during slow spells) the latencies are "
          "the queue's, and a few % off in the tick's mean price or a slow spell the model "
          "places elsewhere in time changes them several-fold: the model's slow spells have "
          "the measured length and strength but not the measured times.",
          "- The jitter is one process for every tick (prefill and decode ticks share its bins "
          "and its correlation), correlated over iterations, not over wall-clock time.",
          "- plow re-prices the prefill chunk every tick (`choose_chunk_size`); the program uses "
          "one chunk, the largest the server launched in that load. plow packs at most `budget // chunk` "
          "chunks; the program fills the budget with a partial last chunk. plow admits into a "
          "free slot even when the tick's prefill launch is full; the program admits only "
          "requests that get prefill tokens in that tick.",
          "- The batch-formation window is dynamic in plow (re-chosen every 100 ms); the program "
          "runs each load with one `window_us`, the median of the server's choice polled every "
          "0.5 s (taken from the predicted load: it is the server's output, not a price). The "
          "admission bound (429 refusals) is not modelled.",
          "- Client view: HTTP's request-side latency is one constant `http_us`, measured by "
          "the probe before the loads; the load generator shares the cores, so its own "
          "delays are in the client-side measurement and not in the model."]  # fmt: skip
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
    ap.add_argument("--name", default="serq_predict", help="the files' stem (NAME.json, NAME.md)")
    args = ap.parse_args()
    if args.md_only or args.repredict:
        data = json.loads((args.out / f"{args.name}.json").read_text())
        if args.repredict:
            data["runs"] = evaluate_all(data["runs"], data["costs"])
            (args.out / f"{args.name}.json").write_text(json.dumps(data, indent=1) + "\n")
        write_md(data, args.out / f"{args.name}.md")
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
                print(f"load {rho}: {runs[-1]['requests']} requests", flush=True)
        finally:
            srv.stop()
    runs = evaluate_all(runs, costs)
    data = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": args.seconds,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}",
            "costs": costs, "runs": runs}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(data, indent=1) + "\n")
    write_md(data, args.out / f"{args.name}.md")
    print(f"wrote {args.out / f'{args.name}.md'}")


if __name__ == "__main__":
    main()
