"""`plow verify BUNDLE --source CKPT` (plow/emit/verify_source.py): the bundle's config.json and
every weight, under the re-layouts rewrites.json records, are the checkpoint's byte for byte.

The edits below keep the bundle self-consistent (hashes re-forged, the op table edited with the
config): plain `plow verify` accepts every one of them — only the source can tell.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from plow.bundle.manifest import WEIGHTS
from plow.checkpoint.weights import read_header
from plow.cli import app
from plow.emit.bundle import compile_bundle
from plow.emit.verify import verify_bundle
from plow.emit.verify_source import config_difference, verify_source
from plow.profile import CompileProfile
from plow.target import load_target
from tests.emit.bundle_edit import copy_bundle, edit_json, reforge, rungs

PROFILE = CompileProfile(decode_batches=(1,), context=32)  # fused by default
GATE = "model.layers.0.mlp.gate_proj.weight"
UP = "model.layers.0.mlp.up_proj.weight"
GLU = f"interleave({GATE}, {UP})"
QKV = "cat3({0}.q_proj.weight, {0}.k_proj.weight, {0}.v_proj.weight)".format(
    "model.layers.1.self_attn"
)


@pytest.fixture(scope="module")
def fused(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("source") / "llama"
    compile_bundle(tiny_checkpoints["llama"], out, load_target("cpu"), PROFILE)
    return out


def _rows(bundle: Path, name: str) -> np.memmap:
    """The bundle tensor `name` as a writable [rows, row bytes] map of weights.safetensors."""
    e = read_header(bundle / WEIGHTS)[name]
    return np.memmap(
        bundle / WEIGHTS, np.uint8, "r+", e.offset, (e.shape[0], e.nbytes // e.shape[0])
    )


def _plain_verify_accepts(b: Path) -> None:
    rep = verify_bundle(b)
    assert rep.accepted, rep.first_rejection()


def test_fused_bundle_equals_its_source(fused: Path, tiny_checkpoints: dict[str, Path]) -> None:
    rw = json.loads((fused / "rewrites.json").read_text())
    assert {x["weight"] for x in rw["layouts"]} >= {GLU, QKV}
    rep = verify_source(fused, tiny_checkpoints["llama"])
    assert rep.accepted, rep.problem
    assert rep.weights == len(read_header(fused / WEIGHTS))
    assert rep.bytes == sum(e.nbytes for e in read_header(fused / WEIGHTS).values())


def test_gate_up_in_the_wrong_permutation_is_caught_only_against_the_source(
    fused: Path, tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The interleaved weight stored as gate rows then up rows (the concatenation, not the
    alternation): same shape, same dtype, hashes re-forged."""
    b = copy_bundle(fused, tmp_path / "b")
    m = _rows(b, GLU)
    n = m.shape[0] // 2
    m[:] = np.concatenate(
        [m[0::2], m[1::2]]
    )  # rows g0, u0, g1, u1, ... -> g0, g1, ..., u0, u1, ...
    m.flush()
    del m
    reforge(b)
    _plain_verify_accepts(b)
    rep = verify_source(b, tiny_checkpoints["llama"])
    # row 1 holds gate row 1; it should be up row 0
    assert rep.problem == (
        f"weight {GLU!r}: element [1, 0] differs from the source's {UP}[0, 0] under interleave"
    ), rep.problem
    assert n > 1


def test_qkv_in_the_wrong_order_is_caught_against_the_source(
    fused: Path, tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """cat3(q, k, v) stored as q, v, k (k and v have one shape): the rows of k are v's."""
    b = copy_bundle(fused, tmp_path / "b")
    hdr = read_header(tiny_checkpoints["llama"] / "model.safetensors")
    q = hdr["model.layers.1.self_attn.q_proj.weight"].shape[0]
    k = hdr["model.layers.1.self_attn.k_proj.weight"].shape[0]
    m = _rows(b, QKV)
    m[q:] = np.concatenate([m[q + k :], m[q : q + k]])
    m.flush()
    del m
    reforge(b)
    _plain_verify_accepts(b)
    rep = verify_source(b, tiny_checkpoints["llama"])
    assert rep.problem == (
        f"weight {QKV!r}: element [{q}, 0] differs from the source's "
        "model.layers.1.self_attn.k_proj.weight[0, 0] under cat3"
    ), rep.problem


def test_a_consistent_config_edit_is_caught_against_the_source(
    fused: Path, tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """rms_norm_eps edited in config.json and in every norm of the op table alike: checkpoint A
    derives the canonical graph from the bundle's config, so it agrees; the source does not."""
    b = copy_bundle(fused, tmp_path / "b")
    edit_json(b / "config.json", lambda c: c.update(rms_norm_eps=1e-3))

    def eps(doc: dict[str, Any]) -> None:
        for o in doc["ops"]:
            if "eps" in o["attrs"]:
                o["attrs"]["eps"] = 1e-3
            if "eps" in o["attrs"].get("norm", {}):  # R18's embedding: its norm's attributes
                o["attrs"]["norm"]["eps"] = 1e-3

    for r in rungs(b):
        edit_json(b / r["ops"], eps)
    reforge(b)
    _plain_verify_accepts(b)
    rep = verify_source(b, tiny_checkpoints["llama"])
    assert rep.problem == (
        "config.json differs at key rms_norm_eps (0.001 in the bundle, 1e-06 in the source)"
    ), rep.problem


def test_config_difference_ignores_only_keys_off_the_graph() -> None:
    base = {"hidden_size": 64, "rope_parameters": {"rope_theta": 1e4}, "transformers_version": "5"}
    assert (
        config_difference(base, {**base, "transformers_version": "4", "use_cache": False}) is None
    )
    assert config_difference({**base, "hidden_size": 64.0}, base) is None
    nested = {**base, "rope_parameters": {"rope_theta": 5e5}}
    assert config_difference(nested, base) == (
        "rope_parameters.rope_theta (500000.0 in the bundle, 10000.0 in the source)"
    )
    assert config_difference({**base, "tie_word_embeddings": True}, base) == (
        "tie_word_embeddings (absent from the source's)"
    )
    assert config_difference({**base, "hidden_size": True}, {**base, "hidden_size": 1}) is not None


def test_cli_verify_source(fused: Path, tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    runner = CliRunner()
    b = copy_bundle(fused, tmp_path / "b")
    ok = runner.invoke(app, ["verify", str(b), "--source", str(tiny_checkpoints["llama"])])
    assert ok.exit_code == 0, ok.output
    assert "equal the checkpoint's" in ok.output
    m = _rows(b, GLU)
    m[[0, 1]] = m[[1, 0]]  # gate row 0 and up row 0 swapped
    m.flush()
    del m
    reforge(b)
    bad = runner.invoke(app, ["verify", str(b), "--source", str(tiny_checkpoints["llama"])])
    assert bad.exit_code == 1
    last = bad.stderr.strip().splitlines()[-1]
    assert (
        f"differs from the source {tiny_checkpoints['llama']}: weight {GLU!r}: element [0, 0]"
        in last
    )
    gone = runner.invoke(app, ["verify", str(b), "--source", str(tmp_path / "nowhere")])
    assert gone.exit_code == 2
    assert gone.stderr.strip().count("\n") == 0 and "nowhere" in gone.stderr, gone.stderr
