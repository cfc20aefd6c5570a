"""`report.md` of a run: what ran, the certificates, the gate, the surfaces, the Limits."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from harness.compile_step import CHECKPOINTS, CompileReport
from harness.environment import Environment
from harness.gate import GateReport
from harness.measure import Metric
from harness.workload import Workload


@dataclass
class RunInfo:
    run: str
    source: str
    workload: Workload
    env: Environment
    model_label: str
    model_path: str
    reference_path: str
    parameters: int
    executor: str
    executor_description: str
    load_average: tuple[float, float, float] | None
    compile: CompileReport | None = None
    gate: GateReport | None = None
    metrics: list[Metric] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _fmt(v: float | None, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return ""
    return f"{v:.{digits}g}"


def find(
    metrics: list[Metric],
    surface: str,
    metric: str,
    context: int | None = None,
    batch: int | None = None,
) -> Metric | None:
    for m in metrics:
        if (
            m.surface == surface
            and m.metric == metric
            and (context is None or m.context == context)
            and (batch is None or m.batch == batch)
        ):
            return m
    return None


def growth(metrics: list[Metric], batch: int) -> Metric | None:
    return next(
        (m for m in metrics if m.metric.startswith("growth_ratio") and m.batch == batch), None
    )


def headline(info: RunInfo) -> str:
    if info.gate is None:
        return "compile rejected" if info.compile and not info.compile.accepted else ""
    if not info.gate.passed:
        return "gate failed: no performance data"
    wl = info.workload
    c0, c1 = wl.context_lengths[0], wl.context_lengths[-1]
    b = wl.batch_sizes[0]
    a = find(info.metrics, "raw", "decode_step_ms", c0, b)
    z = find(info.metrics, "raw", "decode_step_ms", c1, b)
    if a is None or z is None:
        return ""
    return (
        f"batch {b}: {a.value:.1f} ms/token at {c0} -> {z.value:.1f} ms at {c1} "
        f"({z.value / a.value:.2f}x)"
    )


def limits(info: RunInfo) -> list[str]:
    wl = info.workload
    out: list[str] = []
    if info.executor == "reference":
        out.append(
            "**Executor: `reference`** — the plain numpy per-op forward, not the compiled plan: "
            "these numbers measure the reference path on this machine, not plow's execution "
            "path; the certificates above are for the plans the compiled executor (`cpu`) runs."
        )
        out.append(
            "Untuned path: the reference runs the rows of a batch one after another (a batch of "
            "4 costs about 4 single-row steps), reads every weight through a memory map and "
            "converts it to fp32 on every step, and uses numpy's default BLAS threading."
        )
    else:
        out.append(f"Executor: `{info.executor}` ({info.executor_description}).")
    if info.executor == "cpu":
        out.append(
            "Plan provenance: the CPU executor ran the certified decode and prefill plans "
            "loaded from the certified bundle files on disk (`plow.runtime.cpu.bundle`: file "
            "hashes and the B-F certificates checked at load, the plan file's packet stream and "
            "the bundle's arena offsets), so every step ran exactly what the oracle certified; "
            "nothing was planned in memory. The bundles are plan-only (no weights copied); "
            "weights come from the checkpoint, checked against the bundles' op tables (names "
            "and shapes)."
        )
    if info.executor != "reference":
        usage = info.compile.launches if info.compile is not None else {}
        if usage:
            cert = {k: u.launches for k, u in usage.items() if u.certified}
            unc = {k: u.launches for k, u in usage.items() if not u.certified}
            text = (
                "Rungs that ran (launches; each loaded from its certified bundle file): "
                + ", ".join(f"`{k}` x{n}" for k, n in sorted(cert.items()))
                + "."
            )
            if unc:
                text += (
                    " Launches on plans outside the study's certified compile: "
                    + ", ".join(f"`{k}` x{n}" for k, n in sorted(unc.items()))
                    + "."
                )
            out.append(text)
    if info.executor == "cpu":
        out.append(
            "Untuned path: the CPU executor emulates the persistent kernel — every task of the "
            "packet stream is dispatched from Python onto numpy tile kernels over virtual "
            "workers, one at a time (round-robin), with counters as the only synchronisation; "
            "its step time measures that emulation on this CPU (dominated by per-task dispatch), "
            "not a native kernel. Prefill runs the same way and is slow for long contexts."
        )
    if info.compile is not None and info.gate is not None and info.gate.passed:
        b0, c0 = wl.batch_sizes[0], wl.context_lengths[0]
        bound = info.compile.bound_ms(b0, c0)
        m = find(info.metrics, "raw", "decode_step_ms", c0, b0)
        if bound and m:
            out.append(
                f"Against the plan's own floor: the checkpoint B lower bound for batch {b0} at "
                f"context {c0} is {bound:.3g} ms per step on the "
                f"{'calibrated ' if info.compile.target_calibrated else ''}`{info.compile.target}` "
                f"target; the measured step is {m.value / bound:.3g}x that."
            )
    spreads = [
        m.spread
        for m in info.metrics
        if m.surface == "raw" and m.metric == "decode_step_ms" and m.spread is not None
    ]
    la = info.load_average
    noise = (
        f"Noise: each decode point is the best of {wl.measure.decode_steps} steps after "
        f"{wl.measure.warmup_steps} warm-up step(s) (the median is in metrics.csv as "
        "decode_step_median_ms); the (p90 - p10)/median spread of the steps is "
        f"{np.median(spreads):.0%} typical, {max(spreads):.0%} worst in this run. Differences "
        "smaller than the worst spread are not resolved by this run."
        if spreads
        else "Noise: no performance data in this run."
    )
    if la is not None:
        noise += (
            f" Load average when the run started: {la[0]:.2f} on {info.env.cpu_count} cores"
            + (" — other processes shared the machine." if la[0] > 0.5 else ".")
        )
    out.append(noise)
    out.append(
        f"Machine: {info.env.cpu_model}, {info.env.cpu_count} cores"
        + f"; BLAS threads: {info.env.blas_threads or 'the library default'}"
        + (f", GPU {info.env.gpu_model}" if info.env.gpu_model else ", no GPU")
        + (
            f"; calibrated this run at {info.env.calibration.bandwidth_bytes_per_s / 1e9:.3g} GB/s "
            f"copy bandwidth and {info.env.calibration.matmul_flops_per_s / 1e9:.3g} GFLOP/s fp32 "
            "GEMM"
            if info.env.calibration
            else ""
        )
        + ". One machine, one run: no run-to-run variance across machines is stated."
    )
    out.append(
        "Not measured: prefill throughput (prefills only position the cache); concurrent "
        "requests and continuous batching under load, and the HTTP/SSE path (the serving "
        "surface is the `plow.serve` dispatcher in this process, one request at a time, plus the "
        "harness's own sampling/detokenising loop); tensor "
        f"parallelism (tp = {wl.tp_degree}); precisions other than {wl.precision}; memory use; "
        "energy; GPUs."
    )
    out.append(
        "Workload shortcuts: a decode point starts from seeded random token ids filling the "
        "context, and every row of a batch holds the same prompt (its prefill is computed once: "
        "the reference copies the key-value cache, the CPU executor's prefix cache shares it); "
        "decode steps compute every row. Cold start is measured "
        "in this process with the checkpoint already in the OS page cache (no interpreter "
        "start-up, imports or disk reads)."
    )
    out.append(
        "Context range: the growth ratio here spans "
        f"{wl.context_lengths[0]} -> {wl.context_lengths[-1]} tokens on a CPU; the seed's "
        "published decode study spans 1k -> 128k on accelerators (Plow 1.40-1.52x on "
        "8x MI350X, 1.9-2.9x for the vLLM configurations tested), so the two are not comparable."
    )
    return out


def render(info: RunInfo) -> str:
    wl = info.workload
    gate = info.gate
    env = info.env
    verdict = (
        "compile rejected"
        if info.compile is not None and not info.compile.accepted
        else "not reached"
        if gate is None
        else "PASSED"
        if gate.passed
        else "FAILED"
    )
    L: list[str] = [f"# {wl.study} — {info.run}", ""]
    if wl.description:
        L += [wl.description, ""]
    L += [
        f"- **Executor:** `{info.executor}` — {info.executor_description}",
        f"- **Model:** {info.model_label} (`{info.model_path}`), "
        f"{info.parameters / 1e6:.1f}M parameters, {wl.precision}",
        f"- **Gate:** {verdict}",
        f"- **Target:** `{wl.target}`, tp = {wl.tp_degree}; contexts {wl.context_lengths}, "
        f"batches {wl.batch_sizes}, seeds {wl.seeds}",
        f"- **Software:** python {env.python}, "
        + ", ".join(f"{k} {v}" for k, v in env.packages.items() if v)
        + f"; git {env.git.commit or 'unknown'}{' (dirty tree)' if env.git.dirty else ''}",
        f"- **Workload file:** `{info.source}`; run took {info.seconds:.0f} s",
        "",
    ]
    if info.compile is not None:
        c = info.compile
        L += [
            "## Compile and certificates",
            "",
            f"Pipeline: {c.pipeline}. Target `{c.target}` "
            f"({'calibrated this run: ' if c.target_calibrated else ''}"
            f"{c.target_bandwidth_bytes_per_s / 1e9:.3g} GB/s, "
            f"{c.target_peak_flops_per_s / 1e9:.3g} GFLOP/s); step budget: {c.budget_rule}; "
            f"{c.seconds:.1f} s.",
            "",
            "| bucket | context | tiles | tasks | estimate (ms) | bandwidth bound (ms) "
            "| compute bound (ms) | budget (ms) | " + " | ".join(CHECKPOINTS) + " |",
            "| --- |" * 1 + " --- |" * (7 + len(CHECKPOINTS)),
        ]
        for bk in c.buckets:
            cells = []
            for ck in CHECKPOINTS:
                row = bk.check(ck)
                cells.append(row.verdict if row else ("" if not bk.rejected else "-"))
            L.append(
                f"| {bk.bucket} | {bk.context if bk.context is not None else 'gate'} | "
                f"{bk.tiles} | {bk.tasks if bk.tasks is not None else ''} | "
                f"{_fmt(bk.estimated_ms)} | {_fmt(bk.bandwidth_bound_ms)} | "
                f"{_fmt(bk.compute_bound_ms)} | {_fmt(bk.budget_ms)} | " + " | ".join(cells) + " |"
            )
        rejected = [bk.rejected for bk in c.buckets if bk.rejected]
        if not c.accepted:
            L += ["", f"**Rejected:** {c.reason or (rejected[0] if rejected else '')}"]
        by_ck = c.theorems_by_checkpoint()
        if by_ck:
            L += ["", "Theorems whose hypotheses the oracle established, per checkpoint:", ""]
            for ck in CHECKPOINTS:
                if by_ck.get(ck):
                    L.append(f"- {ck}: " + ", ".join(f"`{t}`" for t in by_ck[ck]))
        if c.bundles:
            L += ["", "Bundles (plan-only; certificates in `certificates/`):", ""]
            for bd in c.bundles:
                L.append(
                    f"- `{bd.path}` — {', '.join(bd.buckets)}; manifest sha256 "
                    f"`{(bd.manifest_sha256 or '')[:16]}`; {bd.check}"
                )
        L.append("")
    if gate is not None:
        L += [
            "## Correctness gate",
            "",
            f"Against {gate.reference} on `{gate.reference_model}`; {gate.new_tokens} greedy "
            "tokens per prompt (end-of-sequence does not stop), then the executor's sequence "
            "scored teacher-forced.",
            "",
            "| check | value | tolerance | result |",
            "| --- | --- | --- | --- |",
        ]
        for ch in gate.checks:
            L.append(
                f"| {ch.name} | {ch.value:.4g} | {ch.tolerance} | "
                f"{'pass' if ch.passed else 'FAIL'} |"
            )
        L += [
            "",
            "| prompt | executor output | tokens match | max abs delta logprob | top-1 agreement |",
            "| --- | --- | --- | --- | --- |",
        ]
        for p in gate.prompts:
            shown = p.prompt if p.prompt is not None else f"{len(p.prompt_ids)} random ids"
            mm = "yes" if p.tokens_match else f"no (first at {p.first_mismatch})"
            out = p.executor_text.replace("|", "\\|").replace("\n", "\\n")
            shown = shown.replace("|", "\\|").replace("\n", "\\n")
            L.append(
                f"| {shown} | {out} | {mm} | {p.max_abs_logprob_delta:.3g} | "
                f"{p.top1_agreement:.3g} |"
            )
        L.append("")
        if not gate.passed:
            L += [
                "**The gate failed: no performance numbers were published for this run** "
                "(no `metrics.csv`, no plots). " + (gate.reason or ""),
                "",
            ]
    if gate is not None and gate.passed and info.metrics:
        L += [
            "## Performance",
            "",
            "### Raw execution: decode step time",
            "",
            "Per-token latency is the step time (every row gets one token per step): the best "
            f"of {wl.measure.decode_steps} steps, with the p10-p90 of all steps.",
            "",
            "| context | "
            + " | ".join(f"batch {b} ms/token (p10-p90)" for b in wl.batch_sizes)
            + " | "
            + " | ".join(f"batch {b} tok/s" for b in wl.batch_sizes)
            + " |",
            "| --- |" + " --- |" * (2 * len(wl.batch_sizes)),
        ]
        for ctx in wl.context_lengths:
            cells = []
            for b in wl.batch_sizes:
                m = find(info.metrics, "raw", "decode_step_ms", ctx, b)
                cells.append(f"{m.value:.1f} ({_fmt(m.p10)}-{_fmt(m.p90)})" if m else "")
            for b in wl.batch_sizes:
                m = find(info.metrics, "raw", "tokens_per_s", ctx, b)
                cells.append(f"{m.value:.2f}" if m else "")
            L.append(f"| {ctx} | " + " | ".join(cells) + " |")
        L.append("")
        for b in wl.batch_sizes:
            g = growth(info.metrics, b)
            if g:
                L.append(
                    f"- Growth from context {wl.context_lengths[0]} to "
                    f"{wl.context_lengths[-1]}, batch {b}: **{g.value:.2f}x**"
                )
        compare = [
            m for m in info.metrics if m.surface == "compare" and m.metric == "decode_step_ms"
        ]
        for other in dict.fromkeys(m.executor for m in compare):
            L += [
                "",
                f"### Beside the `{other}` executor (same run, same bundles)",
                "",
                "| context | "
                + " | ".join(
                    f"batch {b}: {info.executor} / {other} ms (ratio)" for b in wl.batch_sizes
                )
                + " |",
                "| --- |" + " --- |" * len(wl.batch_sizes),
            ]
            for ctx in wl.context_lengths:
                cells = []
                for b in wl.batch_sizes:
                    mine = find(info.metrics, "raw", "decode_step_ms", ctx, b)
                    theirs = next(
                        (m for m in compare if m.executor == other and m.context == ctx
                         and m.batch == b), None,
                    )  # fmt: skip
                    cells.append(
                        f"{mine.value:.1f} / {theirs.value:.1f} ({theirs.value / mine.value:.1f}x)"
                        if mine and theirs and mine.value > 0
                        else ""
                    )
                L.append(f"| {ctx} | " + " | ".join(cells) + " |")
        L += [
            "",
            "### Host utilisation",
            "",
            "Process CPU time / wall time during the timed steps (1.0 = one core busy).",
            "",
            "| context | " + " | ".join(f"batch {b}" for b in wl.batch_sizes) + " |",
            "| --- |" + " --- |" * len(wl.batch_sizes),
        ]
        for ctx in wl.context_lengths:
            cells = []
            for b in wl.batch_sizes:
                m = find(info.metrics, "host", "cpu_time_per_wall", ctx, b)
                cells.append(f"{m.value:.2f}" if m else "")
            L.append(f"| {ctx} | " + " | ".join(cells) + " |")
        L += [
            "",
            "### Serving overhead, cold start, end to end",
            "",
            "| surface | metric | value | unit | samples | spread |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for m in info.metrics:
            if m.surface in ("serving", "cold_start", "e2e"):
                L.append(
                    f"| {m.surface} | {m.metric} | {m.value:.4g} | {m.unit} | {m.samples} | "
                    f"{'' if m.spread is None else f'{m.spread:.0%}'} |"
                )
        L.append("")
        if info.plots:
            L += ["## Plots", ""] + [f"![{p}]({p})" for p in info.plots] + [""]
    L += ["## Limits", ""] + [f"- {x}" for x in limits(info)] + [""]
    return "\n".join(L)
