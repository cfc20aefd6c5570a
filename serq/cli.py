"""The ``serq`` command: ``serq run``, ``serq check``, ``serq prove`` and ``serq sweep``."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from serq.checker import check as check_program
from serq.compile import MAX_ARRIVALS, MAX_ITERATIONS, Limits
from serq.errors import SerqError
from serq.parser import parse_file

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="serQ: simulate serving-system models and check per-iteration claims.",
)

EXIT_BAD_INPUT = 2
EXIT_CLAIM_FAILED = 1


def _fail(err: SerqError, debug: bool, file: Path) -> None:
    if err.filename is None:
        err.filename = str(file)  # a bad setting: named after the file it was given for
    if debug:
        raise err
    sys.stderr.write(err.render() + "\n")
    raise typer.Exit(EXIT_BAD_INPUT)


def _parse_sets(items: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise SerqError(f"--set expects NAME=VALUE, got {item!r}")
        try:
            v = float(value)
        except ValueError:
            raise SerqError(f"--set {name}: {value!r} is not a number") from None
        if not math.isfinite(v):
            raise SerqError(f"--set {name}: {value!r} is not a finite number")
        out[name] = (
            int(v) if v.is_integer() and "." not in value and "e" not in value.lower() else v
        )
    return out


@app.command()
def run(
    file: Annotated[Path, typer.Argument(help="the .sq program")],
    horizon: Annotated[float, typer.Option(help="simulated time, µs")] = 10_000_000.0,
    warmup: Annotated[
        float, typer.Option(help="requests arriving earlier are not measured, µs")
    ] = 0.0,
    seed: Annotated[int, typer.Option(help="random seed")] = 0,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="override args.number(NAME, ...): NAME=VALUE (repeatable)"),
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    max_iterations: Annotated[
        int, typer.Option(help="stop with an error after this many iterations")
    ] = MAX_ITERATIONS,
    max_arrivals: Annotated[
        int, typer.Option(help="stop with an error after this many arrivals")
    ] = MAX_ARRIVALS,
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    """Simulate FILE and check its claims on every iteration (exit 1 if a claim fails)."""
    from serq import report
    from serq.sim import load, simulate

    try:
        overrides = _parse_sets(set_ or [])
        model = load(file, overrides=overrides)
        try:
            limits = Limits(iterations=max_iterations, arrivals=max_arrivals)
            result = simulate(model, horizon, warmup, seed, limits)
        except SerqError as err:
            raise err.attach(str(file), model.text or "") from None
    except SerqError as err:
        _fail(err, debug, file)
        return
    if json_:
        sys.stdout.write(json.dumps(result.as_dict(), indent=None) + "\n")
    else:
        report.render(result, Console(highlight=False))
    if not result.ok:
        raise typer.Exit(EXIT_CLAIM_FAILED)


@app.command()
def check(
    file: Annotated[Path, typer.Argument(help="the .sq program")],
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    """Parse and type-check FILE without running it."""
    try:
        program, text = parse_file(file)
        info = check_program(program, str(file), text)
        from serq.compile import build

        try:
            build(program, info, None, str(file))
        except SerqError as err:
            raise err.attach(str(file), text) from None
    except SerqError as err:
        _fail(err, debug, file)
        return
    claims = ", ".join(c.name for c in info.claims) or "none"
    engines = ", ".join(info.engines) or "none"
    typer.echo(f"{file}: ok (engines: {engines}; claims: {claims})")


@app.command()
def prove(
    file: Annotated[Path, typer.Argument(help="the .sq program")],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="override args.number(NAME, ...): NAME=VALUE (repeatable)"),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="write the exported Rocq file (.v) here")
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    """Export FILE's engine and claims to Rocq and prove each claim over every path
    (exit 1 if a claim is not proved)."""
    from rich.table import Table

    from serq.prove import prove_file, prove_file_stability

    try:
        results = prove_file(file, _parse_sets(set_ or []), out)
        stab = prove_file_stability(file, _parse_sets(set_ or []))
    except SerqError as err:
        _fail(err, debug, file)
        return
    if json_:
        rows = [{"claim": r.name, "given": r.given, "proved": r.proved, "detail": r.detail}
                for r in results]  # fmt: skip
        st = {"theorem": stab.name, "proved": stab.proved, "detail": stab.detail}
        sys.stdout.write(json.dumps({"file": str(file), "claims": rows, "stability": st}) + "\n")
    else:
        t = Table(title=f"claims of {file}, in Rocq", title_justify="left")
        for col in ("claim", "kind", "result"):
            t.add_column(col)
        for r in results:
            name = r.name if r.given is None else f"{r.name} given ({r.given})"
            style = "green" if r.proved else "bold red"
            t.add_row(name, "every iteration, every path", f"[{style}]{r.result_text()}[/{style}]")
        # Theorem 2 is the library's, about the engine under slotted arrivals: reported, and
        # not counted in the exit status (it is no claim of the program)
        style = "green" if stab.proved else "yellow"
        text = "proved (every slot law)" if stab.proved else f"not proved: {stab.detail}"
        t.add_row(stab.name, "stability, slotted arrivals", f"[{style}]{text}[/{style}]")
        Console(highlight=False).print(t)
    if not all(r.proved for r in results):
        raise typer.Exit(EXIT_CLAIM_FAILED)


@app.command()
def sweep(
    file: Annotated[Path, typer.Argument(help="the .sq program")],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="NAME=LO:HI:N (N points), NAME=A,B,... or NAME=VALUE"),
    ] = None,
    seeds: Annotated[str, typer.Option(help="A..B, A,B,... or A")] = "0",
    horizon: Annotated[float, typer.Option(help="simulated time, µs")] = 10_000_000.0,
    warmup: Annotated[
        float, typer.Option(help="requests arriving earlier are not measured, µs")
    ] = 0.0,
    ray: Annotated[
        str | None, typer.Option("--ray", help="run on this Ray cluster (auto, local, HOST:PORT)")
    ] = None,
    jobs: Annotated[int | None, typer.Option(help="local worker processes (without --ray)")] = None,
    out: Annotated[Path | None, typer.Option(help="output folder (default FILE-sweep)")] = None,
    max_iterations: Annotated[int, typer.Option(help="per run")] = MAX_ITERATIONS,
    max_arrivals: Annotated[int, typer.Option(help="per run")] = MAX_ARRIVALS,
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    """Run FILE over a grid of --set values x seeds (on Ray with --ray, else local processes);
    write a CSV per run, a CSV per point and a plot (exit 1 if a claim fails anywhere)."""
    from serq import sweep as sw

    out_dir = out if out is not None else Path(f"{file.stem}-sweep")
    try:
        if jobs is not None and jobs < 1:
            raise SerqError(f"--jobs must be an integer >= 1, got {jobs}")
        ranges = [sw.parse_range(item) for item in set_ or []]
        seed_list = sw.parse_seeds(seeds)
        sw.outputs(out_dir)
        limits = Limits(iterations=max_iterations, arrivals=max_arrivals)
        result = sw.run_sweep(file, ranges, seed_list, horizon, warmup, limits, ray, jobs)
        files = sw.write(result, out_dir)
    except SerqError as err:
        _fail(err, debug, file)
        return
    failing = sum(1 for p in result.points if not p["ok"])
    typer.echo(f"{file}: {len(result.rows)} runs ({len(result.points)} points x "
               f"{len(seed_list)} seeds) in {result.wall_s:.1f} s; claims fail at {failing} "
               f"point(s); wrote {', '.join(str(f) for f in files)}")  # fmt: skip
    if not result.ok:
        raise typer.Exit(EXIT_CLAIM_FAILED)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
