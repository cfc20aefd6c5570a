"""`plow serve` and `plow calibrate prefill`, registered on the main typer app by
`register(app, fail)` (plow/cli.py calls it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from plow.cli_common import Fail, calibrate_group
from plow.errors import PlowError

DEFAULT_MAX_NUM_SEQS = 8


def _model_dir(path: Path) -> Path:
    if not path.is_dir():
        raise PlowError(path, "not a checkpoint directory")
    return path  # a checkpoint, or a bundle (manifest.json: served by the CPU executor)


def _slots(path: Path, requested: int | None) -> int:
    """The slots `path` is served with: `--max-num-seqs`, or by default 8 for a checkpoint (its
    engine runs any batch) and the largest decode batch of a bundle's ladder. A bundle whose
    ladder cannot run the requested batch is an error, never a silent shrink."""
    from plow.bundle.manifest import read_manifest
    from plow.bundle.open import is_bundle

    if not is_bundle(path):
        return DEFAULT_MAX_NUM_SEQS if requested is None else requested
    batches = [r.batch for r in read_manifest(path).ladder if r.phase == "decode"]
    if not batches:
        raise PlowError(path, "the bundle's ladder has no decode rung: it cannot be served")
    top = max(batches)
    if requested is None:
        return top
    if requested > top:
        raise PlowError(
            "--max-num-seqs",
            f"{requested} slots, but the ladder of bundle {path} runs decode batches up to "
            f"{top}: pass --max-num-seqs {top} or less, or serve a bundle compiled with larger "
            "decode batches (or the checkpoint)",
        )
    return requested


def verified_only(e: PlowError) -> PlowError:
    """A refused bundle's error without the --no-verify hint: plow serve has no such flag."""
    from plow.bundle.open import NO_VERIFY_HINT, BundleRefused

    problem = e.problem.replace(f" {NO_VERIFY_HINT}", "")
    return BundleRefused(e.where, problem + " (plow serve runs verified bundles only)")


def _serve_cmd(fail: Fail) -> Callable[..., None]:
    def serve(
        models: Annotated[
            list[Path],
            typer.Argument(
                help="Checkpoint directories or bundles (one model each; on --executor native a "
                "checkpoint is compiled once into a cached, verified bundle)."
            ),
        ],
        host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 8000,
        max_num_seqs: Annotated[
            int | None,
            typer.Option(
                "--max-num-seqs",
                min=1,
                help="Slots per model (max batch); default 8 for a checkpoint, the largest "
                "decode batch of a bundle's ladder (a larger value is an error).",
            ),
        ] = None,
        max_num_batched_tokens: Annotated[
            int,
            typer.Option("--max-num-batched-tokens", min=1, help="Token budget of one tick."),
        ] = 512,
        max_model_len: Annotated[
            int | None,
            typer.Option("--max-model-len", min=1, help="Context per slot (default: the model's)."),
        ] = None,
        served_model_name: Annotated[
            list[str] | None,
            typer.Option(
                "--served-model-name", help="Name per MODEL, in order (default: directory name)."
            ),
        ] = None,
        api_key: Annotated[
            str | None,
            typer.Option("--api-key", envvar="PLOW_API_KEY", help="Require `Bearer KEY` on /v1."),
        ] = None,
        seed: Annotated[
            int | None, typer.Option("--seed", help="Seed for requests that carry no seed.")
        ] = None,
        max_queue_wait: Annotated[
            float,
            typer.Option(
                "--max-queue-wait", min=0.0, help="Refuse (429) above this predicted wait, seconds."
            ),
        ] = 60.0,
        log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
        max_request_bytes: Annotated[
            int | None,
            typer.Option(
                "--max-request-bytes",
                min=1,
                help="Refuse (413) a request body larger than this (default 8 MiB, or "
                "$PLOW_MAX_REQUEST_BYTES).",
            ),
        ] = None,
        executor: Annotated[
            str,
            typer.Option(
                help="native (default: the C++ persistent kernel), cpu (the numpy emulator), "
                "cuda (an NVIDIA GPU) or reference (a checkpoint's per-op forward)."
            ),
        ] = "native",
        replicas: Annotated[
            int | None,
            typer.Option(
                min=1,
                help="Serve MODEL as this many engines of a Ray Serve deployment behind one "
                "endpoint, routed by prompt prefix (docs/serving.md, replicas).",
            ),
        ] = None,
        ray_address: Annotated[
            str | None,
            typer.Option("--ray", help="With --replicas: the Ray cluster (default: a local one)."),
        ] = None,
        threads: Annotated[
            int | None,
            typer.Option(
                min=1,
                help="Host threads per step (--executor native; default: the usable cores). "
                "On a machine other jobs load, 1 avoids waits on a descheduled worker.",
            ),
        ] = None,
        debug_ticks: Annotated[
            int,
            typer.Option(
                "--debug-ticks",
                min=0,
                help="Keep the last N engine ticks' records (batch, tokens, duration) for GET "
                "/debug/ticks (0: off).",
            ),
        ] = 0,
    ) -> None:
        """Serve models over an OpenAI-compatible HTTP API (docs/serving.md)."""
        from collections import deque

        from rich.console import Console

        from plow.bundle.open import BundleRefused
        from plow.serve.http import Server, load_served_model, run_server

        console = Console(stderr=True)
        if replicas is not None:  # N engines on Ray Serve (plow/serve/replicas.py)
            try:
                if len(models) != 1:
                    raise PlowError("--replicas", f"serves one model, got {len(models)}")
                from plow.serve import replicas as rp

                path = _model_dir(models[0])
                load = dict(
                    name=(served_model_name or [path.name])[0],
                    max_num_seqs=_slots(path, max_num_seqs),
                    max_num_batched_tokens=max_num_batched_tokens,
                    max_model_len=max_model_len,
                    max_queue_wait_s=max_queue_wait,
                    executor=executor,
                    threads=threads,
                )
                opts = dict(api_key=api_key, seed=seed, max_request_bytes=max_request_bytes)
                app_ = rp.build_app(path, replicas, load, opts)
            except BundleRefused as e:
                fail(verified_only(e))
            except PlowError as e:
                fail(e)
            url = f"http://{host}:{port}/v1"
            console.print(f"serving {replicas} replicas on {url}", highlight=False)
            rp.serve_replicas(app_, host, port, ray_address)
            return
        try:
            names = list(served_model_name or [])
            if len(names) > len(models):
                raise PlowError(
                    "--served-model-name", f"{len(names)} names for {len(models)} models"
                )
            slots = [_slots(_model_dir(path), max_num_seqs) for path in models]
            loaded = []
            for i, path in enumerate(models):
                name = names[i] if i < len(names) else _model_dir(path).name
                console.print(f"loading {path} as {name!r} ...", highlight=False)
                try:
                    m = load_served_model(
                        _model_dir(path),
                        name=name,
                        max_num_seqs=slots[i],
                        max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len,
                        max_queue_wait_s=max_queue_wait,
                        executor=executor,
                        threads=threads,
                        on_rung=lambda i, n, p: console.print(
                            f"  prepared rung {i + 1}/{n} ({p.label}) in {p.seconds:.2f} s",
                            highlight=False,
                        ),
                    )
                except BundleRefused as e:
                    raise verified_only(e) from e
                if m.engine.max_batch != slots[i]:
                    raise PlowError(
                        path, f"{slots[i]} slots asked, the engine runs {m.engine.max_batch}"
                    )
                adm = m.dispatcher.admission
                step = adm.model.step.tick_s(slots[i]) if adm is not None else 0.0
                console.print(
                    f"  {m.engine.kind} engine, {m.engine.max_batch} slots, context "
                    f"{m.max_context}, decode tick {step * 1e3:.2f} ms at full batch, prefill "
                    f"launch {m.dispatcher.fit.launch_rows:.1f} row-equivalents",
                    highlight=False,
                )
                if debug_ticks:
                    m.dispatcher.tick_log = deque(maxlen=debug_ticks)
                loaded.append(m)
            server = Server(loaded, api_key=api_key, seed=seed, max_request_bytes=max_request_bytes)
            console.print(f"serving on http://{host}:{port}/v1", highlight=False)
        except PlowError as e:
            fail(e)
        run_server(server.app(), host, port, log_level=log_level)

    return serve


def _calibrate_prefill_cmd(fail: Fail) -> Callable[..., None]:
    def prefill(
        model: Annotated[
            Path, typer.Argument(help="A checkpoint directory (or, later, a bundle).")
        ],
        out: Annotated[
            Path | None,
            typer.Option("-o", "--out", help="Fit JSON (default: <MODEL>/prefill_fit.json)."),
        ] = None,
        lengths: Annotated[
            str, typer.Option(help="Comma-separated prompt lengths of the sweep.")
        ] = "1,2,4,8,16,32,64,128",
        reps: Annotated[int, typer.Option(min=1, help="Timed repetitions per length.")] = 3,
    ) -> None:
        """Sweep prefill prompt lengths, fit `launch + per_row * rows`, store the fit."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        from rich.table import Table

        from plow.checkpoint import load_checkpoint
        from plow.runtime.executors import EXECUTORS
        from plow.serve.prefill_cost import fit_path, fit_prefill, sweep_prefill

        console = Console(stderr=True)
        try:
            try:
                sweep = sorted({int(x) for x in lengths.split(",") if x.strip()})
            except ValueError as e:
                raise PlowError("--lengths", f"expected comma-separated integers: {lengths}") from e
            if len(sweep) < 2 or sweep[0] < 1:
                raise PlowError("--lengths", "need at least two distinct lengths >= 1")
            ckpt = load_checkpoint(_model_dir(model))
            engine = EXECUTORS["reference"].open_engine(ckpt, max_batch=1)
            sweep = [n for n in sweep if n <= engine.max_context]
            if len(sweep) < 2:
                raise PlowError(
                    "--lengths", f"fewer than two lengths fit the context {engine.max_context}"
                )
            with Progress(
                TextColumn("prefill sweep"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.description}"), console=console,
            ) as progress:  # fmt: skip
                task = progress.add_task("", total=len(sweep))

                def on_point(n: int, s: float) -> None:
                    progress.update(task, advance=1, description=f"{n} rows: {s * 1e3:.2f} ms")

                points = sweep_prefill(engine, sweep, reps=reps, on_point=on_point)
            fit = fit_prefill(points, engine=engine.kind, model=str(model))
            dest = out or fit_path(model)
            try:
                fit.save(dest)
            except OSError as e:
                raise PlowError(dest, f"cannot write: {e.strerror or e}") from e
            table = Table(title="prefill sweep")
            for col in ("rows", "measured ms", "fit ms", "residual ms"):
                table.add_column(col, justify="right")
            for p in fit.points:
                table.add_row(
                    str(p.rows), f"{p.seconds * 1e3:.3f}",
                    f"{fit.seconds(p.rows) * 1e3:.3f}", f"{p.residual_s * 1e3:+.3f}",
                )  # fmt: skip
            console.print(table)
            console.print(
                f"wrote {dest}: launch {fit.launch_s * 1e3:.3f} ms + "
                f"{fit.per_row_s * 1e6:.2f} us/row "
                f"= {fit.launch_rows:.1f} row-equivalents per launch; R^2 {fit.r2:.4f}, "
                f"max |residual| {fit.max_abs_residual_s * 1e3:.3f} ms, "
                f"relative RMS residual {fit.rel_rms_residual:.1%}",
                highlight=False,
            )
        except PlowError as e:
            fail(e)

    return prefill


def register(app: typer.Typer, fail: Fail) -> None:
    """Add `serve`, and `prefill` to the `calibrate` group (created if absent)."""
    app.command(name="serve")(_serve_cmd(fail))
    group = calibrate_group(app)
    group.command(name="prefill")(_calibrate_prefill_cmd(fail))
