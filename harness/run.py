"""`run_study`: the fixed order of a study — (a) compile with certificates, (b) correctness
gate, (c) performance surfaces, (d) publish. Used by `plow eval`."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from harness import measure
from harness.compile_step import CompiledStudy, CompileRejected, compile_study, measured_positions
from harness.environment import blas_threads, calibrate, environment
from harness.executors import ExecutorUnavailable, get_executor
from harness.gate import PromptResult, run_gate
from harness.models import resolve_model
from harness.publish import (
    new_run_dir,
    plot_decode,
    plot_throughput,
    regenerate_index,
    results_root,
    write_json,
    write_metrics,
)
from harness.report import RunInfo, headline, render
from harness.serving import dispatcher_overhead
from harness.workload import Workload, load_workload
from plow.checkpoint import Checkpoint, load_checkpoint
from plow.errors import ConfigError


@dataclass(frozen=True)
class Outcome:
    exit_code: int  # 0 published with a passed gate, 1 compile rejected or gate failed
    run_dir: Path | None
    message: str


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def _prompts(wl: Workload, ckpt: Checkpoint) -> list[tuple[str | None, list[int]]]:
    if wl.prompts is not None:
        out: list[tuple[str | None, list[int]]] = []
        for i, text in enumerate(wl.prompts):
            ids = ckpt.tokenizer.encode(text)
            if not ids:
                raise ConfigError(f"field 'prompts.{i}'", "tokenizes to zero tokens")
            out.append((text, ids))
        return out
    assert wl.prompt_lengths is not None
    pl = wl.prompt_lengths
    rng = np.random.default_rng(wl.seeds[0])
    lengths = rng.integers(pl.min, pl.max + 1, size=pl.count)
    return [
        (None, measure.filler(ckpt.spec.vocab_size, int(n), wl.seeds[0] + i))
        for i, n in enumerate(lengths)
    ]


def _check_fits(wl: Workload, ckpt: Checkpoint, prompts: list[tuple[str | None, list[int]]]) -> int:
    """The runner's context: what the study needs, within the model's positions."""
    limit = ckpt.spec.max_position
    need_decode = wl.context_lengths[-1] + measured_positions(wl)
    if need_decode > limit:
        raise ConfigError(
            "field 'context_lengths'",
            f"{wl.context_lengths[-1]} + {measured_positions(wl)} measured steps exceeds the "
            f"model's {limit} positions",
        )
    longest = max(len(ids) for _, ids in prompts)
    need_gate = longest + max(wl.gate.new_tokens, wl.measure.serving_tokens) + 1
    if need_gate > limit:
        raise ConfigError(
            "field 'gate.new_tokens'",
            f"longest prompt {longest} + new tokens exceeds {limit} positions",
        )
    return max(need_decode, need_gate)


def run_study(
    arg: str | Path | None,
    *,
    executor: str | None = None,
    console: Console | None = None,
    root: Path | None = None,
) -> Outcome:
    """Run a study end to end. Input problems raise `PlowError` (exit 2) before anything is
    published; a compile rejection or a failed gate publishes and returns exit code 1."""
    wl, source = load_workload(arg)
    with blas_threads(wl.measure.blas_threads) as blas:
        return _run_study(wl, source, blas, executor=executor, console=console, root=root)


def _run_study(
    wl: Workload,
    source: str,
    blas: str | None,
    *,
    executor: str | None,
    console: Console | None,
    root: Path | None,
) -> Outcome:
    console = console or Console(stderr=True)
    t_start = time.perf_counter()
    if executor is not None and executor != wl.executor:
        wl = wl.model_copy(update={"executor": executor})
    try:  # no GPU / not built: one line, exit 2, before any work
        ex = get_executor(wl.executor)
    except ExecutorUnavailable as e:
        raise ExecutorUnavailable(f"{source}: {e.where}", e.problem) from e
    if wl.tp_degree != 1:
        raise ConfigError(
            f"{source}: field 'tp_degree'",
            f"executor {ex.name} runs on one device (tp_degree {wl.tp_degree})",
        )
    if ex.name == "reference" and wl.precision != "fp32":
        raise ConfigError(f"{source}: field 'precision'", "the reference executor computes in fp32")

    console.rule(
        f"[bold]plow eval[/]: study [cyan]{wl.study}[/] ({source}) on executor [cyan]{ex.name}[/]"
    )
    env = environment()
    if blas is not None:
        env = env.model_copy(update={"blas_threads": blas})
    load_avg = os.getloadavg() if hasattr(os, "getloadavg") else None
    if wl.measure.calibrate:
        with console.status("calibrating this machine (memory bandwidth, fp32 matmul)"):
            env = env.model_copy(update={"calibration": calibrate()})
        assert env.calibration is not None
        console.print(
            f"calibration: {env.calibration.bandwidth_bytes_per_s / 1e9:.3g} GB/s copy, "
            f"{env.calibration.matmul_flops_per_s / 1e9:.3g} GFLOP/s fp32 GEMM"
        )

    model_dir = resolve_model(wl.model, "model")
    ref_dir = resolve_model(wl.reference, "reference_model") if wl.reference_model else model_dir
    ckpt = load_checkpoint(model_dir)
    prompts = _prompts(wl, ckpt)
    max_context = _check_fits(wl, ckpt, prompts)
    info = RunInfo(
        run="",
        source=source,
        workload=wl,
        env=env,
        model_label=wl.model.label,
        model_path=str(model_dir),
        reference_path=str(ref_dir),
        parameters=ckpt.spec.parameter_count(),
        executor=ex.name,
        executor_description=ex.description,
        load_average=load_avg,
    )
    out_root = root or results_root()

    def publish(exit_code: int, message: str) -> Outcome:
        run_dir = new_run_dir(out_root, wl.study, env.git.short)
        info.run = run_dir.name
        info.seconds = time.perf_counter() - t_start
        passed = info.gate is not None and info.gate.passed
        if passed and info.metrics:
            write_metrics(run_dir / "metrics.csv", info.metrics)
            title = f"{wl.study}: {wl.model.label}, executor {ex.name}"
            if plot_decode(run_dir / "decode_latency.png", info.metrics, title):
                info.plots.append("decode_latency.png")
            if plot_throughput(run_dir / "decode_throughput.png", info.metrics, title):
                info.plots.append("decode_throughput.png")
        write_json(
            run_dir / "workload.json",
            {
                "run": run_dir.name,
                "source": source,
                "workload": wl.model_dump(mode="json"),
                "model_label": wl.model.label,
                "model_path": str(model_dir),
                "reference_model_path": str(ref_dir),
                "parameters": info.parameters,
                "executor": {"name": ex.name, "description": ex.description},
                "environment": env.model_dump(mode="json"),
                "load_average_at_start": list(load_avg) if load_avg else None,
                "headline": headline(info),
            },
        )
        if info.compile is not None:
            write_json(run_dir / "compile.json", info.compile)
        if info.gate is not None:
            write_json(run_dir / "gate.json", info.gate)
        (run_dir / "report.md").write_text(render(info), encoding="utf-8")
        regenerate_index(out_root)
        return Outcome(exit_code, run_dir, message)

    # (a) compile with certificates
    n_bundles = len({c + measured_positions(wl) for c in wl.context_lengths} | {max_context})
    compiled: CompiledStudy | None = None
    with _progress(console) as prog:
        task = prog.add_task("compile + certify (A-F)", total=None, detail="")
        try:
            compiled = compile_study(
                model_dir,
                wl,
                env.calibration,
                kv_contexts=[max_context],
                on_stage=lambda what: prog.update(task, detail=what),
            )
        except CompileRejected as e:
            info.compile = e.report
            out = publish(1, f"compile rejected: {e}")
            console.print(f"[bold red]compile rejected[/]: {e.problem}")
            return out
        info.compile = compiled.report
        prog.update(
            task,
            total=1,
            completed=1,
            detail=f"{len(compiled.report.buckets)} buckets in {n_bundles} bundles accepted",
        )

    # (b) correctness gate
    runner = ex.open(ckpt, max_batch=wl.batch_sizes[-1], max_context=max_context, compiled=compiled)
    shown: list[PromptResult] = []

    def show(r: PromptResult) -> None:
        shown.append(r)
        prog.update(gtask, advance=1)
        if len(shown) == 1:
            prompt = r.prompt if r.prompt is not None else f"<{len(r.prompt_ids)} random ids>"
            text = r.executor_text.replace("\n", "\\n")
            prog.console.print(Text.assemble((prompt, "bold"), (text, "green")))
            prog.console.print(
                f"  ({ex.name} executor, greedy; transformers "
                f"{'agrees' if r.tokens_match else 'DISAGREES'})"
            )

    with _progress(console) as prog:
        gtask = prog.add_task("correctness gate", total=len(prompts), detail="vs transformers")
        info.gate = run_gate(runner, ref_dir, prompts, wl.gate, ckpt.tokenizer.decode, show)
    for ch in info.gate.checks:
        mark = "[green]pass[/]" if ch.passed else "[bold red]FAIL[/]"
        console.print(f"  {ch.name}: {ch.value:.4g} ({ch.tolerance}) {mark}")
    if not info.gate.passed:
        out = publish(1, f"correctness gate {info.gate.reason}; no performance data published")
        console.print(
            f"[bold red]gate FAILED[/]: performance not measured; published {out.run_dir}"
        )
        return out

    # (c) performance, one surface at a time
    ms = wl.measure
    total = len(wl.context_lengths) * len(wl.batch_sizes) * (1 + ms.warmup_steps + ms.decode_steps)
    with _progress(console) as prog:
        rt = prog.add_task("raw decode steps", total=total, detail="")
        info.metrics += measure.decode_sweep(
            lambda ctx: ex.open(
                ckpt,
                max_batch=wl.batch_sizes[-1],
                max_context=ctx + measured_positions(wl),
                compiled=compiled,
            ),
            ckpt.spec.vocab_size,
            wl.context_lengths,
            wl.batch_sizes,
            ms.warmup_steps,
            ms.decode_steps,
            wl.seeds[0],
            on_step=lambda d: prog.update(rt, advance=1, detail=d),
        )
        for other in wl.compare_executors:
            if other == ex.name:
                continue
            ox = get_executor(other)
            ct = prog.add_task(f"raw decode steps on {other}", total=total, detail="")
            info.metrics += [
                dataclasses.replace(m, surface="compare")
                for m in measure.decode_sweep(
                    lambda ctx, ox=ox: ox.open(  # type: ignore[misc]
                        ckpt,
                        max_batch=wl.batch_sizes[-1],
                        max_context=ctx + measured_positions(wl),
                        compiled=compiled,
                    ),
                    ckpt.spec.vocab_size,
                    wl.context_lengths,
                    wl.batch_sizes,
                    ms.warmup_steps,
                    ms.decode_steps,
                    wl.seeds[0],
                    on_step=lambda d, ct=ct: prog.update(ct, advance=1, detail=d),  # type: ignore[misc]
                )
                if m.surface == "raw"
            ]
        st = prog.add_task("serving, cold start, e2e", total=4, detail="serving loop")
        first_ids = prompts[0][1]
        info.metrics += measure.serving_overhead(
            runner, first_ids, ms.serving_tokens, ckpt.tokenizer.decode, ckpt.spec.eos_token_ids
        )
        prog.update(st, advance=1, detail="dispatcher")
        engine = ex.serving_engine(ckpt, max_batch=1, max_context=max_context, compiled=compiled)
        if engine is not None:
            info.metrics += dispatcher_overhead(
                engine, [ids for _, ids in prompts], ms.serving_tokens, ckpt.tokenizer.decode,
                ex.name,
            )  # fmt: skip
        prog.update(st, advance=1, detail="cold start")
        cold, _ = measure.cold_start(ex, str(model_dir), first_ids, max_context, compiled)
        info.metrics += cold
        prog.update(st, advance=1, detail="end to end")
        info.metrics += measure.end_to_end(
            runner, prompts, ms.serving_tokens, ckpt.tokenizer.encode, ckpt.tokenizer.decode
        )
        prog.update(st, advance=1, detail="done")

    # (d) publish
    out = publish(0, "published")
    _summary(console, info, out.run_dir)
    return out


def _summary(console: Console, info: RunInfo, run_dir: Path | None) -> None:
    from harness.report import find, growth

    wl = info.workload
    t = Table(title=f"{wl.study}: per-token decode latency, executor {info.executor}")
    t.add_column("context", justify="right")
    for b in wl.batch_sizes:
        t.add_column(f"batch {b} ms/token", justify="right")
    for ctx in wl.context_lengths:
        row = [str(ctx)]
        for b in wl.batch_sizes:
            m = find(info.metrics, "raw", "decode_step_ms", ctx, b)
            row.append(f"{m.value:.1f}" if m else "")
        t.add_row(*row)
    growth_row = ["growth"]
    for b in wl.batch_sizes:
        g = growth(info.metrics, b)
        growth_row.append(f"{g.value:.2f}x" if g else "")
    t.add_row(*growth_row, style="bold")
    console.print(t)
    extra = Table(show_header=False, box=None)
    for surface, metric, label in [
        ("serving", "dispatcher_overhead_pct", "serving overhead (dispatcher vs engine calls)"),
        ("serving", "overhead_pct", "serving loop overhead (harness loop vs raw step)"),
        ("cold_start", "load_to_first_token_ms", "cold start: load to first token"),
        ("e2e", "request_ms", "end to end: one request"),
    ]:
        m = find(info.metrics, surface, metric)
        if m:
            extra.add_row(label, f"{m.value:.3g} {m.unit}")
    host = [m.value for m in info.metrics if m.surface == "host"]
    if host:
        extra.add_row(
            "host utilisation (CPU time / wall)", f"{min(host):.2f}-{max(host):.2f} cores"
        )
    extra.add_row("gate", "passed" if info.gate and info.gate.passed else "FAILED")
    extra.add_row("results", str(run_dir))
    console.print(extra)
