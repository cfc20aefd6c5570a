"""`plow compile` (checkpoint → bundle) and `plow calibrate target cpu`, registered on the
main typer app by `register(app, fail)` (plow/cli.py calls it); `register` also adds
`plow verify` and `plow inspect` (plow/cli_bundle.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

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

from plow.cli_common import Fail, calibrate_group
from plow.errors import PlowError

TARGET_HELP = "A shipped target (cpu, h100, h200, b200, mi350x) or a target JSON file."


def _compile_cmd(fail: Fail) -> Callable[..., None]:
    def compile(  # noqa: A001 - the command is named compile
        source: Annotated[
            Path,
            typer.Argument(
                help="A checkpoint directory or a config.json (no weights needed with --plan-only)."
            ),
        ],
        out: Annotated[Path, typer.Option("-o", "--out", help="The bundle directory to write.")],
        target: Annotated[str, typer.Option("--target", help=TARGET_HELP)] = "cpu",
        plan_only: Annotated[
            bool,
            typer.Option(
                "--plan-only", help="Plan from the config alone; write no weights or tokenizer."
            ),
        ] = False,
        verify: Annotated[
            bool,
            typer.Option(
                "--verify",
                help="Verify the written bundle (oracle A-F) before it is moved into place.",
            ),
        ] = False,
        force: Annotated[
            bool,
            typer.Option(
                "--force",
                help="Replace an existing bundle at -o (never the source, never a directory "
                "that is not a bundle).",
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
        tp: Annotated[
            int | None,
            typer.Option(
                "--tp",
                min=1,
                help="Tensor-parallel degree: the graph's attention heads and MLP columns "
                "are split over this many devices, the partial sums meeting in allreduce ops "
                "(docs/parallel.md; overrides the target's gpus).",
            ),
        ] = None,
        fuse: Annotated[
            bool | None,
            typer.Option(
                "--fuse/--no-fuse",
                help="The e-graph stage's fused ops in the packets (R1, R2+R3+R13, R4; "
                "docs/egraph.md): on by default (the profile's `fuse`); --no-fuse plans "
                "the canonical ops.",
            ),
        ] = None,
    ) -> None:
        """Compile a checkpoint into a bundle (plan files, op tables, weights, tokenizer)."""
        from plow.cli_bundle import certificate_table, compile_table
        from plow.compile import progress_stages
        from plow.emit.bundle import (
            CompileTerminated,
            check_destination,
            compile_bundle,
        )
        from plow.profile import CompileProfile, load_profile
        from plow.target import load_target

        console = Console(stderr=True)
        try:
            tgt = load_target(target)
            if tp is not None:
                tgt = tgt.model_copy(update={"gpus": tp})
            prof = load_profile(profile_file) if profile_file else CompileProfile()
            upd: dict[str, object] = {}
            if budget_ms is not None:
                upd["decode_budget_ns"] = max(1, round(budget_ms * 1e6))
            if context is not None:
                upd["context"] = context
            if fuse is not None:
                upd["fuse"] = fuse
            if upd:
                prof = prof.model_copy(update=upd)
            # What can be refused before planning is refused before the progress display
            # (an error is then the only line on stderr).
            from plow.checkpoint import load_spec

            n_buckets = len(prof.buckets(load_spec(source).max_position))
            check_destination(source, out, replace=force)
            per_bucket, final = progress_stages(verify=verify)
            with Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=console,
                transient=False,
                disable=not console.is_terminal,  # logs get the table, not frames
            ) as progress:
                tasks = {"import": progress.add_task("import", total=1)}
                for s in (*per_bucket, *final):
                    tasks[s] = progress.add_task(s, total=None if s in per_bucket else 1)

                def on_stage(name: str, bucket: str, phase: str) -> None:
                    if name not in tasks:
                        return
                    label = f"{name} {bucket}".strip()
                    if phase == "start":
                        progress.update(tasks[name], description=label)
                    else:
                        progress.advance(tasks[name])

                for s in per_bucket:
                    progress.update(tasks[s], total=n_buckets)
                result = compile_bundle(
                    source,
                    out,
                    tgt,
                    prof,
                    verify=verify,
                    plan_only=plan_only,
                    replace=force,
                    on_stage=on_stage,
                )
        except PlowError as e:
            fail(e)
        except (KeyboardInterrupt, CompileTerminated) as e:
            what = e.signal_name if isinstance(e, CompileTerminated) else "SIGINT"
            console.print(
                f"plow: {out}: compile stopped by {what}; its partial output was removed",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(128 + e.signum if isinstance(e, CompileTerminated) else 130) from None
        Console().print(compile_table(result))
        if result.report is not None:
            Console().print(certificate_table(result.report, f"certificates ({out}/certificates)"))

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
    """Add `compile`, `verify`, `inspect`, and `target` to the `calibrate` group."""
    app.command(name="compile")(_compile_cmd(fail))
    group = calibrate_group(app)
    group.command(name="target")(_calibrate_target_cmd(fail))
    from plow.cli_bundle import register as register_bundle

    register_bundle(app, fail)


__all__ = ["register"]
