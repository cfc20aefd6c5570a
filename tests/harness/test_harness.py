"""The harness end to end on a tiny fixture checkpoint (on the compiled CPU executor): publish
on a passed gate with certificates B-F per bucket, no performance data on a failed one, a stop
on a rejected plan (a bound or an oracle verdict), checkpoints checked in Python reported as
such, one-line workload errors, and the GPU workloads' no-GPU stop."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from rich.console import Console
from typer.testing import CliRunner

from harness.compile_step import CHECKPOINTS, compile_study
from harness.environment import _openblas
from harness.executors import EXECUTORS, ExecutorUnavailable, get_executor
from harness.measure import METRIC_COLUMNS
from harness.publish import regenerate_index
from harness.run import run_study
from harness.workload import load_workload, parse_workload, shipped_workloads
from plow.checkpoint import load_checkpoint
from plow.checkpoint.weights import read_header
from plow.errors import ConfigError, PlowError
from plow.graph import Bucket
from plow.oracle import Certificate
from plow.oracle.models import Verdict
from plow.testing import make_tiny_checkpoint

CONTEXTS = [8, 32]
BATCHES = [1, 2]


def _workload(path: Path, model: Path, **extra: object) -> Path:
    body: dict[str, object] = {
        "study": "tiny",
        "model": {"path": str(model)},
        "executor": "cpu",
        "context_lengths": CONTEXTS,
        "batch_sizes": BATCHES,
        "prompts": ["the quick brown fox", "a b c"],
        "gate": {"new_tokens": 6, "max_abs_logprob_delta": 1e-4},
        "measure": {
            "warmup_steps": 1,
            "decode_steps": 2,
            "serving_tokens": 3,
            "calibrate": False,
            "blas_threads": 1,
        },
    }
    body.update(extra)
    path.write_text(json.dumps(body))  # JSON is YAML
    return path


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=120)


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory) -> object:
    """Bundles (and anything else cached) go to a temporary cache, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLOW_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("llama", 0, tmp_path_factory.mktemp("harness") / "llama")


@pytest.fixture(scope="module")
def passed_run(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, Path]:
    root = tmp_path_factory.mktemp("results")
    (root / "benchmarks").mkdir()  # someone else's results: the index must keep listing them
    wl = _workload(tmp_path_factory.mktemp("wl") / "tiny.yaml", ckpt)
    out = run_study(wl, console=_quiet(), root=root)
    assert out.run_dir is not None
    return out.exit_code, out.run_dir, root


def test_passed_gate_publishes_everything(passed_run: tuple[int, Path, Path]) -> None:
    code, run_dir, root = passed_run
    assert code == 0
    assert run_dir.parent == root / "tiny"
    names = {p.name for p in run_dir.iterdir()}
    assert {"workload.json", "compile.json", "gate.json", "metrics.csv", "report.md"} <= names
    gate = json.loads((run_dir / "gate.json").read_text())
    assert gate["passed"] is True
    assert all(p["tokens_match"] for p in gate["prompts"])
    wl = json.loads((run_dir / "workload.json").read_text())
    assert wl["environment"]["packages"]["numpy"] == np.__version__
    assert wl["executor"]["name"] == "cpu"
    found = _openblas()
    if found is not None:  # numpy's OpenBLAS: limited for the study, restored after it
        rec = wl["environment"]["blas_threads"]
        assert rec.startswith("1 (set by the workload")
        assert rec.endswith(f", was {int(found[1]())})")  # the previous count is back


def test_compile_json_has_oracle_certificates_b_to_f(passed_run: tuple[int, Path, Path]) -> None:
    _, run_dir, _ = passed_run
    compiled = json.loads((run_dir / "compile.json").read_text())
    assert compiled["accepted"] and "python_checked" not in compiled
    extra = 1 + 2 + 1  # warm-up + decode steps + 1
    decode_rungs = [b for b in compiled["buckets"] if b["phase"] == "decode"]
    assert sorted((b["batch"], b["kv_positions"]) for b in decode_rungs) == sorted(
        (b, c + extra) for c in CONTEXTS for b in BATCHES
    )
    # the prefill rungs the study's prefills need: every batch size (and 1) x the prompt's
    # length, here at most the 64-token chunk, certified by the same checkpoints
    prefill_rungs = [b for b in compiled["buckets"] if b["phase"] == "prefill"]
    assert sorted((b["batch"], b["seq"], b["kv_positions"]) for b in prefill_rungs) == sorted(
        (b, min(c, 64), c + extra) for c in CONTEXTS for b in {1, *BATCHES}
    )
    for b in compiled["buckets"]:
        rows = {c["checkpoint"]: c for c in b["checks"]}
        assert sorted(rows) == list(CHECKPOINTS), b["bucket"]
        for ck, row in rows.items():
            assert row["verdict"] == "accept" and "checked_by" not in row, (b["bucket"], ck)
            assert row["theorems"] and len(row["payload_sha256"]) == 64
        assert b["tasks"] > 0 and b["bandwidth_bound_ms"] > 0
    # one verified bundle per key-value context, its certificates written next to its plans
    assert len(compiled["bundles"]) == len(CONTEXTS)
    for bd in compiled["bundles"]:
        path = Path(bd["path"])
        assert (path / "manifest.json").is_file() and bd["accepted"]
        for ck in CHECKPOINTS:
            doc = json.loads((path / "certificates" / f"{ck}.json").read_text())
            assert doc["accepted"] and set(doc["buckets"]) == set(bd["buckets"])
    # every step, decode and prefill, ran a certified plan loaded from its bundle file on
    # disk: nothing was planned in memory outside step (a)
    launches = compiled["launches"]
    decode = {k: v for k, v in launches.items() if k.startswith("decode")}
    prefill = {k: v for k, v in launches.items() if k.startswith("prefill")}
    assert decode and prefill and set(launches) == set(decode) | set(prefill)
    home = {b: bd["path"] for bd in compiled["bundles"] for b in bd["buckets"]}
    for k, v in launches.items():
        assert v["certified"] and v["from_bundle"] == v["launches"] and v["bundle"] == home[k], k
    assert sum(v["launches"] for v in decode.values()) >= len(CONTEXTS) * len(BATCHES) * 3
    assert any(b["batch"] == 2 for b in prefill_rungs if b["bucket"] in prefill)
    report = (run_dir / "report.md").read_text()
    assert "| B | C | D | E | F |" in report and "Plow.Countersproof" in report


def test_metrics_csv_has_every_surface(passed_run: tuple[int, Path, Path]) -> None:
    _, run_dir, _ = passed_run
    df = pd.read_csv(run_dir / "metrics.csv")
    assert list(df.columns) == METRIC_COLUMNS
    assert {"raw", "host", "serving", "cold_start", "e2e"} <= set(df["surface"])
    steps = df[df["metric"] == "decode_step_ms"]
    assert sorted(zip(steps["context"], steps["batch"], strict=True)) == sorted(
        (c, b) for c in CONTEXTS for b in BATCHES
    )
    assert (steps["value"] > 0).all()
    serving = set(df[df["surface"] == "serving"]["metric"])
    assert {"dispatcher_overhead_pct", "dispatcher_request_ms", "engine_calls_ms"} <= serving
    calls = df[df["metric"] == "engine_calls_ms"]["value"].iloc[0]
    wall = df[df["metric"] == "dispatcher_request_ms"]["value"].iloc[0]
    assert 0 < calls <= wall  # the engine's calls happen inside the request's wall time
    assert (df[df["metric"].str.startswith("growth_ratio")]["value"] > 0).all()


def test_report_has_limits_and_plot(passed_run: tuple[int, Path, Path]) -> None:
    _, run_dir, root = passed_run
    report = (run_dir / "report.md").read_text()
    assert "## Limits" in report
    limits = report.split("## Limits", 1)[1]
    assert "loaded from the certified bundle files on disk" in limits and "Noise" in limits
    assert "no bundle loader" not in limits
    assert "Rungs that ran" in limits and "`prefill_b2_s8_c12`" in limits
    assert "outside the study's certified compile" not in limits
    png = run_dir / "decode_latency.png"
    assert png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![decode_latency.png](decode_latency.png)" in report
    index = (root / "README.md").read_text()
    assert f"tiny/{run_dir.name}/report.md" in index and "passed" in index
    assert "benchmarks/" in index


def _perturb(src: Path, dst: Path, name: str, scale: float) -> None:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    e = read_header(f)[name]
    with f.open("r+b") as fh:
        fh.seek(e.offset)
        data = np.frombuffer(fh.read(e.nbytes), dtype=e.dtype).copy()
        fh.seek(e.offset)
        fh.write((data * scale).astype(e.dtype).tobytes())


def test_weights_altered_after_compile_fail_the_gate(ckpt: Path, tmp_path: Path) -> None:
    altered = tmp_path / "altered"
    _perturb(ckpt, altered, "model.layers.0.mlp.down_proj.weight", 1.5)
    root = tmp_path / "results"
    wl = _workload(tmp_path / "w.yaml", altered, reference_model={"path": str(ckpt)})
    out = run_study(wl, console=_quiet(), root=root)
    assert out.exit_code == 1 and out.run_dir is not None
    gate = json.loads((out.run_dir / "gate.json").read_text())
    assert gate["passed"] is False and gate["executor"] == "cpu"
    assert gate["checks"][1]["value"] > 1e-4  # the log-probabilities moved
    assert json.loads((out.run_dir / "compile.json").read_text())["accepted"]  # plan was fine
    names = {p.name for p in out.run_dir.iterdir()}
    assert "metrics.csv" not in names and not any(n.endswith(".png") for n in names)
    report = (out.run_dir / "report.md").read_text()
    assert "no performance numbers" in report and "## Limits" in report
    assert "FAILED" in (root / "README.md").read_text()


def test_rejected_plan_stops_before_the_gate(ckpt: Path, tmp_path: Path) -> None:
    wl = _workload(tmp_path / "w.yaml", ckpt, compile={"step_budget_ms": 1e-6})
    out = run_study(wl, console=_quiet(), root=tmp_path / "results")
    assert out.exit_code == 1 and out.run_dir is not None
    assert "bandwidth" in out.message or "compute" in out.message
    compiled = json.loads((out.run_dir / "compile.json").read_text())
    assert compiled["accepted"] is False and compiled["reason"]
    names = {p.name for p in out.run_dir.iterdir()}
    assert "gate.json" not in names and "metrics.csv" not in names


def test_oracle_rejection_stops_the_study(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint the oracle rejects (here E, on the second context's bundle) stops the run
    with exit 1 and a located reason; the rejected bundle is removed, nothing else runs."""
    import plow.emit.verify as verify

    real = verify.run_checkpoint
    kv = CONTEXTS[1] + 4

    def fake(ck: str, payload: object, **kw: object) -> Certificate:
        cert = real(ck, payload, **kw)  # type: ignore[arg-type]
        if ck == "E":
            calls.append(ck)
        if ck == "E" and len(calls) > 2 * len(BATCHES):  # the first bundle's 2 + 2 rungs
            return cert.model_copy(
                update={"verdict": Verdict.reject, "reason": "record 3: opcode", "theorems": []}
            )
        return cert

    calls: list[str] = []
    monkeypatch.setattr(verify, "run_checkpoint", fake)
    wl = _workload(tmp_path / "w.yaml", ckpt)
    out = run_study(wl, console=_quiet(), root=tmp_path / "results")
    assert out.exit_code == 1 and out.run_dir is not None
    compiled = json.loads((out.run_dir / "compile.json").read_text())
    assert compiled["accepted"] is False
    assert compiled["reason"].startswith("checkpoint E, bucket decode_b")
    assert f"_s{kv}" in compiled["reason"] and "record 3: opcode" in compiled["reason"]
    assert compiled["bundles"][0]["accepted"] and not compiled["bundles"][1]["accepted"]
    assert not Path(compiled["bundles"][1]["path"]).exists()
    names = {p.name for p in out.run_dir.iterdir()}
    assert "gate.json" not in names and "metrics.csv" not in names
    assert "**Rejected:** checkpoint E" in (out.run_dir / "report.md").read_text()


def test_no_checkpoint_is_checked_in_python(ckpt: Path, tmp_path: Path) -> None:
    """Issue 14: no size limit moves D out of the oracle (its sweep handles every plan size;
    the limit is gone from plow.emit.verify); every row is the oracle's, with its theorems."""
    import plow.emit.verify as verify

    assert not hasattr(verify, "D_ORACLE_MAX_TASKS")
    wl, _ = load_workload(_workload(tmp_path / "w.yaml", ckpt))
    study = compile_study(ckpt, wl, None, out_root=tmp_path / "bundles")
    rep = study.report
    assert rep.accepted
    for b in rep.buckets:
        for ck in ("D", "E", "F"):
            c = b.check(ck)
            assert c is not None and c.theorems, ck
            assert c.verdict == "accept", ck


def test_cpu_runner_runs_the_certified_plans(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner sized to a compiled context launches the certified plans loaded from its
    bundle file — the decode rung and a prefill rung of batch 2 from the bundle's ladder,
    with the in-memory planner made to raise; a runner sized to a context the study did not
    compile is refused (nothing is planned in memory)."""
    import plow.runtime.cpu.model as cpu_model_mod

    wl, _ = load_workload(_workload(tmp_path / "w.yaml", ckpt))
    study = compile_study(ckpt, wl, None, out_root=tmp_path / "bundles")
    c = load_checkpoint(ckpt)
    ex = get_executor("cpu")
    kv = CONTEXTS[0] + 4
    with monkeypatch.context() as mp:

        def no_planning(*a: object, **k: object) -> None:
            raise AssertionError("planned in memory")

        mp.setattr(cpu_model_mod, "plan_from_parts", no_planning)
        runner = ex.open(c, max_batch=2, max_context=kv, compiled=study)
        runner.prefill([[5, 9, 17], [5, 9, 17]])
        certified = runner.decode([1, 2])
    use = study.usage[f"decode_b2_s{kv}"]
    assert use.certified and use.launches == 1 and use.from_bundle == 1
    assert use.bundle == str(study.bundle_path(Bucket.decode(2, kv)))
    pre = {k: u for k, u in study.usage.items() if k.startswith("prefill")}
    home = study.bundle_path(Bucket.decode(2, kv))
    assert home is not None
    ladder = json.loads((home / "manifest.json").read_text())["ladder"]
    rungs = {r["name"]: r for r in ladder if r["phase"] == "prefill"}
    assert list(pre) == [f"prefill_b2_s{CONTEXTS[0]}_c{kv}"]  # one launch of both rows
    assert all(k in rungs and rungs[k]["batch"] == 2 for k in pre)
    assert all(u.certified and u.launches == u.from_bundle == 1 for u in pre.values())
    with pytest.raises(PlowError, match=f"no certified plan for context {kv + 1}"):
        ex.open(c, max_batch=1, max_context=kv + 1, compiled=study)
    assert Bucket.decode(2, kv) in study.plans
    # without the study the harness opens no runner: it plans nothing in memory
    with pytest.raises(PlowError, match="certified bundles"):
        ex.open(c, max_batch=2, max_context=kv)
    # the same logits as the cpu executor planning the bucket itself (same target, plan)
    from plow.runtime.cpu.engine import CpuEngine, CpuRunner
    from plow.runtime.cpu.model import CpuModel

    plain = CpuRunner(CpuEngine(CpuModel(c.spec, c.weights, max_batch=2, max_context=kv)))
    plain.prefill([[5, 9, 17], [5, 9, 17]])
    np.testing.assert_array_equal(plain.decode([1, 2]), certified)


MALFORMED = [
    ("batch_sizes: [0]", "field 'batch_sizes.0': Input should be greater than 0"),
    ("batch_sizes: [1, 1]", "field 'batch_sizes': values must be distinct"),
    ("executor: tpu", "field 'executor'"),
    ("colour: blue", "field 'colour': Extra inputs are not permitted"),
    ("gate: {max_abs_logprob_delta: -1}", "field 'gate.max_abs_logprob_delta'"),
    ("prompt_lengths: {min: 9, max: 3}", "field 'prompt_lengths'"),
    ("model: {default: true, path: x}", "field 'model'"),
]


@pytest.mark.parametrize(("line", "expected"), MALFORMED)
def test_malformed_workload_one_line_naming_the_field(
    line: str, expected: str, tmp_path: Path
) -> None:
    base = {"study: s", "model: default", "context_lengths: [8]", "prompts: [hi]"}
    key = line.split(":", 1)[0]
    lines = [x for x in base if not x.startswith(key + ":")] + [line]
    path = tmp_path / "workload.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as info:
        load_workload(path)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: ")
    assert expected in msg


def test_missing_field_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="field 'context_lengths': Field required"):
        parse_workload("study: s\nmodel: default\nprompts: [hi]\n", "w.yaml")
    with pytest.raises(ConfigError, match=r"w.yaml: malformed YAML at line 3"):
        parse_workload("study: s\nbatch_sizes: [1, 2\n", "w.yaml")
    with pytest.raises(ConfigError, match="exactly one of 'prompts' or 'prompt_lengths'"):
        parse_workload("study: s\nmodel: default\ncontext_lengths: [8]\n", "w.yaml")


def test_cli_malformed_workload_exit_2_no_traceback(tmp_path: Path) -> None:
    from plow.cli import app

    path = tmp_path / "workload.yaml"
    path.write_text(
        "study: s\nmodel: default\ncontext_lengths: [8]\nprompts: [hi]\nbatch_sizes: [0]\n"
    )
    result = CliRunner().invoke(app, ["eval", str(path)])
    assert result.exit_code == 2
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert lines == [f"plow: {path}: field 'batch_sizes.0': Input should be greater than 0"]


@pytest.mark.parametrize("name", ["gemma3_12b_h200_decode", "context_growth_1k_128k"])
def test_gpu_workloads_stop_without_a_gpu(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from plow.cli import app

    monkeypatch.setenv("PLOW_ASSUME_NO_GPU", "1")
    wl, _ = load_workload(name)
    assert wl.executor == "cuda" and wl.tp_degree == 1 and wl.context_lengths[0] == 1024
    result = CliRunner().invoke(app, ["eval", name])
    assert result.exit_code == 2
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "no GPU on this machine" in lines[0]
    assert "Traceback" not in result.output


def test_gpu_growth_study_spans_1k_to_128k() -> None:
    wl, _ = load_workload("context_growth_1k_128k")
    assert (wl.context_lengths[0], wl.context_lengths[-1]) == (1024, 131072)
    assert load_workload("gemma3_12b_h200_decode")[0].target == "h200"


def test_shipped_workloads_parse() -> None:
    names = shipped_workloads()
    assert {"default", "gemma3_12b_h200_decode", "context_growth_1k_128k"} <= set(names)
    default, _ = load_workload(None)
    assert default.model.default and default.batch_sizes == [1, 4]
    assert default.prompts and default.prompts[0] == "The capital of France is"
    for n in names:
        load_workload(n)


def test_executor_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(EXECUTORS) == {"reference", "native", "cpu", "cuda", "hip"}
    assert get_executor("reference").name == "reference"
    assert get_executor("native").name == "native"  # the native kernel (issue 12)
    assert get_executor("cpu").name == "cpu"  # the CPU executor (issue 6) is registered
    monkeypatch.setenv("PLOW_ASSUME_NO_GPU", "1")
    with pytest.raises(ExecutorUnavailable, match="no GPU on this machine"):
        get_executor("cuda")
    with pytest.raises(PlowError, match="unknown executor"):
        get_executor("tpu")


def test_reference_runner_shared_prefill_equals_separate(ckpt: Path) -> None:
    """Rows repeating a prompt share its prefill; every row still decodes as if alone."""
    c = load_checkpoint(ckpt)
    ex = get_executor("reference")
    prompt = [5, 9, 17, 3]
    batched = ex.open(c, max_batch=3, max_context=16)
    single = ex.open(c, max_batch=1, max_context=16)
    lb = batched.prefill([prompt, [7, 8], prompt])
    ls = single.prefill([prompt])
    np.testing.assert_array_equal(lb[0], ls[0])
    np.testing.assert_array_equal(lb[2], ls[0])
    db = batched.decode([11, 4, 12])
    ds = single.decode([11])
    np.testing.assert_array_equal(db[0], ds[0])
    assert not np.array_equal(db[0], db[2])  # rows diverged: their caches are separate


def test_index_lists_other_results(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    text = regenerate_index(tmp_path).read_text()
    assert "(none yet)" in text and "[`benchmarks/`](benchmarks/)" in text


def test_a_native_study_publishes_beside_the_cpu_executor(ckpt: Path, tmp_path: Path) -> None:
    wl = _workload(tmp_path / "native.yaml", ckpt, executor="native", compare_executors=["cpu"])
    out = run_study(wl, console=_quiet(), root=tmp_path / "results")
    assert out.exit_code == 0 and out.run_dir is not None
    compiled = json.loads((out.run_dir / "compile.json").read_text())
    # both executors run certified bundle plans only: decode rungs, and prefill rungs (batch
    # 2 among them) from the bundles' ladders
    launches = compiled["launches"]
    decode = {k: u for k, u in launches.items() if k.startswith("decode")}
    prefill = {k: u for k, u in launches.items() if k.startswith("prefill")}
    assert decode and prefill and set(launches) == set(decode) | set(prefill)
    assert all(u["certified"] and u["from_bundle"] == u["launches"]
               for u in launches.values())  # fmt: skip
    rungs = {b["bucket"]: b for b in compiled["buckets"] if b["phase"] == "prefill"}
    assert set(prefill) <= set(rungs) and any(rungs[k]["batch"] == 2 for k in prefill)
    rows = list(csv.DictReader((out.run_dir / "metrics.csv").open()))
    raw = {(r["context"], r["batch"]) for r in rows if r["surface"] == "raw"
           and r["metric"] == "decode_step_ms" and r["executor"] == "native"}  # fmt: skip
    cmp = {(r["context"], r["batch"]) for r in rows if r["surface"] == "compare"
           and r["metric"] == "decode_step_ms" and r["executor"] == "cpu"}  # fmt: skip
    assert raw == cmp == {(str(c), str(b)) for c in CONTEXTS for b in BATCHES}
    report = (out.run_dir / "report.md").read_text()
    assert "Beside the `cpu` executor" in report
    assert (
        "Rungs that ran" in report and f"`prefill_b2_s{CONTEXTS[0]}_c{CONTEXTS[0] + 4}`" in report
    )
    assert json.loads((out.run_dir / "workload.json").read_text())["executor"]["name"] == "native"
