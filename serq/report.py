"""Human-readable reports of a run: the claim table, counterexamples and run statistics."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from serq.sim import RunResult


def _us(v: Any) -> str:
    if v is None:
        return "-"
    v = float(v)
    if v >= 1e6:
        return f"{v / 1e6:.3f} s"
    if v >= 1e3:
        return f"{v / 1e3:.2f} ms"
    return f"{v:.1f} µs"


def claim_table(result: RunResult) -> Table:
    t = Table(title="claims", title_justify="left")
    t.add_column("claim")
    t.add_column("kind")
    t.add_column("result")
    for c in result.claims:
        style = {"holds": "green", "fails": "bold red"}.get(c.status, "yellow")
        name = c.name if c.given is None else f"{c.name} given ({c.given})"
        t.add_row(name, c.kind, f"[{style}]{c.result_text()}[/{style}]")
    return t


def counterexample_lines(result: RunResult) -> list[str]:
    """TLC-style traces: the states of the last iterations up to the violating one."""
    out: list[str] = []
    for c in result.claims:
        ce = c.counterexample
        if ce is None:
            continue
        out.append(
            f"claim {c.name} is violated at iteration {ce['iteration']} "
            f"(t = {ce['time_us']:g} µs): not ({ce['claim']})"
        )
        for k, st in enumerate(ce["trace"], start=1):
            last = " (violation)" if k == len(ce["trace"]) else ""
            out.append(f"State {k}: <iteration {st['iteration']}>{last}")
            for key in (
                "now",
                "served",
                "tokens",
                "batch_requests",
                "decoders",
                "residents",
                "waiting",
                "mode",
            ):
                v = st[key]
                out.append(
                    f"  /\\ {key} = {v:.3f}" if isinstance(v, float) else f"  /\\ {key} = {v}"
                )
        out.append("")
    return out


def stats_table(result: RunResult) -> Table:
    s = result.stats
    t = Table(title="run", title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("value")
    frac = s["completion_fraction"]
    t.add_row("horizon / warmup", f"{_us(result.horizon_us)} / {_us(result.warmup_us)}")
    t.add_row("seed", str(result.seed))
    if result.params:
        t.add_row("parameters", ", ".join(f"{k}={v:g}" for k, v in result.params.items()))
    t.add_row("iterations", f"{s['iterations']} ({s['iterations_after_warmup']} after warmup)")
    t.add_row("arrivals", str(s["arrivals"]))
    t.add_row(
        "completions within horizon",
        f"{s['completions']}" + (f" ({100 * frac:.1f}%)" if frac is not None else ""),
    )
    t.add_row(
        "in system at end",
        f"{s['in_system_at_end']} ({s['waiting_at_end']} waiting, {s['decoding_at_end']} decoding)",
    )
    th = s["throughput"]
    t.add_row(
        "throughput",
        f"{th['requests_per_s']:.2f} req/s, {th['tokens_per_s']:.0f} tokens/s",
    )
    t.add_row(
        "simulation speed",
        f"{s['sim_iterations_per_s'] or 0:.0f} iterations/s ({result.wall_s:.3f} s)",
    )
    return t


def latency_table(result: RunResult) -> Table:
    s = result.stats
    t = Table(title="latency (requests arriving after warmup)", title_justify="left")
    for col in ("metric", "count", "p50", "p90", "p99", "max"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    rows: list[tuple[str, dict[str, Any]]] = [
        ("time to first token", s["ttft_us"]),
        ("time between tokens", s["tbt_us"]),
        ("response", s["response_us"]),
    ]
    rows += [(f"observe {n}", v) for n, v in s["observe"].items()]
    for name, p in rows:
        if not p.get("count"):
            t.add_row(name, "0", "-", "-", "-", "-")
            continue
        t.add_row(name, str(p["count"]), _us(p["p50"]), _us(p["p90"]), _us(p["p99"]), _us(p["max"]))
    return t


def batch_table(result: RunResult) -> Table:
    b = result.stats["batch"]
    t = Table(title="batch size (requests per iteration)", title_justify="left")
    t.add_column("requests", justify="right")
    t.add_column("iterations", justify="right")
    t.add_column("share", justify="right")
    for row in b["histogram"]:
        t.add_row(row["requests"], str(row["iterations"]), f"{100 * row['fraction']:.1f}%")
    r, k = b["requests"], b["tokens"]
    if r.get("count"):
        t.caption = (
            f"requests p50 {r['p50']:g} / p99 {r['p99']:g} / max {r['max']:g}; "
            f"tokens p50 {k['p50']:g} / p99 {k['p99']:g} / mean {k['mean']:.1f}"
        )
    return t


def render(result: RunResult, console: Console) -> None:
    console.print(claim_table(result))
    for line in counterexample_lines(result):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    console.print(stats_table(result))
    console.print(latency_table(result))
    console.print(batch_table(result))
