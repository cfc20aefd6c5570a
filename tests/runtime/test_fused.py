"""Fused ops in the packets (`CompileProfile.fuse`, plow/egraph/apply.py): the extraction
decides, for every rule the emitter implements (R1 add_rmsnorm, R2+R3+R13 linear_glu over the
interleaved gate/up weight, R4 linear_qkv over the concatenated q/k/v weight).

On the llama, qwen3 and gemma3 fixtures a fused bundle's greedy tokens equal transformers' on
the `cpu` (numpy) and `native` executors (and on a 16-worker target whose other ops split their
reductions), and its native prefill logits equal the unfused bundle's bit for bit; its decode
plan has fewer ops, op edges and packets than the unfused one; `rewrites.json` names blocks
whose canonical ops are the rule's pattern in the model's graph and whose fused op is the op
table's; the interleaved weight is the checkpoint's gate and up rows alternated, the
concatenated one q, k, v stacked; `plow inspect --rewrites` lists the applied blocks. Fusion
is on by default; `--no-fuse` (fuse=False) writes no `rewrites.json` and no fused kind.
The CUDA source's fused tiles, on the emulation build of tests/runtime/test_cuda.py, give the
native executor's tokens and logits bit for bit (also with the fused matmuls' k split).

Split k: where every linear splits its k alike (64 workers, at most two k steps), a fused
linear_glu / linear_qkv writes partials and merges them (ordered sums; then act(gate) * up, or
the q, k, v routing), and its logits equal the unfused split plan's bit for bit on the native
and numpy executors, its tokens transformers'.

Fused bundles are compiled with `verify=True` and opened verified: every checkpoint, A to F,
accepts them (B's shape rules and D's access rules know the fused kinds); a fused bundle with
a fused op's k split without partials and merges, a task box moved, or a consumer's wait on a
fused op (or a split glu merge's wait on its partials) dropped (files kept consistent, hashes
re-forged) is rejected by B or D.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from plow.bundle.files import OpTable
from plow.checkpoint import load_checkpoint
from plow.cli import app
from plow.emit.bundle import compile_bundle
from plow.graph import Bucket, build_graph
from plow.profile import CompileProfile
from plow.runtime.cpu import CpuModel, Request, generate
from plow.runtime.native import open_native
from plow.target import load_target
from tests.runtime.helpers import hf_greedy, prefill_logits, rewire_wait
from tests.runtime.test_cuda import emulator, fresh_driver, on_emulator  # noqa: F401

FAMILIES = ["llama", "qwen3", "gemma3"]
PROMPTS = [[5, 17, 93, 2, 44, 8, 61, 30, 12, 7, 99, 14, 3, 150, 88, 21, 40, 9], [3, 250, 41], [9]]
NEW = 6
CONTEXT = 48
FUSED_KINDS = {"add_rmsnorm", "linear_glu", "linear_qkv"}


def _profile(fuse: bool) -> CompileProfile:
    return CompileProfile(
        name="fused", decode_batches=(1, 4), prefill_seqs=(16,), context=CONTEXT, fuse=fuse
    )


def split_target():  # 16 workers: the tiler splits the other ops' k, norms, attention
    return load_target("cpu").model_copy(update={"workers": 16, "tile_overhead_ns": 50})


@pytest.fixture(scope="module")
def bundles(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, bool | str], Path]:
    root = tmp_path_factory.mktemp("fused")
    out: dict[tuple[str, bool | str], Path] = {}
    for fam in FAMILIES:
        for fuse in (False, True):
            out[fam, fuse] = root / f"{fam}-{fuse}"
            compile_bundle(
                tiny_checkpoints[fam], out[fam, fuse], load_target("cpu"), _profile(fuse),
                verify=fuse,  # every checkpoint, A to F (raises PlanRejected otherwise)
            )  # fmt: skip
    out["llama", "split"] = root / "llama-split"
    compile_bundle(
        tiny_checkpoints["llama"], out["llama", "split"], split_target(), _profile(True),
        verify=True,
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def k_split_bundles(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, bool | str], Path]:
    """64 workers and k split at most in two (`TilingOptions.k_splits`): every linear, fused
    or not, splits its k in two steps of the same width, so a fused linear_glu / linear_qkv
    reduces each weight row as the unfused gate / up / q / k / v linear does. `"no19"`: fused
    without R18 and R19 (on this target the unfused first and final norms split their
    columns, whose sums of squares R18's and R19's tiles, normalising whole rows, do not
    reproduce bit for bit)."""
    import plow.compile
    import plow.egraph.apply
    from plow.tiles.tiler import TilingOptions

    root = tmp_path_factory.mktemp("fused-ksplit")
    wide = load_target("cpu").model_copy(update={"workers": 64, "tile_overhead_ns": 50})
    out: dict[tuple[str, bool | str], Path] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plow.compile, "TilingOptions", functools.partial(TilingOptions, k_splits=(1, 2)))
        for fam in FAMILIES:
            for fuse in (False, True, "no19"):
                out[fam, fuse] = root / f"{fam}-{fuse}"
                with pytest.MonkeyPatch.context() as m2:
                    if fuse == "no19":
                        drop = ("R18", "R19")
                        rules = tuple(r for r in plow.egraph.apply.RULES if r not in drop)
                        m2.setattr(plow.egraph.apply, "RULES", rules)
                    fused = fuse is not False
                    compile_bundle(
                        tiny_checkpoints[fam], out[fam, fuse], wide, _profile(fused), verify=fused
                    )
    return out


def _ops(bundle: Path, rung: str) -> OpTable:
    return OpTable.model_validate_json((bundle / f"plan/{rung}.ops.json").read_bytes())


@pytest.mark.parametrize(
    ("family", "which"), [("llama", True), ("qwen3", True), ("gemma3", True), ("llama", "split")]
)
def test_fused_bundle_tokens_equal_transformers_on_cpu_and_native(
    bundles: dict, tiny_checkpoints: dict[str, Path], family: str, which: bool | str
) -> None:
    path = bundles[family, which]
    kinds = {o.kind for o in _ops(path, "decode_b1_s48").ops}
    # the fused ops really are in the packets (qwen3's fixture: one kv head, its k norm is
    # full-width and its q norm per head: R4's third variant, R4.norm1)
    assert kinds >= FUSED_KINDS
    if which == "split":  # 16 workers: ops split their reductions, add_rmsnorm its columns
        ops = _ops(path, "decode_b1_s48").ops
        assert any(o.partial for o in ops if o.kind == "add_rmsnorm")
        assert any(o.partial for o in ops if o.kind not in FUSED_KINDS)
    want = hf_greedy(tiny_checkpoints[family], PROMPTS, NEW)
    reqs = [Request(tuple(p), NEW) for p in PROMPTS]
    assert generate(CpuModel.from_bundle(path, max_batch=4), reqs) == want  # opened verified
    assert generate(open_native(path, max_batch=4), reqs) == want
    if which is True:  # the fused tiles keep the unfused dots' order: the same logits, bitwise
        plain = bundles[family, False]
        got = prefill_logits(open_native(path, verify=False), PROMPTS[0])  # verified above
        assert np.array_equal(got, prefill_logits(open_native(plain, verify=False), PROMPTS[0]))


@pytest.mark.parametrize("family", FAMILIES)
def test_split_k_fused_matmuls_keep_the_unfused_split_bits_and_transformers_tokens(
    k_split_bundles: dict, tiny_checkpoints: dict[str, Path], family: str
) -> None:
    """A fused linear_glu / linear_qkv whose k is split (partials, then merges: the ordered
    sums, then act(gate) * up for glu, the q, k, v routing for qkv) gives the unfused split
    plan's prefill logits bit for bit on the native and numpy executors, and transformers'
    greedy tokens; the bundle is certified A-F (compiled with verify, opened verified).
    With R18 and R19 as well (the first norm beside the embedding, the final norm in the
    lm_head's prologue, each over whole rows, where the unfused norms split their columns
    here) the logits are the unfused plan's within 2e-6 x max|logit| and the tokens
    transformers'."""
    fused, plain = k_split_bundles[family, "no19"], k_split_bundles[family, False]
    r19 = k_split_bundles[family, True]

    def head_inputs(p: Path) -> list[int]:  # operands of the lm_head: 3 with R19's norm
        return [len(o.inputs) for o in _ops(p, "decode_b1_s48").ops if o.kind == "lm_head"]

    assert head_inputs(r19) == [3] and head_inputs(fused) == [2]
    for rung in ("decode_b1_s48", "decode_b4_s48", "prefill_b1_s16_c48"):
        for kind in ("linear_glu", "linear_qkv"):
            ops = [o for o in _ops(fused, rung).ops if o.kind == kind]
            assert ops and all(o.partial and o.axes[2].steps == 2 for o in ops), (rung, kind)
    want = hf_greedy(tiny_checkpoints[family], PROMPTS, NEW)
    reqs = [Request(tuple(p), NEW) for p in PROMPTS]
    assert generate(CpuModel.from_bundle(fused, max_batch=4), reqs) == want  # opened verified
    assert generate(open_native(fused, max_batch=4), reqs) == want
    for open_ in (CpuModel.from_bundle, open_native):
        got = prefill_logits(open_(fused, verify=False), PROMPTS[0])
        base = prefill_logits(open_(plain, verify=False), PROMPTS[0])
        assert np.array_equal(got, base)
        near = prefill_logits(open_(r19, verify=False), PROMPTS[0])
        assert np.abs(near - base).max() <= 2e-6 * np.abs(base).max()
    assert generate(CpuModel.from_bundle(r19, max_batch=4), reqs) == want  # opened verified
    assert generate(open_native(r19, max_batch=4), reqs) == want


@pytest.mark.parametrize(
    ("target", "family", "split"),
    [("h200", "llama", {"linear_glu"}), ("h100", "gemma3", {"linear_glu", "linear_qkv"})],
)
def test_gpu_target_plans_split_the_fused_matmuls_k_and_are_certified(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, target: str, family: str, split: set
) -> None:
    """On the shipped GPU specs (132 SMs) the tiler splits the tiny fixtures' fused matmuls'
    k; the bundle is certified A-F and the bundle row by `plow verify`, and the numpy
    executor (which runs any target's plan) gives transformers' greedy tokens."""
    from plow.emit.verify import verify_bundle

    path = tmp_path / "b"
    compile_bundle(tiny_checkpoints[family], path, load_target(target), _profile(True), verify=True)
    for rung in ("decode_b1_s48", "prefill_b1_s16_c48"):
        assert {o.kind for o in _ops(path, rung).ops if o.partial} >= split, rung
    rep = verify_bundle(path)
    assert rep.accepted, [(r.checkpoint, r.reason) for r in rep.rows if r.rejected]
    assert {r.checkpoint for r in rep.rows} >= {"A", "B", "C", "D", "E", "F", "bundle"}
    reqs = [Request(tuple(p), NEW) for p in PROMPTS]
    want = hf_greedy(tiny_checkpoints[family], PROMPTS, NEW)
    assert generate(CpuModel.from_bundle(path, max_batch=4, verify=False), reqs) == want


def test_fused_decode_plan_has_fewer_ops_edges_and_packets(bundles: dict) -> None:
    res = {}
    for fuse in (False, True):
        info = json.loads(
            CliRunner().invoke(app, ["inspect", str(bundles["llama", fuse]), "--json"]).stdout
        )
        res[fuse] = next(b for b in info["buckets"] if b["bucket"] == "decode_b1_s48")
    # tiny llama, 2 layers: 3 R1 blocks, R18 and R19 (2 ops -> 1), 2 R2+R3+R13 and 2 R4 (3 -> 1)
    assert res[False]["ops"] - res[True]["ops"] == 5 * 1 + 2 * 2 + 2 * 2
    for key in ("op_edges", "op_edges_after_reduction", "packets", "tasks"):
        assert res[True][key] < res[False][key], key


def test_rewrites_json_blocks_are_rule_instances_of_the_model_graph(
    bundles: dict, tiny_checkpoints: dict[str, Path]
) -> None:
    path = bundles["llama", True]
    doc = json.loads((path / "rewrites.json").read_text())
    spec = load_checkpoint(tiny_checkpoints["llama"]).spec
    pattern = {
        "R1": ["residual_add", "rmsnorm"],
        "R2+R3+R13": ["linear", "linear", "gated_mlp"],
        "R4": ["linear", "linear", "linear"],
        "R19": ["rmsnorm", "lm_head"],
        "R18": ["embedding", "rmsnorm"],
    }
    fused_kind = {"R1": "add_rmsnorm", "R2+R3+R13": "linear_glu", "R4": "linear_qkv"}
    fused_kind["R19"] = "lm_head"  # with the final norm's weight as its third input
    fused_kind["R18"] = "embedding"  # with the first norm's weight, writing rows and norm
    for rung in ("decode_b1_s48", "decode_b4_s48", "prefill_b1_s16_c48"):
        ot = _ops(path, rung)
        canon = build_graph(spec, Bucket.decode(1, CONTEXT)).ops  # every rung: the same ops
        # llama fixture, 2 layers: 3 R1 (the last residual's norm is R19's), 2 + 2, R18, R19
        assert len(doc["blocks"]) == 3 + 2 + 2 + 1 + 1
        for b in doc["blocks"]:
            ops = [canon[i] for i in b["canonical"]]
            assert [o.kind.value for o in ops] == pattern[b["rule"]]
            fused = ot.ops[b["fused"]]
            assert fused.kind == fused_kind[b["rule"]]
            # the fused op writes what the canonical block's last op wrote
            assert ops[-1].outputs[0] in fused.outputs
            if b["rule"] == "R1":  # the sum, then the norm of it
                assert fused.outputs == [ops[0].outputs[0], ops[1].outputs[0]]
                assert ops[1].inputs[0] == ops[0].outputs[0]
            if b["rule"] == "R4":  # q, k, v, each what its projection wrote
                assert fused.outputs == [o.outputs[0] for o in ops]
                assert len({o.inputs[0] for o in ops}) == 1 == len({fused.inputs[0]})
            if b["rule"] == "R19":  # the norm's input, the lm_head's weight, the norm's weight
                assert fused.inputs == [ops[0].inputs[0], ops[1].inputs[1], ops[0].inputs[1]]
                assert fused.attrs == ops[0].attrs and not ops[1].attrs.get("softcap")
            if b["rule"] == "R18":  # the ids, the table, the norm's weight -> rows and norm
                assert fused.inputs == [*ops[0].inputs, ops[1].inputs[1]]
                assert fused.outputs == [ops[0].outputs[0], ops[1].outputs[0]]
                assert fused.attrs == {**ops[0].attrs, "norm": ops[1].attrs}
    # the re-laid-out weights: interleave (row 2i gate row i, row 2i + 1 up row i of the
    # checkpoint's), cat3 (q, k, v rows stacked)
    assert sorted(x["layout"] for x in doc["layouts"]) == ["cat3"] * 2 + ["interleave"] * 2
    stored = load_file(str(path / "weights.safetensors"))
    ckpt = load_file(str(tiny_checkpoints["llama"] / "model.safetensors"))
    for lay in doc["layouts"]:
        src = [ckpt[s] for s in lay["sources"]]
        w = stored[lay["weight"]]
        if lay["layout"] == "interleave":
            g, u = src
            assert w.shape == (2 * g.shape[0], g.shape[1])
            assert np.array_equal(w[0::2], g) and np.array_equal(w[1::2], u)
        else:
            assert np.array_equal(w, np.concatenate(src, axis=0))
        assert not set(lay["sources"]) & set(stored)  # the sources are not copied too


def test_fusion_is_opted_out_and_inspect_lists_the_applied_rules(bundles: dict) -> None:
    plain = bundles["gemma3", False]  # fuse=False: the canonical ops
    assert not (plain / "rewrites.json").exists()
    assert not {o.kind for o in _ops(plain, "decode_b1_s48").ops} & FUSED_KINDS
    res = CliRunner().invoke(app, ["inspect", str(bundles["gemma3", True]), "--rewrites", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    rules = [b["rule"] for b in out["applied"]["blocks"]]
    # 3 layers; the last residual's norm is the final norm, in the lm_head's prologue (R19)
    assert [rules.count(r) for r in ("R1", "R2+R3+R13", "R4", "R18", "R19")] == [5, 3, 3, 1, 1]
    # the report's emitter extraction is what the packets hold
    plan = json.loads(
        CliRunner().invoke(app, ["inspect", str(bundles["gemma3", True]), "--json"]).stdout
    )
    for rep, b in zip(out["rewrites"], plan["buckets"], strict=True):
        assert rep["emitted"]["ops"] == b["ops"]
    res = CliRunner().invoke(app, ["inspect", str(plain), "--rewrites"])
    assert res.exit_code == 0 and "applied in the packets: none" in res.stdout


# -- the CUDA source (kernels/device.cu + kernels/fused.h) on the emulation build ----------------


@pytest.fixture(scope="module")
def cubin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stub module file: the emulated driver only checks its ELF magic."""
    stub = tmp_path_factory.mktemp("stub") / "plow_device.cubin"
    stub.write_bytes(b"\x7fELF" + bytes(60))
    return stub


def test_the_emulated_cuda_kernel_runs_a_fused_plan_with_the_native_bits(
    tiny_checkpoints: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> None:
    """A fused h200 plan of the tiny llama for 8 SMs (add_rmsnorm, linear_glu, linear_qkv),
    run by the device source's own code on CPU threads (tests/runtime/test_cuda.py's emulated
    driver), gives the native executor's tokens and logits bit for bit."""
    from plow.runtime.cuda import open_cuda
    from plow.runtime.native import NativeModel
    from tests.runtime.test_cuda import EMU_WORKERS, PROFILE, _tokens_and_logits

    path = tmp_path_factory.mktemp("fusedcuda") / "bundle"
    small = load_target("h200").model_copy(update={"workers": EMU_WORKERS})
    prof = PROFILE.model_copy(update={"fuse": True})
    compile_bundle(tiny_checkpoints["llama"], path, small, prof)  # unverified: 8 SMs are no
    # shipped target (the bundle row rejects it); the cpu and 16-worker bundles are verified
    assert {o.kind for o in _ops(path, "decode_b1_s96").ops} >= FUSED_KINDS
    want, want_logits = _tokens_and_logits(NativeModel.from_bundle(path, max_batch=4, verify=False))
    request.getfixturevalue("on_emulator")
    got, got_logits = _tokens_and_logits(open_cuda(path, max_batch=4, verify=False))
    assert got == want
    assert np.array_equal(got_logits, want_logits)


def test_the_emulated_cuda_kernel_splits_the_fused_matmuls_k_with_the_native_bits(
    tiny_checkpoints: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> None:
    """A fused h200 plan for 32 SMs with cheap tiles: the tiler splits linear_glu's and
    linear_qkv's k (partials, merges); device.cu's fused tiles and merges, emulated, give the
    native executor's tokens and logits bit for bit."""
    from plow.runtime.cuda import open_cuda
    from plow.runtime.native import NativeModel
    from tests.runtime.test_cuda import PROFILE, _tokens_and_logits

    path = tmp_path_factory.mktemp("fusedcuda-ksplit") / "bundle"
    wide = load_target("h200").model_copy(update={"workers": 32, "tile_overhead_ns": 10})
    compile_bundle(tiny_checkpoints["llama"], path, wide, PROFILE.model_copy(update={"fuse": True}))
    split = {o.kind for o in _ops(path, "decode_b1_s96").ops if o.partial}
    assert split >= {"linear_glu", "linear_qkv"}
    native = NativeModel.from_bundle(path, max_batch=4, verify=False)
    want, want_logits = _tokens_and_logits(native)
    one = [Request(tuple(PROMPTS[1]), NEW)]  # the batch-1 rung: the one-row dots
    want1 = generate(native, one)
    request.getfixturevalue("on_emulator")
    m = open_cuda(path, max_batch=4, verify=False)
    got, got_logits = _tokens_and_logits(m)
    assert got == want
    assert np.array_equal(got_logits, want_logits)
    assert generate(m, one) == want1


def test_plow_compile_fuses_by_default_and_no_fuse_opts_out(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The extraction decides by default (`--fuse` is accepted and changes nothing);
    `--no-fuse` plans the canonical ops and writes no rewrites.json."""
    assert CompileProfile().fuse is True
    src = str(tiny_checkpoints["llama"])
    kinds = {}
    for flag in ("", "--fuse", "--no-fuse"):
        out = tmp_path / (flag or "default")
        args = ["compile", src, "-o", str(out), "--plan-only", *([flag] if flag else [])]
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["profile"]["fuse"] is (flag != "--no-fuse")
        assert ("rewrites.json" in manifest["files"]) is (flag != "--no-fuse")  # hashed
        kinds[flag] = {o.kind for r in manifest["ladder"] for o in _ops(out, r["name"]).ops}
    assert kinds[""] == kinds["--fuse"] and kinds[""] >= FUSED_KINDS
    assert not kinds["--no-fuse"] & FUSED_KINDS


def test_every_checkpoint_accepts_the_fused_bundles(bundles: dict) -> None:
    """Checkpoint A (Plow/Rewritescheck.v) certifies the blocks of `rewrites.json` as rule
    instances of the model's graph; B's shape rules (Plow/Partition.v) and D's access rules
    (plow/oracle/payloads/dataflow.py) know the fused kinds; C, E and F take the fused plans
    as they take any: every rung of every fused bundle, the split one too, is certified."""
    from plow.emit.verify import verify_bundle

    for key in (("llama", True), ("qwen3", True), ("gemma3", True), ("llama", "split")):
        rep = verify_bundle(bundles[key])
        assert rep.accepted, [(r.checkpoint, r.reason) for r in rep.rows if r.rejected]
        assert {r.checkpoint for r in rep.rows} >= {"A", "B", "C", "D", "E", "F"}
        b = [r for r in rep.rows if r.checkpoint == "B"]
        assert b and all("Plow.Partitionproof.check_plan_tasks_sound" in r.theorems for r in b)


def _fused_op(ops: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(o for o in ops["ops"] if o["kind"] == kind)


def _split_k(ops: dict[str, Any]) -> None:  # linear_qkv's k in two tiles, no partials/merges
    k = _fused_op(ops, "linear_qkv")["axes"][2]
    assert k["steps"] == 1  # the tiler keeps it whole on this target
    k["tile"], k["steps"] = k["extent"] // 2, 2


def _narrow_v(ops: dict[str, Any]) -> None:  # v's width no longer what cat3's rows say
    ops["tensors"]["L0.v_proj"]["shape"][-1] //= 2


def _move_box(sched: dict[str, Any]) -> None:  # a linear_qkv task's tiles one later
    t = sched["tasks"]
    i = next(i for i, n in enumerate(t["name"]) if n.startswith("L0.q_proj+L0.k_proj+L0.v_proj#"))
    t["unit_start"][i] += 1


QKV, NORM = "L0.q_proj+L0.k_proj+L0.v_proj", "L0.mlp_residual+L1.attn_norm"
GLU = "L0.gate_proj+L0.up_proj+L0.gated_mlp"


@pytest.mark.parametrize(
    ("edit", "rejecting", "says", "tensor"),
    [
        (("ops", _split_k), "BD", "(linear_qkv): tiles 16..32 of 32 run by no task", None),
        (("ops", _narrow_v), "B", "do not fit the linear_qkv rule", None),
        (("schedule", _move_box), "BD", f"op {QKV!r}".replace("'", '"'), None),
        # k_rope reads linear_qkv's k columns (not q's): the rule routes columns by width
        (
            ("schedule", rewire_wait("L0.k_rope", f"{QKV}.done", "embed+L0.attn_norm.done")),
            "D",
            f"({QKV}#",
            "L0.k_proj",
        ),
        # add_rmsnorm's merges read the partial (sums of squares) and the box of the sum its
        # tiles write (D names the first unordered pair it meets: bytes of either)
        (
            ("schedule", rewire_wait(f"{NORM}.merge", f"{NORM}.partial.done", "L0.down_proj.done")),
            "D",
            f"({NORM}#",
            (f"{NORM}#partial", "L0.mlp_residual"),
        ),
        # a split linear_glu's merges read the gate and up partials its k tiles write
        (
            (
                "schedule",
                rewire_wait(
                    f"{GLU}.merge", f"{GLU}.partial.done", "L0.attn_residual+L0.mlp_norm.done"
                ),
            ),
            "D",
            f"({GLU}#",
            f"{GLU}#partial",
        ),
        # the q/k/v of layer 1 read the norm the merges of add_rmsnorm write
        (
            (
                "schedule",
                rewire_wait(QKV.replace("L0", "L1"), f"{NORM}.done", f"{NORM}.partial.done"),
            ),
            "D",
            f"({NORM}.merge#",
            "L1.attn_norm",
        ),
        # down_proj reads what linear_glu writes (split here: what its merges write)
        (
            ("schedule", rewire_wait("L0.down_proj", f"{GLU}.done", f"{GLU}.partial.done")),
            "D",
            f"({GLU}.merge#",
            "L0.gated_mlp",
        ),
    ],
    ids=[
        "qkv-k-split",
        "qkv-v-narrowed",
        "qkv-box-moved",
        "qkv-k-wait",
        "norm-partial-wait",
        "glu-partial-wait",
        "norm-wait",
        "glu-wait",
    ],
)
def test_an_edited_fused_bundle_is_rejected_by_b_or_d(
    bundles: dict,
    tmp_path: Path,
    edit: tuple[str, Any],
    rejecting: str,
    says: str,
    tensor: str | tuple[str, ...] | None,
) -> None:
    """The 16-worker fused bundle (add_rmsnorm split, tasks on many workers), edited the way
    a bug would, files kept consistent (plan re-emitted, hashes re-forged): B or D rejects
    it, naming the fused op (D: a task of it and of the op that conflicts with it, and bytes of
    the tensor the fused op's rule says the two share). A dropped
    wait is data flow only (B accepts it); a split k or a moved box is both (B: the tiles'
    partition; D: tiles that write the same bytes unordered)."""
    from plow.emit.verify import verify_bundle
    from tests.emit.bundle_edit import copy_bundle, edit_rung, rungs

    b = copy_bundle(bundles["llama", "split"], tmp_path / "b")
    rung = next(r for r in rungs(b) if r["name"] == "decode_b1_s48")
    what, fn = edit
    edit_rung(b, rung, **{what: fn})
    rep = verify_bundle(b, checkpoints=("B", "D"))
    bad = [r for r in rep.rows if r.rejected]
    assert {r.checkpoint for r in bad} == set(rejecting), [(r.checkpoint, r.reason) for r in bad]
    row = next(r for r in bad if r.checkpoint == rejecting[0])
    assert says in (row.reason or ""), row.reason
    if tensor is not None:  # the conflict's bytes are the shared tensor's (the arena map)
        m = re.search(r"arena bytes \[(\d+), (\d+)\)", row.reason or "")
        assert m, row.reason
        sched = json.loads((b / rung["schedule"]).read_text())
        names = (tensor,) if isinstance(tensor, str) else tensor
        bufs = [x for x in sched["arena"]["buffers"] if x["name"] in names]
        lo, hi = int(m[1]), int(m[2])
        assert any(x["offset"] < hi and lo < x["offset"] + x["size"] for x in bufs), row.reason
