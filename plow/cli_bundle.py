"""`plow verify BUNDLE` and `plow inspect BUNDLE [--json]` (registered by `plow.cli_plan`),
plus the tables `plow compile` prints."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from plow.cli_common import Fail
from plow.errors import PlowError


def _theorems(names: tuple[str, ...]) -> str:
    if not names:
        return "-"
    first = names[0].rsplit(".", 1)[-1]
    return first if len(names) == 1 else f"{first} (+{len(names) - 1})"


def certificate_table(report: Any, title: str) -> Table:
    table = Table(title=title)
    for col in ("checkpoint", "bucket", "verdict", "theorems", "reason"):
        table.add_column(col, overflow="fold")
    for r in report.rows:
        style = "red" if r.rejected else "green"
        table.add_row(
            r.checkpoint,
            r.bucket or "-",
            f"[{style}]{r.verdict}[/{style}]",
            _theorems(r.theorems),
            r.reason or "-",
        )
    return table


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _verify_cmd(fail: Fail) -> Callable[..., None]:
    def verify(
        bundle: Annotated[Path, typer.Argument(help="A bundle directory (plow compile -o).")],
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
        source: Annotated[
            Path | None,
            typer.Option(
                "--source",
                help="The checkpoint directory the bundle came from: its config.json and "
                "every weight (under rewrites.json's re-layouts) must be the bundle's, byte "
                "for byte.",
            ),
        ] = None,
    ) -> None:
        """Re-derive every checkpoint payload from the bundle's files and run the oracle
        (A-F); with --source, also compare the config and weights with the checkpoint's;
        exit 1 if any check rejects, 2 if the bundle is malformed."""
        from plow.emit.verify import verify_bundle, write_certificates

        src_report = None
        try:
            report = verify_bundle(bundle)
            notes = write_certificates(report)
            if source is not None and report.accepted:
                src_report = _verify_source(bundle, source)
        except PlowError as e:
            fail(e)
        if src_report is not None:
            notes.append(
                f"source {source}: config.json and {src_report.weights} weights "
                f"({_bytes(src_report.bytes)}) equal the checkpoint's"
                if src_report.accepted
                else f"source {source}: rejected: {src_report.problem}"
            )
        if as_json:
            print(
                json.dumps(
                    {
                        "bundle": str(bundle),
                        "accepted": report.accepted,
                        "rows": [
                            {
                                "checkpoint": r.checkpoint,
                                "bucket": r.bucket,
                                "verdict": r.verdict,
                                "theorems": list(r.theorems),
                                "reason": r.reason,
                            }
                            for r in report.rows
                        ],
                        "notes": notes,
                        "source": None
                        if src_report is None
                        else {"accepted": src_report.accepted, "problem": src_report.problem},
                    }
                )
            )
        else:
            console = Console()
            console.print(certificate_table(report, f"verify {bundle}"))
            for n in notes:
                console.print(f"note: {n}", highlight=False)
        if not report.accepted:
            r = report.first_rejection()
            assert r is not None
            Console(stderr=True).print(
                f"plow: {bundle}: rejected by {r.checkpoint}"
                + (f" (bucket {r.bucket})" if r.bucket else "")
                + f": {r.reason}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1)
        if src_report is not None and not src_report.accepted:
            Console(stderr=True).print(
                f"plow: {bundle}: differs from the source {source}: {src_report.problem}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1)

    return verify


def _verify_source(bundle: Path, source: Path) -> Any:
    """`plow verify --source` (plow/emit/verify_source.py), with a progress bar on a terminal."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from plow.emit.verify_source import verify_source

    console = Console(stderr=True)
    with Progress(
        TextColumn("weights vs source"),
        BarColumn(),
        DownloadColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as progress:
        task = progress.add_task("source", total=None)
        return verify_source(
            bundle,
            source,
            on_progress=lambda done, total: progress.update(task, completed=done, total=total),
        )


def _inspect_cmd(fail: Fail) -> Callable[..., None]:
    def inspect(
        bundle: Annotated[Path, typer.Argument(help="A bundle directory (plow compile -o).")],
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
        rewrites: Annotated[
            bool,
            typer.Option(
                "--rewrites",
                help="The fusion e-graph's report per bucket: rule matches, extractions, "
                "what the emitter lacks.",
            ),
        ] = False,
        counters: Annotated[
            bool,
            typer.Option(
                "--counters",
                help="The collapse decision per bucket (the plan rebuilt): fine edges, and "
                "each routed-expert edge's verdict (coarse for all routings, or an estimate).",
            ),
        ] = False,
    ) -> None:
        """Per bucket: ops, tiles, packets, counters, edges (and after transitive
        reduction), dead counters, arena bytes by region, on-chip peak per worker."""
        from plow.emit.inspect import inspect_bundle

        if counters:
            from plow.emit.counter_report import counter_decisions_of_bundle, render_counters

            try:
                doc = counter_decisions_of_bundle(bundle)
            except PlowError as e:
                fail(e)
            print(json.dumps(doc) if as_json else render_counters(doc))
            return
        if rewrites:
            from plow.egraph.report import render
            from plow.emit.inspect import applied_rewrites, rewrites_of_bundle

            try:
                reports = rewrites_of_bundle(bundle)
                applied = applied_rewrites(bundle)
            except PlowError as e:
                fail(e)
            if as_json:
                print(
                    json.dumps(
                        {
                            "bundle": str(bundle),
                            "rewrites": [r.model_dump() for r in reports],
                            "applied": applied,
                        }
                    )
                )
                return
            for r in reports:
                for table in render(r):
                    Console().print(table)
            t = Table(title="applied in the packets (rewrites.json; compile --fuse)")
            for c in ("rule", "fused op", "kind", "canonical ops"):
                t.add_column(c)
            for b in applied["blocks"]:
                t.add_row(b["rule"], b["fused"], b["kind"], ", ".join(b["canonical"]))
            Console().print(t if applied["blocks"] else "applied in the packets: none")
            for lay in applied["layouts"]:
                Console().print(
                    f"re-laid-out weight {lay['weight']}: {lay['layout']} of "
                    f"{', '.join(lay['sources'])}",
                    highlight=False,
                )
            return
        try:
            info = inspect_bundle(bundle)
        except PlowError as e:
            fail(e)
        if as_json:
            print(json.dumps(info))
            return
        console = Console()
        mdl = info["model"]
        console.print(
            f"{bundle}: {mdl['family']} ({mdl['layers']} layers, {mdl['parameters']:,} "
            f"parameters) for {info['target']}" + (" — plan only" if info["plan_only"] else ""),
            highlight=False,
        )
        t = Table(title="plan per bucket")
        cols = (
            ("bucket", "bucket"),
            ("ops", "ops"),
            ("tiles", "tiles"),
            ("tasks", "tasks"),
            ("packets", "packets"),
            ("nops", "nop_packets"),
            ("counters", "counters"),
            ("edges", "edges"),
            ("op edges", "op_edges"),
            ("after reduction", "op_edges_after_reduction"),
            ("dead counters", "dead_counters"),
        )
        for c, _ in cols:
            t.add_column(c)
        for b in info["buckets"]:
            t.add_row(*(str(b[k]) for _, k in cols))
        console.print(t)
        m = Table(title="memory per bucket")
        for c in (
            "bucket",
            "arena",
            "weights",
            "kv",
            "io",
            "activations+scratch",
            "on-chip peak (max / mean / budget pages)",
            "hoisted loads",
        ):
            m.add_column(c)
        for b in info["buckets"]:
            r = b["arena_bytes_by_region"]
            m.add_row(
                b["bucket"],
                _bytes(b["arena_bytes"]),
                _bytes(r["weights"]),
                _bytes(r["kv"]),
                _bytes(r["io"]),
                _bytes(r["activations+scratch"]),
                f"{b['onchip_peak_pages_max']} / {b['onchip_peak_pages_mean']} / "
                f"{b['onchip_budget_pages']} (x {_bytes(b['onchip_page_bytes'])})",
                str(b["hoisted_loads"]),
            )
        console.print(m)
        ct = Table(title="counters per scope (system: why)")
        for col in ("bucket", "cta", "device", "system", "why system scope"):
            ct.add_column(col)
        for b in info["buckets"]:
            sc, why = b["counter_scopes"], b["system_counters_why"]
            ct.add_row(
                b["bucket"],
                str(sc["cta"]),
                str(sc["device"]),
                str(sc["system"]),
                "; ".join(f"{n}: {w}" for w, n in why.items())
                or "- (every dependency within a GPU)",
            )
        console.print(ct)

    return inspect


def compile_table(result: Any) -> Table:
    from plow.tiles import fmt_ns

    table = Table(title=f"bundle {result.out} — target {result.plan.target.name}")
    for col in (
        "bucket",
        "ops",
        "tiles",
        "tasks",
        "packets",
        "counters",
        "arena",
        "bound",
        "makespan",
        "budget",
    ):
        table.add_column(col)
    plans = {b.bucket.name: b for b in result.plan.buckets}
    for e in result.emitted:
        bp = plans[e.bucket.name]
        table.add_row(
            e.bucket.name,
            str(len(e.op_table.ops)),
            str(bp.tiles.num_tiles),
            str(len(e.schedule.tasks.name)),
            str(len(e.packets)),
            str(len(e.schedule.counters.name)),
            _bytes(e.schedule.arena.arena_bytes),
            fmt_ns(max(bp.bounds.bandwidth_bound_ns, bp.bounds.compute_bound_ns)),
            fmt_ns(e.schedule.makespan_ns),
            fmt_ns(bp.budget_ns),
        )
    return table


def register(app: typer.Typer, fail: Fail) -> None:
    app.command(name="verify")(_verify_cmd(fail))
    app.command(name="inspect")(_inspect_cmd(fail))


__all__ = ["certificate_table", "compile_table", "register"]
