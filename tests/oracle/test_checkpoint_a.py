"""Checkpoint A on real tiny bundles: `plow verify` certifies that a bundle's op table is the
graph its own config.json lowers to (every op kind, attribute, operand and weight exactly),
or that graph transformed by instances of proved rules (the blocks of `rewrites.json`).
Semantic edits are made with the manifest hashes re-forged (tests/emit/bundle_edit.py) and,
where the edited op table still emits, the plan file re-emitted from it, so only a semantic
check can notice: A must reject each naming the op."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from plow.bundle.manifest import LadderRung
from plow.cli import app
from plow.emit.bundle import compile_bundle
from plow.emit.verify import rung_bucket, verify_bundle
from plow.oracle.models import Certificate
from plow.oracle.payloads.rewrites import REWRITES_FILE
from plow.oracle.runner import run_checkpoint_a
from plow.profile import CompileProfile
from plow.target import load_target
from tests.emit.bundle_edit import copy_bundle, edit_json, edit_rung, first_rung, reforge

# unfused: these tests write their own rewrite blocks over the canonical ops
PROFILE = CompileProfile(decode_batches=(1,), prefill_seqs=(8,), fuse=False)


@pytest.fixture(scope="module")
def bundles(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt_a")
    return {
        f: compile_bundle(
            tiny_checkpoints[f], root / f, load_target("cpu"), PROFILE, plan_only=True
        ).out
        for f in ("llama", "gemma3")
    }


def a_rejection(bundle: Path, **kw: Any) -> str:
    """`plow verify`'s checkpoint A verdicts on the bundle: the first rejection's reason."""
    rep = verify_bundle(bundle, **kw)
    bad = [r.reason for r in rep.rows if r.checkpoint == "A" and r.rejected]
    assert bad, [(r.checkpoint, r.bucket, r.verdict, r.reason) for r in rep.rows]
    return bad[0]


def a_on_files(bundle: Path) -> list[Certificate | str]:
    """What `plow verify`'s A job answers for every rung (`run_checkpoint_a` on the bundle's
    files), for op tables the emitter cannot re-emit packets from (so `verify_bundle` stops
    at the packets before any checkpoint)."""
    m = json.loads((bundle / "manifest.json").read_text())
    out: list[Certificate | str] = []
    for r in m["ladder"]:
        rung = LadderRung.model_validate(r)
        bucket = rung_bucket(rung)
        assert not isinstance(bucket, str)
        out.append(run_checkpoint_a(bundle, bundle / rung.ops, bucket))
    return out


def a_files_rejection(bundle: Path) -> str:
    first = a_on_files(bundle)[0]
    if isinstance(first, str):
        return first
    assert not first.accepted and first.reason, first
    return first.reason


def op_index(bundle: Path, rung: dict[str, Any], name: str) -> int:
    ops = json.loads((bundle / rung["ops"]).read_text())["ops"]
    return next(o["index"] for o in ops if o["name"] == name)


def edit_op(name: str, fn: Any) -> Any:
    def edit(doc: dict[str, Any]) -> None:
        fn(next(o for o in doc["ops"] if o["name"] == name))

    return edit


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_unedited_bundle_is_certified_by_a(
    bundles: dict[str, Path], family: str, tmp_path: Path
) -> None:
    b = copy_bundle(bundles[family], tmp_path / "b")
    res = CliRunner().invoke(app, ["verify", str(b), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout.strip().splitlines()[0])
    rows = [r for r in doc["rows"] if r["checkpoint"] == "A"]
    assert len(rows) == 2 and all(r["verdict"] == "accept" for r in rows)
    cert = json.loads((b / "certificates" / "A.json").read_text())
    assert cert["accepted"] and set(cert["buckets"]) == {"decode_b1_s256", "prefill_b1_s8_c256"}
    for c in cert["buckets"].values():
        assert "Plow.Rewritescheckproof.checkpoint_a_sound" in c["theorems"]
        assert len(c["payload_sha256"]) == 64


def test_edited_epsilon_is_rejected(bundles: dict[str, Path], tmp_path: Path) -> None:
    b = copy_bundle(bundles["llama"], tmp_path / "b")
    rung = first_rung(b)
    edit_rung(b, rung, ops=edit_op("L1.mlp_norm", lambda o: o["attrs"].update(eps=1e-5)))
    i = op_index(b, rung, "L1.mlp_norm")
    why = a_rejection(b)
    assert f"op {i} (L1.mlp_norm)" in why and "attribute eps is 1e-05" in why, why
    assert "1e-06" in why, why


def test_swapped_attention_operands_are_rejected(bundles: dict[str, Path], tmp_path: Path) -> None:
    b = copy_bundle(bundles["llama"], tmp_path / "b")
    rung = first_rung(b)

    def swap(o: dict[str, Any]) -> None:  # keys and values: the same shape, so B sees nothing
        o["inputs"][1], o["inputs"][2] = o["inputs"][2], o["inputs"][1]

    edit_rung(b, rung, ops=edit_op("L0.attn", swap))
    why = a_rejection(b)
    i = op_index(b, rung, "L0.attn")
    assert f"op {i} (L0.attn)" in why and 'operand 1 is "L0.v_proj"' in why, why
    assert 'has "L0.k_rope"' in why, why


def test_weight_binding_swapped_between_layers_is_rejected(
    bundles: dict[str, Path], tmp_path: Path
) -> None:
    b = copy_bundle(bundles["llama"], tmp_path / "b")
    rung = first_rung(b)
    w0 = "model.layers.0.mlp.up_proj.weight"
    w1 = "model.layers.1.mlp.up_proj.weight"

    def swap(doc: dict[str, Any]) -> None:
        for o in doc["ops"]:
            if o["name"] in ("L0.up_proj", "L1.up_proj"):
                o["inputs"][1] = {w0: w1, w1: w0}[o["inputs"][1]]

    edit_rung(b, rung, ops=swap)
    rep = verify_bundle(b)
    # the other checkpoints see a consistent plan: only A notices
    assert {r.checkpoint for r in rep.rows if r.rejected} == {"A"}, rep.rows
    why = a_rejection(b)
    i = op_index(b, rung, "L0.up_proj")
    assert f"op {i} (L0.up_proj)" in why and f'operand 1 is "{w1}"' in why, why


def test_changed_op_kind_is_rejected(bundles: dict[str, Path], tmp_path: Path) -> None:
    b = copy_bundle(bundles["gemma3"], tmp_path / "b")
    rung = first_rung(b)
    edit_rung(
        b, rung, ops=edit_op("L1.mlp_residual", lambda o: o.update(kind="gated_mlp")),
        reemit=False,
    )  # fmt: skip
    why = a_rejection(b, checkpoints=("A",))
    i = op_index(b, rung, "L1.mlp_residual")
    assert f"op {i} (L1.mlp_residual)" in why, why
    assert "kind gated_mlp, the model's graph has residual_add" in why, why


def test_dropped_op_is_rejected(bundles: dict[str, Path], tmp_path: Path) -> None:
    b = copy_bundle(bundles["llama"], tmp_path / "b")
    rung = first_rung(b)
    edit_rung(b, rung, ops=lambda d: d["ops"].pop(), reemit=False)  # the sample op
    why = a_files_rejection(b)
    assert "no op for the model graph's op" in why and "(sample)" in why, why


# ---- applied rewrites (rewrites.json): a hand-made fused op table, checked by A alone (the
# emitter's fused opcodes are not this test's business)


def _fuse_add_rmsnorm(
    doc: dict[str, Any], layer: int, eps: float | None = None, weight: str | None = None
) -> int:
    """Replace L<layer>.attn_residual + L<layer>.mlp_norm by one add_rmsnorm op (with another
    epsilon or norm weight when given)."""
    ops = doc["ops"]
    i = next(k for k, o in enumerate(ops) if o["name"] == f"L{layer}.attn_residual")
    add, norm = ops[i], ops[i + 1]
    attrs = dict(norm["attrs"]) if eps is None else {**norm["attrs"], "eps": eps}
    fused = {
        **norm, "name": f"L{layer}.attn_residual+mlp_norm", "kind": "add_rmsnorm",
        "attrs": attrs, "inputs": [*add["inputs"], weight or norm["inputs"][1]],
        "outputs": [add["outputs"][0], norm["outputs"][0]],
    }  # fmt: skip
    ops[i : i + 2] = [fused]
    for k, o in enumerate(ops):
        o["index"] = k
    return i


def _with_rewrites(b: Path, blocks: list[dict[str, Any]], layouts: list[Any] | None = None) -> None:
    (b / REWRITES_FILE).write_text(json.dumps({"blocks": blocks, "layouts": layouts or []}))
    edit_json(b / "manifest.json", lambda m: m["files"].update({REWRITES_FILE: ""}))
    reforge(b)


def _fused_rungs(b: Path, fuse: Any) -> int:
    m = json.loads((b / "manifest.json").read_text())
    idx = -1
    for rung in m["ladder"]:
        doc = json.loads((b / rung["ops"]).read_text())
        idx = fuse(doc)
        (b / rung["ops"]).write_text(json.dumps(doc))
    return idx


def test_add_rmsnorm_block_is_accepted(bundles: dict[str, Path], tmp_path: Path) -> None:
    b = copy_bundle(bundles["llama"], tmp_path / "b")
    i = _fused_rungs(b, lambda d: _fuse_add_rmsnorm(d, 1))
    _with_rewrites(b, [{"rule": "R1", "canonical": [i, i + 1], "fused": i}])
    certs = a_on_files(b)
    assert len(certs) == 2, certs
    for c in certs:
        assert isinstance(c, Certificate) and c.accepted, c
        assert "Plow.Rewritescheckproof.checkpoint_a_sound" in c.theorems
    # without the file the same table is no pass-through of the graph
    (b / REWRITES_FILE).unlink()
    edit_json(b / "manifest.json", lambda m: m["files"].pop(REWRITES_FILE))
    reforge(b)
    why = a_files_rejection(b)
    assert f"op {i} (L1.attn_residual+mlp_norm)" in why and "kind add_rmsnorm" in why, why


@pytest.mark.parametrize(
    "edit",
    [{"eps": 1e-3}, {"weight": "model.layers.0.input_layernorm.weight"}],
    ids=["edited_epsilon", "residual_into_another_norm"],
)
def test_add_rmsnorm_block_that_is_no_instance_is_rejected(
    bundles: dict[str, Path], tmp_path: Path, edit: dict[str, Any]
) -> None:
    b = copy_bundle(bundles["llama"], tmp_path / "b")
    i = _fused_rungs(b, lambda d: _fuse_add_rmsnorm(d, 0, **edit))
    _with_rewrites(b, [{"rule": "R1", "canonical": [i, i + 1], "fused": i}])
    why = a_files_rejection(b)
    assert f"op {i} (L0.attn_residual+mlp_norm)" in why, why
    assert "not an instance of rule R1" in why, why


def _fuse_gate_up(doc: dict[str, Any], layer: int) -> int:
    """Replace L<layer>.gate_proj, up_proj, gated_mlp by one linear_glu op reading the
    interleaved weight."""
    ops = doc["ops"]
    i = next(k for k, o in enumerate(ops) if o["name"] == f"L{layer}.gate_proj")
    gate, glu = ops[i], ops[i + 2]
    w = f"model.layers.{layer}.mlp.gate_up.interleaved"
    g = doc["tensors"][gate["inputs"][1]]
    doc["tensors"][w] = {**g, "shape": [2 * g["shape"][0], g["shape"][1]]}
    fused = {
        **glu, "name": f"L{layer}.linear_glu", "kind": "linear_glu",
        "inputs": [gate["inputs"][0], w], "outputs": glu["outputs"],
    }  # fmt: skip
    ops[i : i + 3] = [fused]
    for k, o in enumerate(ops):
        o["index"] = k
    return i


def test_gate_up_glu_block_checks_the_interleave(bundles: dict[str, Path], tmp_path: Path) -> None:
    gw, uw = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    w = "model.layers.0.mlp.gate_up.interleaved"
    for sources, ok in (([gw, uw], True), ([uw, gw], False)):
        b = copy_bundle(bundles["llama"], tmp_path / f"b{ok}")
        i = _fused_rungs(b, lambda d: _fuse_gate_up(d, 0))
        _with_rewrites(
            b,
            [{"rule": "R2+R3+R13", "canonical": [i, i + 1, i + 2], "fused": i}],
            [{"weight": w, "layout": "interleave", "sources": sources}],
        )
        if ok:
            assert all(isinstance(c, Certificate) and c.accepted for c in a_on_files(b))
        else:  # gate and up swapped: the wrong interleave
            why = a_files_rejection(b)
            assert f"op {i} (L0.linear_glu)" in why, why
            assert "not an instance of rule R2+R3+R13" in why, why


def test_unreadable_rewrites_file_is_a_located_rejection(
    bundles: dict[str, Path], tmp_path: Path
) -> None:
    b = copy_bundle(bundles["llama"], tmp_path / "b")
    _with_rewrites(b, [{"rule": "R1", "canonical": [999], "fused": 3}])
    why = a_rejection(b, checkpoints=("A",))
    assert why.startswith("rewrites.json: block 0 (R1): canonical op 999 is outside"), why


def _fuse(
    doc: dict[str, Any],
    first: str,
    count: int,
    op: dict[str, Any],
    tensors: dict[str, list[int]] | None = None,
) -> int:
    """Replace `count` ops from the one named `first` by `op` (kind, inputs, outputs, attrs;
    new weight tensors by shape); returns its index."""
    ops = doc["ops"]
    i = next(k for k, o in enumerate(ops) if o["name"] == first)
    for name, shape in (tensors or {}).items():
        doc["tensors"][name] = {**doc["tensors"][ops[i]["inputs"][-1]], "shape": shape}
    ops[i : i + count] = [{**ops[i], "name": f"{first}+{count - 1}", **op}]
    for k, o in enumerate(ops):
        o["index"] = k
    return i


def _weight(bundle: Path, name: str) -> list[int]:
    doc = json.loads((bundle / first_rung(bundle)["ops"]).read_text())
    shape: list[int] = doc["tensors"][name]["shape"]
    return shape


L0 = "model.layers.0."


@pytest.mark.parametrize("order", ["q, k, v", "k, q, v"])
def test_qkv_concat_block_checks_the_concatenation(
    bundles: dict[str, Path], tmp_path: Path, order: str
) -> None:
    b = copy_bundle(bundles["llama"], tmp_path / "b")
    ws = {p: f"{L0}self_attn.{p}_proj.weight" for p in "qkv"}
    sources = [ws[p] for p in order.split(", ")]
    rows = sum(_weight(b, w)[0] for w in sources)
    wqkv = f"{L0}self_attn.qkv.weight"
    fused = {
        "kind": "qkv_concat", "attrs": {}, "inputs": ["L0.attn_norm", wqkv],
        "outputs": ["L0.q_proj", "L0.k_proj", "L0.v_proj"],
    }  # fmt: skip
    shape = [rows, _weight(b, ws["q"])[1]]
    i = _fused_rungs(b, lambda d: _fuse(d, "L0.q_proj", 3, fused, {wqkv: shape}))
    _with_rewrites(
        b,
        [{"rule": "R4", "canonical": [i, i + 1, i + 2], "fused": i}],
        [{"weight": wqkv, "layout": "cat3", "sources": sources}],
    )
    if order == "q, k, v":
        assert all(isinstance(c, Certificate) and c.accepted for c in a_on_files(b))
    else:
        why = a_files_rejection(b)
        assert f"op {i} (L0.q_proj+2) (qkv_concat) is not an instance of rule R4" in why, why


def test_residual_fusions_are_accepted(bundles: dict[str, Path], tmp_path: Path) -> None:
    # R10 on llama: o_proj + the attention residual (residual stream first)
    b = copy_bundle(bundles["llama"], tmp_path / "r10")
    fused = {
        "kind": "linear_residual", "attrs": {},
        "inputs": ["L0.attn", f"{L0}self_attn.o_proj.weight", "embed"],
        "outputs": ["L0.attn_residual"],
    }  # fmt: skip
    i = _fused_rungs(b, lambda d: _fuse(d, "L0.o_proj", 2, fused))
    _with_rewrites(b, [{"rule": "R10", "canonical": [i, i + 1], "fused": i}])
    assert all(isinstance(c, Certificate) and c.accepted for c in a_on_files(b))
    # R12 on gemma3: the sandwich post-norm + the residual, with the norm's attributes
    b = copy_bundle(bundles["gemma3"], tmp_path / "r12")
    norm = json.loads((b / first_rung(b)["ops"]).read_text())["ops"][11]
    assert norm["name"] == "L0.post_attn_norm"
    fused = {
        "kind": "rmsnorm_residual", "attrs": norm["attrs"],
        "inputs": ["embed", "L0.o_proj", f"{L0}post_attention_layernorm.weight"],
        "outputs": ["L0.attn_residual"],
    }  # fmt: skip
    i = _fused_rungs(b, lambda d: _fuse(d, "L0.post_attn_norm", 2, fused))
    _with_rewrites(b, [{"rule": "R12", "canonical": [i, i + 1], "fused": i}])
    assert all(isinstance(c, Certificate) and c.accepted for c in a_on_files(b))


def test_a_fusion_whose_intermediate_is_read_later_is_rejected(
    bundles: dict[str, Path], tmp_path: Path
) -> None:
    # R11 over the attention norm and q_proj: k_proj and v_proj still read the norm's output
    b = copy_bundle(bundles["llama"], tmp_path / "b")
    norm = json.loads((b / first_rung(b)["ops"]).read_text())["ops"][1]
    fused = {
        "kind": "rmsnorm_linear", "attrs": norm["attrs"],
        "inputs": ["embed", f"{L0}input_layernorm.weight", f"{L0}self_attn.q_proj.weight"],
        "outputs": ["L0.q_proj"],
    }  # fmt: skip
    i = _fused_rungs(b, lambda d: _fuse(d, "L0.attn_norm", 2, fused))
    _with_rewrites(b, [{"rule": "R11", "canonical": [i, i + 1], "fused": i}])
    why = a_files_rejection(b)
    assert f'op {i + 1} (L0.k_proj) reads "L0.attn_norm"' in why, why
    assert f"op {i} (L0.attn_norm+1) (R11) fused away" in why, why


def test_blocks_out_of_the_graphs_order_are_rejected(
    bundles: dict[str, Path], tmp_path: Path
) -> None:
    # every block an instance, but the fused add+norm moved after the gate projection that
    # reads its output: the table is no longer the blocks in the graph's order
    b = copy_bundle(bundles["llama"], tmp_path / "b")

    def fuse_and_swap(d: dict[str, Any]) -> int:
        i = _fuse_add_rmsnorm(d, 0)
        ops = d["ops"]
        ops[i], ops[i + 1] = ops[i + 1], ops[i]
        for k, o in enumerate(ops):
            o["index"] = k
        return i

    i = _fused_rungs(b, fuse_and_swap)
    _with_rewrites(b, [{"rule": "R1", "canonical": [i, i + 1], "fused": i + 1}])
    why = a_files_rejection(b)
    assert "do not keep the model graph's op order" in why, why
    assert f"put op {i + 2} (L0.gate_proj) where op {i} (L0.attn_residual) is" in why, why


@pytest.mark.parametrize(
    "edit", [None, "eps", "weight", "order", "softcap", "pair"],
    ids=["accepted", "edited_epsilon", "another_norm_weight", "swapped_operands", "softcap",
         "not_the_lm_head"],
)  # fmt: skip
def test_final_norm_in_the_lm_head_block_r19(
    bundles: dict[str, Path], tmp_path: Path, edit: str | None
) -> None:
    """R19 (plow/egraph/apply.py): final_norm + lm_head as one lm_head over the norm's input,
    the lm_head's weight and the norm's weight, with the norm's attributes — checked as R11
    over the lm_head read as a linear. Each edit is rejected naming the op and the rule."""
    b = copy_bundle(bundles["llama"], tmp_path / "b")
    ops = json.loads((b / first_rung(b)["ops"]).read_text())["ops"]
    first = "L1.attn_norm" if edit == "pair" else "final_norm"
    norm = next(o for o in ops if o["name"] == first)
    lm = next(o for o in ops if o["name"] == ("L1.q_proj" if edit == "pair" else "lm_head"))
    attrs = dict(norm["attrs"])
    inputs = [norm["inputs"][0], lm["inputs"][1], norm["inputs"][1]]
    if edit == "eps":
        attrs["eps"] = 1e-3
    if edit == "weight":  # the residual stream normalised by another norm's weight
        inputs[2] = "model.layers.1.post_attention_layernorm.weight"
    if edit == "order":
        inputs[1], inputs[2] = inputs[2], inputs[1]
    if edit == "softcap":
        attrs["softcap"] = 30.0
    fused = {"kind": "lm_head", "attrs": attrs, "inputs": inputs, "outputs": lm["outputs"]}
    i = _fused_rungs(b, lambda d: _fuse(d, first, 2, fused))
    _with_rewrites(b, [{"rule": "R19", "canonical": [i, i + 1], "fused": i}])
    if edit is None:
        assert all(isinstance(c, Certificate) and c.accepted for c in a_on_files(b))
        return
    why = a_files_rejection(b)
    assert f"op {i} ({first}+1) (lm_head) is not an instance of rule R19" in why, why


@pytest.mark.parametrize(
    "edit", [None, "eps", "weight", "table", "attrs_flat"],
    ids=["accepted", "edited_epsilon", "another_norm_weight", "another_table",
         "norm_attrs_not_nested"],
)  # fmt: skip
def test_first_norm_beside_the_embedding_block_r18(
    bundles: dict[str, Path], tmp_path: Path, edit: str | None
) -> None:
    """R18 (plow/egraph/apply.py): embed + L0.attn_norm as one embedding over the ids, the
    table and the norm's weight, writing the rows and their norm (attributes the embedding's,
    the norm's under "norm"); each edit is rejected naming the op and the rule."""
    b = copy_bundle(bundles["llama"], tmp_path / "b")
    ops = json.loads((b / first_rung(b)["ops"]).read_text())["ops"]
    emb, norm = ops[0], ops[1]
    assert (emb["name"], norm["name"]) == ("embed", "L0.attn_norm")
    nattrs = dict(norm["attrs"])
    inputs = [*emb["inputs"], norm["inputs"][1]]
    attrs: dict[str, Any] = {**emb["attrs"], "norm": nattrs}
    if edit == "eps":
        nattrs["eps"] = 1e-3
    if edit == "weight":
        inputs[2] = "model.layers.1.input_layernorm.weight"
    if edit == "table":
        inputs[1] = "lm_head.weight"
    if edit == "attrs_flat":
        attrs = {**emb["attrs"], **nattrs}
    fused = {"kind": "embedding", "attrs": attrs, "inputs": inputs,
             "outputs": [emb["outputs"][0], norm["outputs"][0]]}  # fmt: skip
    i = _fused_rungs(b, lambda d: _fuse(d, "embed", 2, fused))
    _with_rewrites(b, [{"rule": "R18", "canonical": [i, i + 1], "fused": i}])
    if edit is None:
        assert all(isinstance(c, Certificate) and c.accepted for c in a_on_files(b))
        return
    why = a_files_rejection(b)
    assert f"op {i} (embed+1) (embedding) is not an instance of rule R18" in why, why
