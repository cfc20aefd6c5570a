"""Proof hygiene: no `Admitted`, `admit` or `Axiom` in the proof library or the extraction
driver, and the top checkpoint theorems depend on no axiom (`Print Assumptions`)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = re.compile(r"\b(Admitted|admit|Axiom|Axioms|Parameter|Conjecture)\b")
# `Parameter`/`Conjecture` declare axioms too; none is used in the library.

# Top theorems whose assumptions are printed. Others append their checkpoint's top theorem.
TOP_THEOREMS = [
    "Plow.Countersproof.checkpoint_d_sound",
    "Plow.Countersproof.check_scopes_sound",
    "Plow.Dataflowproof.checkpoint_d_flow_sound",
    "Plow.Dataflowproof.check_dataflow_sound",
    "Plow.Dataflowproof.hb_safety",
    "Plow.Flowsweepproof.checkpoint_d_sweep_sound",
    "Plow.Flowsweepproof.check_sweep_sound",
    "Plow.Flowsweepproof.checkpoint_d_sweep_counted_verdict",
    "Plow.Tilesproof.checkpoint_b_sound",
    "Plow.Tilesproof.check_tiling_plan_sound",
    "Plow.Partitionproof.check_plan_tasks_sound",
    "Plow.Tilesproof.check_tiling_plan_reject_sound",
    "Plow.Bounds.decode_per_token_ge_weights",
    "Plow.Bounds.decode_per_token_floor",
    "Plow.Gatedproof.latest_gated_sound",
    "Plow.Gatedproof.fine_barrier_le_coarse",
    "Plow.Gatedproof.coupled_c7r_all_routings",
    "Plow.Gatedproof.latest_gated_complete",
    "Plow.Wireproof.checkpoint_e_sound",
    "Plow.Emitcheckproof.checkpoint_e_emit_sound",
    "Plow.Emitcheckproof.check_emit_sound",
    "Plow.Wireproof.decode_encode_packets",
    "Plow.Wireproof.encode_decode_packets",
    "Plow.Allocproof.checkpoint_f_sound",
    "Plow.Allocproof.check_shared_sound",
    "Plow.Allocproof.shared_ordered_safety",
    "Plow.Rewritescheckproof.checkpoint_a_sound",
    "Plow.Rewritescheckproof.check_table_sound",
    "Plow.Serq.Theorem2proof.theorem2_one_node_holds",
    "Plow.Serq.Theorem2proof.theorem2_nodes_per_node_holds",
    "Plow.Serq.Theorem2proof.theorem2_compound_holds",
    "Plow.Serq.Theorem2proof.theorem2_rad128",
    "Plow.Serq.Theorem2proof.theorem2_nodes_joint_holds",
    "Plow.Serq.Theorem2proof.theorem2_all_rad128",
]


def strip_comments_and_strings(src: str) -> str:
    """Coq source without (nested) comments and string literals; newlines are kept."""
    out: list[str] = []
    i, depth, n = 0, 0, len(src)
    in_string = False
    while i < n:
        two = src[i : i + 2]
        c = src[i]
        if in_string:
            if c == '"':
                if src[i + 1 : i + 2] == '"':  # "" escapes a quote inside a string
                    i += 2
                    continue
                in_string = False
            elif c == "\n":
                out.append(c)
            i += 1
        elif two == "(*":
            depth += 1
            i += 2
        elif depth > 0 and two == "*)":
            depth -= 1
            i += 2
        elif depth > 0:
            if c == "\n":
                out.append(c)
            i += 1
        elif c == '"':
            in_string = True
            i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def vernac_files() -> list[Path]:
    return sorted([*(ROOT / "Plow").rglob("*.v"), *(ROOT / "oracle").rglob("*.v")])


def test_comment_stripper() -> None:
    src = 'Lemma a : True. (* admit (* Admitted *) Axiom *) Proof. exact I. Qed. "admit"'
    assert FORBIDDEN.search(src)
    assert not FORBIDDEN.search(strip_comments_and_strings(src))
    assert FORBIDDEN.search(strip_comments_and_strings("Proof. admit. Admitted."))
    assert not FORBIDDEN.search(strip_comments_and_strings("Lemma admit_free_x : True."))


def test_no_admitted_admit_or_axiom() -> None:
    files = vernac_files()
    assert files, "no .v files found under Plow/ or oracle/"
    bad = []
    for f in files:
        text = strip_comments_and_strings(f.read_text(encoding="utf-8"))
        for lineno, line in enumerate(text.splitlines(), 1):
            m = FORBIDDEN.search(line)
            if m:
                bad.append(f"{f.relative_to(ROOT)}:{lineno}: {m.group(0)}")
    assert not bad, "forbidden vernacular:\n" + "\n".join(bad)


@pytest.mark.parametrize("theorem", TOP_THEOREMS)
def test_print_assumptions_closed(theorem: str, tmp_path: Path) -> None:
    coqc = shutil.which("coqc")
    assert coqc is not None, "coqc not installed"
    built = ROOT / "_build" / "default" / "Plow"
    module = theorem.rsplit(".", 1)[0].split(".", 1)[1]  # e.g. Tilesproof
    assert (built / f"{module.replace('.', '/')}.vo").is_file(), "run `dune build` first"
    probe = tmp_path / "Probe.v"
    probe.write_text(f"From Plow Require Import {module}.\nPrint Assumptions {theorem}.\n")
    proc = subprocess.run(
        [coqc, "-Q", str(built), "Plow", str(probe)],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Closed under the global context" in proc.stdout, proc.stdout
