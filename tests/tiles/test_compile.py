"""`plow compile --plan-only` (tiling stage): outputs, certificates, and rejected plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plow.bundle.manifest import CheckpointCertificates
from plow.checkpoint import load_spec
from plow.cli import app
from plow.compile import compile_plan
from plow.errors import PlanRejected
from plow.graph import Bucket, build_graph
from plow.oracle import run_checkpoint
from plow.profile import CompileProfile
from plow.target import load_target
from plow.tiles import tile_graph, tile_payload
from plow.tiles.summary import TilesFile

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"

runner = CliRunner()


def test_cli_compile_real_config_writes_tiles_and_certificate(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    r = runner.invoke(
        app,
        [
            "compile",
            str(CONFIGS / "qwen3-8b"),
            "-o",
            str(out),
            "--plan-only",
            "--target",
            "h200",
            "--verify",
        ],
    )
    assert r.exit_code == 0, r.output
    certs = CheckpointCertificates.model_validate_json(
        (out / "certificates" / "B.json").read_text()
    )
    assert certs.accepted and set(certs.buckets) == {"decode_b1_s4096"}
    tiles = TilesFile.model_validate_json((out / "tiles.json").read_text())
    b = tiles.buckets[0]
    assert b.target == "h200" and b.num_ops == len(b.ops)
    q = next(o for o in b.ops if o.name.startswith("L0.q_proj"))  # (fused: +k_proj+v_proj)
    assert q.candidates[q.chosen].time_ns == min(c.time_ns for c in q.candidates if c.feasible)
    # the payload on disk re-checks to the same certificate
    payload = json.loads((out / "payloads" / "B" / "decode_b1_s4096.json").read_text())
    again = run_checkpoint("B", payload)
    assert (
        again.accepted and again.payload_sha256 == certs.buckets["decode_b1_s4096"].payload_sha256
    )


def test_cli_compile_tiny_fixture_with_target_file(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    tfile = tmp_path / "t.json"
    tfile.write_text(
        load_target("mi350x").model_copy(update={"name": "my-mi350x"}).model_dump_json()
    )
    out = tmp_path / "plan"
    r = runner.invoke(
        app,
        [
            "compile",
            str(tiny_checkpoints["gemma3"]),
            "-o",
            str(out),
            "--plan-only",
            "--target",
            str(tfile),
            "--verify",
        ],
    )
    assert r.exit_code == 0, r.output
    assert TilesFile.model_validate_json((out / "tiles.json").read_text()).target == "my-mi350x"


def test_tiny_budget_is_rejected_naming_op_resource_and_excess(tmp_path: Path) -> None:
    spec_dir = CONFIGS / "llama-3.1-8b"
    with pytest.raises(PlanRejected) as e:
        compile_plan(spec_dir, load_target("h100"), CompileProfile(decode_budget_ns=1_000_000))
    msg = str(e.value)
    assert e.value.exit_code == 1
    assert msg.startswith("bucket decode_b1_s4096: memory bandwidth: lower bound")
    assert "exceeds the budget 1 ms by" in msg and 'op "final_norm+lm_head"' in msg
    # the oracle rejects the same plan for the same reason
    tg = tile_graph(build_graph(load_spec(spec_dir), Bucket.decode(1, 4096)), load_target("h100"))
    cert = run_checkpoint("B", tile_payload(tg, load_target("h100"), 1_000_000))
    assert not cert.accepted and cert.reason is not None
    assert cert.reason.startswith("plan: memory-bandwidth bound")


def test_slow_target_cli_exits_1_with_one_line(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    slow = load_target("cpu").model_copy(update={"name": "slow", "bandwidth_bytes_per_s": 1000})
    tfile = tmp_path / "slow.json"
    tfile.write_text(slow.model_dump_json())
    r = runner.invoke(
        app,
        [
            "compile",
            str(tiny_checkpoints["llama"]),
            "-o",
            str(tmp_path / "o"),
            "--plan-only",
            "--target",
            str(tfile),
        ],
    )
    assert r.exit_code == 1
    last = r.output.strip().splitlines()[-1]
    assert (
        last.startswith("plow: bucket decode_b1_s")
        and "memory bandwidth" in last
        and 'op "' in last
    )
    assert "Traceback" not in r.output


def test_compute_bound_rejection_names_the_op(tiny_checkpoints: dict[str, Path]) -> None:
    weak = load_target("cpu").model_copy(
        update={"name": "weak", "peak_flops_per_s": {"bf16": 1000, "fp8": 1000, "fp32": 1000}}
    )
    with pytest.raises(PlanRejected) as e:
        compile_plan(tiny_checkpoints["qwen3"], weak, CompileProfile())
    assert "compute: lower bound" in str(e.value) and "performs the most" in str(e.value)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--target", "nope"], "unknown target"),
        (["--profile", "/nonexistent/p.json"], "profile file not found"),
        ([], "pass --plan-only"),
    ],
)
def test_bad_input_exits_2(args: list[str], needle: str, tmp_path: Path) -> None:
    plan_only = [] if args == [] else ["--plan-only"]
    r = runner.invoke(
        app, ["compile", str(CONFIGS / "qwen3-8b"), "-o", str(tmp_path / "o"), *plan_only, *args]
    )
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output


def test_malformed_profile_names_the_field(tmp_path: Path) -> None:
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"decode_batches": [0]}))
    r = runner.invoke(
        app,
        [
            "compile",
            str(CONFIGS / "qwen3-8b"),
            "-o",
            str(tmp_path / "o"),
            "--plan-only",
            "--profile",
            str(p),
        ],
    )
    assert r.exit_code == 2
    assert str(p) in r.output and "decode_batches" in r.output


def test_profile_buckets_and_budgets() -> None:
    prof = CompileProfile(
        decode_batches=(1, 4), prefill_seqs=(128,), context=2048, prefill_budget_ns_per_token=1000
    )
    bs = prof.buckets(131072)
    assert [b.name for b in bs] == ["decode_b1_s2048", "decode_b4_s2048", "prefill_b1_s128_c2048"]
    assert prof.budget_ns(bs[2]) == 128_000
    assert CompileProfile().buckets(512)[0].context == 512
