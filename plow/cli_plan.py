"""`plow compile` (tiling stage so far) and `plow calibrate target cpu`, registered on the
main typer app by `register(app, fail)` (plow/cli.py calls it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from plow.errors import PlowError

Fail = Callable[[PlowError], NoReturn]

TARGET_HELP = "A shipped target (cpu, h100, h200, b200, mi350x) or a target JSON file."


def _compile_cmd(fail: Fail) -> Callable[..., None]:
    def compile(  # noqa: A001 - the command is named compile
        source: Annotated[
            Path,
            typer.Argument(
                help="A checkpoint directory or a config.json (no weights needed with --plan-only)."
            ),
        ],
        out: Annotated[Path, typer.Option("-o", "--out", help="Output directory.")],
        target: Annotated[str, typer.Option("--target", help=TARGET_HELP)] = "cpu",
        plan_only: Annotated[
            bool, typer.Option("--plan-only", help="Plan from the config alone; write no weights.")
        ] = False,
        verify: Annotated[
            bool,
            typer.Option(
                "--verify", help="Run the oracle checkpoints (B today) and write certificates."
            ),
        ] = False,
        profile_file: Annotated[
            Path | None,
            typer.Option("--profile", help="A compile profile JSON (buckets, budgets)."),
        ] = None,
        budget_ms: Annotated[
            float | None,
            typer.Option(
                "--budget-ms",
                min=0.000001,
                help="Decode step budget in ms (overrides the profile).",
            ),
        ] = None,
        context: Annotated[
            int | None,
            typer.Option(
                "--context", min=1, help="Key-value context of the buckets (overrides the profile)."
            ),
        ] = None,
    ) -> None:
        """Compile a checkpoint into a plan (today: tiling + bounds + checkpoint B)."""
        from plow.compile import STAGES, compile_plan, write_plan
        from plow.profile import CompileProfile, load_profile
        from plow.target import load_target
        from plow.tiles import fmt_ns

        console = Console(stderr=True)
        try:
            if not plan_only:
                raise PlowError(
                    "compile",
                    "full bundles (schedule, emit, weights) are not built yet: pass --plan-only",
                )
            tgt = load_target(target)
            prof = load_profile(profile_file) if profile_file else CompileProfile()
            upd: dict[str, object] = {}
            if budget_ms is not None:
                upd["decode_budget_ns"] = max(1, round(budget_ms * 1e6))
            if context is not None:
                upd["context"] = context
            if upd:
                prof = prof.model_copy(update=upd)
            stages = [s for s in STAGES if verify or not s.startswith("checkpoint")]
            with Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            ) as progress:
                tasks = {"import": progress.add_task("import", total=1)}
                for s in stages:
                    tasks[s] = progress.add_task(s, total=None)

                def on_stage(name: str, bucket: str, phase: str) -> None:
                    if name not in tasks:
                        return
                    label = f"{name} {bucket}".strip()
                    if phase == "start":
                        progress.update(tasks[name], description=label)
                    else:
                        progress.advance(tasks[name])

                from plow.checkpoint import load_spec

                n_buckets = len(prof.buckets(load_spec(source).max_position))
                for s in stages:
                    progress.update(tasks[s], total=n_buckets)
                result = compile_plan(source, tgt, prof, verify=verify, on_stage=on_stage)
            write_plan(result, out)
        except PlowError as e:
            fail(e)
        table = Table(title=f"plan {out} — target {tgt.name}")
        for col in (
            "bucket",
            "ops",
            "tiles",
            "bandwidth bound",
            "compute bound",
            "estimate",
            "budget",
            "checkpoint B",
            "schedule",
            "checkpoint D",
        ):
            table.add_column(col)
        for b in result.buckets:
            cert = b.certificate
            table.add_row(
                b.bucket.name,
                str(len(b.tiles.ops)),
                str(b.tiles.num_tiles),
                fmt_ns(b.bounds.bandwidth_bound_ns),
                fmt_ns(b.bounds.compute_bound_ns),
                fmt_ns(b.bounds.estimated_ns),
                fmt_ns(b.budget_ns),
                "not run" if cert is None else cert.verdict.value,
                "-"
                if b.schedule is None
                else f"{len(b.schedule.tasks)} tasks, {len(b.schedule.counters)} counters, "
                f"{fmt_ns(b.schedule.makespan_ns)}",
                "not run"
                if b.schedule_certificate is None
                else b.schedule_certificate.verdict.value,
            )
        Console().print(table)

    return compile


def _calibrate_target_cmd(fail: Fail) -> Callable[..., None]:
    def target(
        what: Annotated[str, typer.Argument(help="What to calibrate: cpu (this machine).")],
        out: Annotated[
            Path | None,
            typer.Option("-o", "--out", help="Write the target JSON here (default: stdout)."),
        ] = None,
        repeats: Annotated[
            int, typer.Option(min=1, help="Measurements per quantity (best is kept).")
        ] = 5,
    ) -> None:
        """Measure this machine's bandwidth and matmul rate; write a target JSON."""
        from plow.target import calibrate_cpu

        console = Console(stderr=True)
        try:
            if what != "cpu":
                raise PlowError(f"calibrate target {what}", "only `cpu` can be calibrated here")
            with Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                console=console,
            ) as progress:
                tasks: dict[str, TaskID] = {}

                def on_step(name: str, done: int, total: int) -> None:
                    if name not in tasks:
                        tasks[name] = progress.add_task(name, total=total)
                    progress.update(tasks[name], completed=done)

                tgt = calibrate_cpu(repeats=repeats, on_step=on_step)
            text = tgt.model_dump_json(indent=2) + "\n"
            if out is None:
                print(text, end="")
            else:
                try:
                    out.write_text(text)
                except OSError as e:
                    raise PlowError(out, f"cannot write: {e.strerror or e}") from e
                console.print(
                    f"wrote {out}: {tgt.workers} workers, "
                    f"{tgt.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
                    f"{tgt.peak_flops_per_s['fp32'] / 1e9:.1f} GFLOP/s fp32",
                    highlight=False,
                )
        except PlowError as e:
            fail(e)

    return target


def register(app: typer.Typer, fail: Fail) -> None:
    """Add `compile`, and `target` to the `calibrate` group (created if absent)."""
    app.command(name="compile")(_compile_cmd(fail))
    group = next(
        (
            g.typer_instance
            for g in app.registered_groups
            if g.name == "calibrate" and g.typer_instance is not None
        ),
        None,
    )
    if group is None:
        group = typer.Typer(
            help="Measure this machine (or a bundle) and write calibration data.",
            no_args_is_help=True,
        )
        app.add_typer(group, name="calibrate")
    group.command(name="target")(_calibrate_target_cmd(fail))


__all__ = ["register"]
