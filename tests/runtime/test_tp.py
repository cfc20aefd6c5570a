"""Tensor-parallel plans that split the work (plow/graph/shard.py, docs/parallel.md): a
`--tp 2` bundle of the tiny llama shards attention heads and MLP columns over two devices,
fuses each device's q/k/v, gate/up and residual-add + norm (fusion on by default), is
certified A-F, runs on the native and cpu executors here with transformers' greedy tokens,
keeps system-scope counters to the allreduce partials; a dropped allreduce dependency is
rejected by checkpoint D, a wrong slice by checkpoint A."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from typer.testing import CliRunner

from plow.bundle.files import OpTable
from plow.cli import app
from plow.emit.bundle import compile_bundle
from plow.profile import CompileProfile
from plow.runtime.cpu import CpuModel, Request, generate
from plow.runtime.native import open_native
from plow.target import load_target
from tests.runtime.helpers import hf_greedy, rewire_wait
from tests.runtime.test_cuda import emulator, fresh_driver, on_emulator  # noqa: F401
from tests.runtime.test_fused import cubin  # noqa: F401

PROMPTS = [[5, 17, 93, 2, 44, 8, 61, 30, 12, 7, 99, 14, 3, 150, 88, 21, 40, 9], [3, 250, 41]]
NEW = 6
RUNG = "decode_b1_s48"


def _profile() -> CompileProfile:
    return CompileProfile(name="tp", decode_batches=(1, 2), prefill_seqs=(16,), context=48)


@pytest.fixture(scope="module")
def tp2(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp") / "tp2"
    target = load_target("cpu").model_copy(update={"gpus": 2})
    compile_bundle(tiny_llama, out, target, _profile(), verify=True)  # A-F, else raises
    return out


def _ops(bundle: Path, rung: str = RUNG) -> OpTable:
    return OpTable.model_validate_json((bundle / "plan" / f"{rung}.ops.json").read_bytes())


def _schedule(bundle: Path, rung: str = RUNG) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((bundle / "plan" / f"{rung}.schedule.json").read_text())
    return doc


def test_tp2_tokens_equal_transformers_on_native_and_cpu(tp2: Path, tiny_llama: Path) -> None:
    """The fused --tp 2 bundle (the default) and the unfused one (--no-fuse)."""
    want = hf_greedy(tiny_llama, PROMPTS, NEW)
    reqs = [Request(tuple(p), NEW) for p in PROMPTS]
    assert {o.kind for o in _ops(tp2).ops} >= {"linear_qkv", "linear_glu", "add_rmsnorm"}
    assert generate(open_native(tp2, max_batch=2), reqs) == want  # opened verified
    assert generate(CpuModel.from_bundle(tp2, max_batch=2), reqs) == want
    unfused = tp2.parent / "tp2_unfused"
    prof = _profile().model_copy(update={"fuse": False, "decode_batches": (2,)})
    compile_bundle(tiny_llama, unfused, load_target("cpu").model_copy(update={"gpus": 2}), prof)
    assert not {o.kind for o in _ops(unfused, "decode_b2_s48").ops} & {"linear_qkv", "linear_glu"}
    assert generate(open_native(unfused, max_batch=2, verify=False), reqs) == want


def test_gemma3_tp2_tokens_equal_transformers(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Gemma 3's layout shards too: per-head q/k norms on the device's heads, the sandwich
    norms after each allreduce, sliding-window and global layers, (1 + w) norms, scaled
    embeddings; certified A-F; native greedy tokens equal transformers'."""
    path = tiny_checkpoints["gemma3"]
    out = tmp_path / "g2"
    prof = CompileProfile(name="tp", decode_batches=(1,), prefill_seqs=(16,), context=48)
    compile_bundle(path, out, load_target("cpu").model_copy(update={"gpus": 2}), prof, verify=True)
    kinds = {o.kind for o in _ops(out).ops}
    assert {"allreduce", "linear_qkv", "linear_glu", "add_rmsnorm"} <= kinds
    prompt = PROMPTS[0][:11]
    want = hf_greedy(path, [prompt], NEW)
    assert generate(open_native(out, max_batch=1), [Request(tuple(prompt), NEW)]) == want
    assert generate(CpuModel.from_bundle(out, max_batch=1), [Request(tuple(prompt), NEW)]) == want


def test_tp2_ops_are_split_over_devices_with_sliced_weights(tp2: Path, tiny_llama: Path) -> None:
    """Heads and MLP columns are split (each device's attention has half the heads, its
    q/k/v/gate/up half the rows, o/down half the columns of the checkpoint's tensors, as the
    op table's `slices` say, and the bundle's bytes are those slices: the fused q/k/v weight
    of a device its three slices stacked, the fused gate/up weight its two interleaved);
    norms and residual adds are replicated; one allreduce per device sums both partials."""
    ot = _ops(tp2)
    ops = {o.name: o for o in ot.ops}
    a0, a1 = ops["L0.attn@d0"], ops["L0.attn@d1"]
    assert (a0.attrs["heads"], a0.attrs["kv_heads"]) == (2, 1) == (a1.attrs["heads"], 1)
    assert {a0.attrs["cache_layer"], a1.attrs["cache_layer"]} == {0, 1}
    assert "L0.attn_norm@d0" in ops and "L0.attn_norm@d1" in ops  # replicated
    ar = ops["L0.o_proj.allreduce@d1"]
    assert ar.kind == "allreduce" and ar.inputs == ["L0.o_proj@d0", "L0.o_proj@d1"]
    bundle_w = load_file(str(tp2 / "weights.safetensors"))
    src = load_file(str(tiny_llama / "model.safetensors"))
    layouts = {x["weight"]: x for x in json.loads((tp2 / "rewrites.json").read_text())["layouts"]}
    seen = 0
    for o in ot.ops:
        sl = {}
        for new, source, axis, lo, hi in o.attrs.get("slices", []):
            full = src[source]
            sl[new] = full[lo:hi] if axis == 0 else full[:, lo:hi]
            seen += 1
        if not sl:
            continue
        w = o.inputs[1]
        lay = layouts.get(w, {"layout": None, "sources": [w]})
        parts = [sl[x] for x in lay["sources"]]
        if lay["layout"] == "interleave":
            want = np.stack(parts, axis=1).reshape(-1, parts[0].shape[1])
        else:
            want = np.concatenate(parts)
        assert np.array_equal(bundle_w[w], want), w
    assert seen == 2 * 2 * 7  # layers x devices x (q, k, v, o, gate, up, down)
    # every op's tasks run on its device's workers
    s = _schedule(tp2)
    per = s["workers_per_gpu"]
    dev = {o.name: int(o.attrs.get("device", 0)) for o in ot.ops}
    names = [o.name for o in ot.ops]
    for op_i, w in zip(s["tasks"]["op"], s["tasks"]["worker"], strict=True):
        assert w // per == dev[names[op_i]]


def test_each_device_fuses_its_own_heads_and_mlp_units(tp2: Path, tiny_llama: Path) -> None:
    """Fusion runs on the sharded graph: device d's linear_qkv reads the rows of Wq, Wk, Wv
    for its heads stacked (query heads 2d, 2d+1 and key-value head d of 4 / 2), its
    linear_glu the gate and up rows of intermediate units d*I/2 .. (d+1)*I/2 interleaved
    (row 2i gate, 2i+1 up), both fused ops on device d; the residual add + norm is fused on
    each replica (add_rmsnorm per device). Compared with the checkpoint's tensors directly."""
    ops = {o.name: o for o in _ops(tp2).ops}
    w = load_file(str(tp2 / "weights.safetensors"))
    src = load_file(str(tiny_llama / "model.safetensors"))
    at = "model.layers.1.self_attn"
    mlp = "model.layers.1.mlp"
    hd, inter = 16, src[f"{mlp}.gate_proj.weight"].shape[0]
    for d in (0, 1):
        qkv = ops[f"L1.q_proj@d{d}+L1.k_proj@d{d}+L1.v_proj@d{d}"]
        assert qkv.kind == "linear_qkv" and qkv.attrs["device"] == d
        q, k, v = (src[f"{at}.{n}_proj.weight"] for n in "qkv")
        want = np.concatenate(
            [q[2 * d * hd : (2 * d + 2) * hd], k[d * hd : (d + 1) * hd], v[d * hd : (d + 1) * hd]]
        )
        assert np.array_equal(w[qkv.inputs[1]], want)
        glu = ops[f"L1.gate_proj@d{d}+L1.up_proj@d{d}+L1.gated_mlp@d{d}"]
        assert glu.kind == "linear_glu" and glu.attrs["device"] == d
        g, u = (
            src[f"{mlp}.{n}_proj.weight"][d * inter // 2 : (d + 1) * inter // 2]
            for n in ("gate", "up")
        )
        got = w[glu.inputs[1]]
        assert np.array_equal(got[0::2], g) and np.array_equal(got[1::2], u)
        norm = ops[f"L1.attn_residual@d{d}+L1.mlp_norm@d{d}"]
        assert norm.kind == "add_rmsnorm" and norm.attrs["device"] == d


def test_the_activation_pool_is_partitioned_per_device(tp2: Path) -> None:
    """One arena, its activation and scratch pool cut into one contiguous range per device:
    every buffer an op of device d writes (its output, its split reduction's partial) lies in
    d's range, and the ranges do not overlap (checkpoint F certifies the rest)."""
    for rung in ("decode_b1_s48", "prefill_b1_s16_c48"):
        ot = _ops(tp2, rung)
        dev = {o.name: int(o.attrs.get("device", 0)) for o in ot.ops}
        writer = {t: o.name for o in ot.ops for t in o.outputs}
        spans: dict[int, list[int]] = {}
        for b in _schedule(tp2, rung)["arena"]["buffers"]:
            # lm_head's fused-argmax buffers (`lm_head#argmax...`, plow/bundle/argmax.py) are
            # placed after the arena's other buffers, outside the per-device pool
            if b["region"] in ("activations", "scratch") and "#argmax" not in b["name"]:
                # a partial: `<op>#partial...`
                d = dev[b["name"].split("#")[0] if "#" in b["name"] else writer[b["name"]]]
                lo, hi = spans.setdefault(d, [1 << 62, 0])
                spans[d] = [min(lo, b["offset"]), max(hi, b["offset"] + b["size"])]
        assert sorted(spans) == [0, 1], spans
        assert spans[0][1] <= spans[1][0], spans  # device 0's part, then device 1's


def test_system_scope_counters_are_the_allreduce_partials(tp2: Path) -> None:
    """Exactly the counters a device waits on for another device's partial are system
    scope (the row-parallel o_proj / down_proj partials every allreduce reads); every other
    counter stays within a device; `plow inspect` counts them and says why."""
    for rung in ("decode_b1_s48", "prefill_b1_s16_c48"):
        s = _schedule(tp2, rung)
        per = s["workers_per_gpu"]
        t, c = s["tasks"], s["counters"]
        gpus_of: dict[int, set[int]] = {}
        for worker, waits, signals in zip(t["worker"], t["waits"], t["signals"], strict=True):
            for k in (*waits, *signals):
                gpus_of.setdefault(k, set()).add(worker // per)
        system = {k for k, sc in enumerate(c["scope"]) if sc == "system"}
        assert system == {k for k, g in gpus_of.items() if len(g) > 1}
        names = {c["name"][k] for k in system}
        assert names and all(".o_proj@d" in n or ".down_proj@d" in n for n in names), names
    res = CliRunner().invoke(app, ["inspect", str(tp2)])
    assert res.exit_code == 0, res.output
    assert "system" in res.output and "allreduce" in res.output


def test_b_bounds_a_tp_plan_by_the_groups_bandwidth(tp2: Path) -> None:
    """Each of the 2 devices has the target's bandwidth and peak, so the plan's declared
    bounds (and B's payload, derived from the manifest's target) are over the group's: twice
    one device's. A step of the plan's bytes over one device's bandwidth is not a lower
    bound of a 2-device step; over the group's it is (T4)."""
    from plow.bundle.manifest import read_manifest
    from plow.emit.verify import expected_numbers
    from plow.graph import Bucket

    target = load_target("cpu").model_copy(update={"gpus": 2})
    prof = CompileProfile.model_validate(read_manifest(tp2).profile)
    for rung, bucket in ((RUNG, Bucket.decode(1, 48)), ("prefill_b1_s16_c48", None)):
        t = _ops(tp2, rung).tiling
        assert t.bandwidth_bytes_per_s == 2 * target.bandwidth_bytes_per_s
        assert t.peak_flops_per_s == 2 * target.peak_flops_per_s["fp32"]
        if bucket is not None:
            ex = expected_numbers(_ops(tp2, rung), target, prof, bucket)
            assert ex.bandwidth_bytes_per_s == t.bandwidth_bytes_per_s


def test_the_compilers_bound_is_the_busiest_devices(tiny_llama: Path) -> None:
    """Each device moves its own ops' bytes through its own memory, replicated ops included,
    so the compiler's bandwidth bound is the busiest device's bytes over one device's
    bandwidth (device 0: it also runs the final norm and lm_head), above the group sum B
    certifies; a budget between the two is rejected by the compiler, naming the device."""
    from plow.compile import compile_plan
    from plow.errors import PlanRejected

    target = load_target("cpu").model_copy(update={"gpus": 2})
    prof = CompileProfile(name="tp", decode_batches=(1,), prefill_seqs=(), context=48)
    bp = compile_plan(tiny_llama, target, prof).buckets[0]
    per = [0, 0]
    for o in bp.graph.ops:
        per[int(o.attrs["device"])] += bp.tiles.op(o.name).bytes
    b = bp.bounds
    assert (b.device_bytes, b.busiest_device, b.gpus) == (max(per), 0, 2) and per[0] > per[1]
    one = target.bandwidth_bytes_per_s
    assert b.bandwidth_bound_ns == pytest.approx(max(per) * 1e9 / one)
    group = sum(per) * 1e9 / (2 * one)
    assert b.bandwidth_bound_ns > group
    budget = int((group + b.bandwidth_bound_ns) / 2)
    with pytest.raises(PlanRejected, match=r"device 0 of 2 moves"):
        compile_plan(tiny_llama, target, prof.model_copy(update={"decode_budget_ns": budget}))


# Device 1's allreduce waits on an earlier counter of its own device instead of device 0's
# o_proj partial (the system counter); the edges from the partial's tasks are gone.
_drop_wait = rewire_wait("L0.o_proj.allreduce@d1", "L0.o_proj@d0.done", "L0.attn_norm@d1.done")


def _drop_signal(sched: dict[str, Any]) -> None:
    """Device 0's o_proj partial tasks no longer signal the system counter both devices'
    allreduces wait on (the threshold kept)."""
    t, names = sched["tasks"], sched["counters"]["name"]
    part = names.index("L0.o_proj@d0.done")
    hit = [i for i, n in enumerate(t["name"]) if n.startswith("L0.o_proj@d0#")]
    assert hit and all(part in t["signals"][i] for i in hit)
    for i in hit:
        t["signals"][i] = [x for x in t["signals"][i] if x != part]


@pytest.mark.parametrize(
    ("edit", "says"),
    [(_drop_wait, "L0.o_proj.allreduce@d1#"), (_drop_signal, "L0.o_proj@d0")],
    ids=["dropped-wait", "dropped-signal"],
)
def test_a_dropped_allreduce_dependency_is_rejected_by_d(
    tp2: Path, tmp_path: Path, edit: Any, says: str
) -> None:
    """The plan edited the way a bug would (re-emitted, hashes re-forged): device 1's
    allreduce no longer ordered after device 0's o_proj partial, or that partial's signal
    on its system counter dropped. B accepts (the tiles are the same); D rejects, naming the
    tasks or the counter."""
    from plow.emit.verify import verify_bundle
    from tests.emit.bundle_edit import copy_bundle, edit_rung, rungs

    b = copy_bundle(tp2, tmp_path / "b")
    rung = next(r for r in rungs(b) if r["name"] == RUNG)
    edit_rung(b, rung, schedule=edit)
    rep = verify_bundle(b, checkpoints=("B", "D"))
    bad = [r for r in rep.rows if r.rejected]
    assert [r.checkpoint for r in bad] == ["D"], [(r.checkpoint, r.reason) for r in bad]
    reason = bad[0].reason or ""
    assert "L0.o_proj@d0" in reason and says in reason, reason


def test_a_wrong_slice_is_rejected_by_a(tp2: Path, tiny_llama: Path, tmp_path: Path) -> None:
    """Device 1's fused q/k/v records device 0's key-value head (k rows 0:16, not 16:32) and
    its weight holds exactly those rows, so the bytes are what the op table says (`plow
    verify --source` accepts: it checks bytes against the records) and the packets are
    re-emitted, hashes re-forged: checkpoint A rejects, as the sharded graph of the model
    records rows 16:32 there, naming the op and the slice. The same for an unfused op: device
    1's o_proj recording device 0's columns."""
    from plow.bundle.manifest import WEIGHTS
    from plow.checkpoint.weights import read_header
    from plow.emit.verify import verify_bundle
    from plow.emit.verify_source import verify_source
    from tests.emit.bundle_edit import copy_bundle, edit_rung, reforge, rungs

    fused = "L0.q_proj@d1+L0.k_proj@d1+L0.v_proj@d1"

    def qkv(doc: dict[str, Any]) -> None:
        op = next(o for o in doc["ops"] if o["name"] == fused)
        assert op["attrs"]["slices"][1][3:] == [16, 32]
        op["attrs"]["slices"][1][3:] = [0, 16]

    def o_proj(doc: dict[str, Any]) -> None:
        op = next(o for o in doc["ops"] if o["name"] == "L0.o_proj@d1")
        op["attrs"]["slices"][0][3:] = [0, 32]

    b = copy_bundle(tp2, tmp_path / "b")
    for r in rungs(b):
        edit_rung(b, r, ops=qkv)
    cat = next(o for o in _ops(b).ops if o.name == fused).inputs[1]
    e = read_header(b / WEIGHTS)[cat]
    k = load_file(str(tiny_llama / "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"]
    raw = bytearray((b / WEIGHTS).read_bytes())
    row = k.shape[1] * k.dtype.itemsize
    at = e.offset + 32 * row  # after device 1's two query heads' rows
    raw[at : at + 16 * row] = k[0:16].tobytes()
    (b / WEIGHTS).write_bytes(bytes(raw))
    reforge(b)
    assert verify_source(b, tiny_llama).accepted
    rep = verify_bundle(b, checkpoints=("A",))
    bad = [r for r in rep.rows if r.rejected]  # every rung's A row
    assert bad and {r.checkpoint for r in bad} == {"A"}, [(r.checkpoint, r.reason) for r in bad]
    reason = bad[0].reason or ""
    assert fused in reason and "rule R4" in reason, reason
    assert '"model.layers.0.self_attn.k_proj.weight",0,16,32]' in reason, reason
    b2 = copy_bundle(tp2, tmp_path / "b2")
    for r in rungs(b2):
        edit_rung(b2, r, ops=o_proj)
    bad = [r for r in verify_bundle(b2, checkpoints=("A",)).rows if r.rejected]
    assert bad and {r.checkpoint for r in bad} == {"A"}, [(r.checkpoint, r.reason) for r in bad]
    assert "L0.o_proj@d1" in (bad[0].reason or "") and "attribute slices" in (bad[0].reason or "")


def test_uneven_kv_groups_split_2_plus_1_and_give_transformers_tokens(tmp_path: Path) -> None:
    """6 query heads over 3 key-value heads and an MLP of 175 columns at --tp 2 (neither a
    multiple of 2): device 0 takes key-value heads 0-1 with their query heads 0-3 and 88
    MLP columns, device 1 key-value head 2 with query heads 4-5 and 87 columns; the slices
    are those rows / columns of the checkpoint's tensors, the pool's layers hold 2 heads
    (device 1 uses 1); certified A-F; native and cpu greedy tokens equal transformers'."""
    from plow.testing.fixtures import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        "llama", 3, tmp_path / "ck", hidden_size=96, num_attention_heads=6,
        num_key_value_heads=3, intermediate_size=175,
    )  # fmt: skip
    out = tmp_path / "u2"
    prof = CompileProfile(name="tp", decode_batches=(1,), prefill_seqs=(16,), context=48)
    compile_bundle(path, out, load_target("cpu").model_copy(update={"gpus": 2}), prof, verify=True)
    ops = {o.name: o for o in _ops(out).ops}
    a0, a1 = ops["L0.attn@d0"], ops["L0.attn@d1"]
    assert (a0.attrs["heads"], a0.attrs["kv_heads"], a1.attrs["heads"], a1.attrs["kv_heads"]) == (
        4, 2, 2, 1,
    )  # fmt: skip
    at, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    qkv = ops["L0.q_proj@d1+L0.k_proj@d1+L0.v_proj@d1"].attrs["slices"]
    assert [s[1:] for s in qkv] == [
        [f"{at}.q_proj.weight", 0, 64, 96],
        [f"{at}.k_proj.weight", 0, 32, 48],
        [f"{at}.v_proj.weight", 0, 32, 48],
    ]
    assert ops["L0.o_proj@d0"].attrs["slices"][0][1:] == [f"{at}.o_proj.weight", 1, 0, 64]
    glu = ops["L0.gate_proj@d1+L0.up_proj@d1+L0.gated_mlp@d1"].attrs["slices"]
    assert [s[3:] for s in glu] == [[88, 175], [88, 175]]
    assert ops["L0.down_proj@d1"].attrs["slices"][0][1:] == [f"{mlp}.down_proj.weight", 1, 88, 175]
    from plow.emit.verify_source import verify_source

    assert verify_source(out, path).accepted
    # a pool of 1 head per layer cannot hold device 0's 2: refused at load, naming the op
    from dataclasses import replace

    from plow.runtime.cpu.bundle import Bundle, BundleRefused

    bundle = Bundle.open(out, verify=False)
    assert bundle.default_kv().kv_heads == 2
    with pytest.raises(BundleRefused, match=r"L0\.attn@d0.*2 key-value heads in pool layer 0"):
        bundle.plan(RUNG, kv=replace(bundle.default_kv(), kv_heads=1))
    want = hf_greedy(path, PROMPTS, NEW)
    reqs = [Request(tuple(p), NEW) for p in PROMPTS]
    assert generate(open_native(out, max_batch=1), reqs) == want
    assert generate(CpuModel.from_bundle(out, max_batch=1), reqs) == want


def test_heads_that_do_not_split_are_refused_in_one_line(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp3"
    res = CliRunner().invoke(
        app,
        ["compile", str(tiny_llama / "config.json"), "-o", str(out), "--plan-only",
         "--target", "h100", "--tp", "3"],
    )  # fmt: skip
    assert res.exit_code != 0
    lines = [x for x in res.output.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "4 attention heads and 2 key-value heads" in lines[0], res.output
    assert "tp 2 would" in lines[0] and not out.exists()


SMOLLM2 = Path(os.path.expanduser("~/.cache/plow/smollm2-135m-instruct"))


@pytest.mark.slow
@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason="SmolLM2-135M not cached")
@pytest.mark.skipif(
    os.environ.get("PLOW_TP_SMOLLM2") != "1",
    reason="about 50 s on 2 cores (over the suite's budget): PLOW_TP_SMOLLM2=1 runs it",
)
@pytest.mark.parametrize("tp", [2, 3])
def test_smollm2_tp_tokens_equal_transformers(tmp_path: Path, tp: int) -> None:
    """SmolLM2-135M (9 heads, 3 key-value heads) at --tp 2 (uneven: key-value heads 2 + 1,
    query heads 6 + 3) and --tp 3 (even), fused: the native executor's greedy tokens are
    transformers'. Opt-in (PLOW_TP_SMOLLM2=1)."""
    prof = CompileProfile(
        name="tp",
        decode_batches=(1,),
        prefill_seqs=(16,),
        context=64,
        prefill_budget_ns_per_token=20_000_000,  # this machine's bandwidth, 2 cores shared
    )
    out = tmp_path / f"smol{tp}"
    compile_bundle(SMOLLM2, out, load_target("cpu").model_copy(update={"gpus": tp}), prof)
    ops = _ops(out, "decode_b1_s64").ops
    assert {"linear_qkv", "linear_glu", "add_rmsnorm"} <= {o.kind for o in ops}
    heads = [(o.attrs["heads"], o.attrs["kv_heads"]) for o in ops if o.name.startswith("L0.attn@")]
    assert heads == ([(6, 2), (3, 1)] if tp == 2 else [(3, 1)] * 3)
    model = transformers.AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32)
    prompt = [1, 504, 3458, 282, 4235, 314]
    with torch.no_grad():
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    want = gen[0, len(prompt) :].tolist()
    got = generate(open_native(out, max_batch=1, verify=False), [Request(tuple(prompt), 8)])
    assert got == [want]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("PLOW_TP_CUDA_EMU") != "1",
    reason="builds the emulated CUDA kernel (17 s on 2 cores): PLOW_TP_CUDA_EMU=1 runs it",
)
def test_the_emulated_cuda_kernel_runs_a_tp2_plan_with_the_native_bits(
    tiny_llama: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """An h200 --tp 2 plan (2 x 4 SMs) run by device.cu's own code on CPU threads (the
    emulated driver of tests/runtime/test_cuda.py): the native executor's tokens and prefill
    logits, bit for bit (the allreduce tile over a CTA's threads is collective.h's sum)."""
    from plow.runtime.cuda import open_cuda
    from plow.runtime.native import NativeModel
    from tests.runtime.test_cuda import EMU_WORKERS, PROFILE, _tokens_and_logits

    path = tmp_path / "bundle"
    small = load_target("h200").model_copy(update={"workers": EMU_WORKERS // 2, "gpus": 2})
    compile_bundle(tiny_llama, path, small, PROFILE)  # unverified: 4 SMs are no shipped target
    assert any(o.kind == "allreduce" for o in _ops(path, "decode_b1_s96").ops)
    want, want_logits = _tokens_and_logits(NativeModel.from_bundle(path, max_batch=4, verify=False))
    for name in ("emulator", "cubin", "fresh_driver", "on_emulator"):
        request.getfixturevalue(name)
    got, got_logits = _tokens_and_logits(open_cuda(path, max_batch=4, verify=False))
    assert got == want
    assert np.array_equal(got_logits, want_logits)


def test_verify_source_checks_each_slice_against_the_checkpoint(
    tp2: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """`plow verify --source` compares every sliced weight with its recorded slice of the
    source tensor: the tp2 bundle equals its checkpoint; device 1's o_proj columns swapped for
    device 0's (same shape and dtype, hashes re-forged, certificates still accepting: the op
    table is untouched) is caught, naming the weight, the element and the source's."""
    from plow.bundle.manifest import WEIGHTS
    from plow.checkpoint.weights import read_header
    from plow.emit.verify_source import verify_source
    from tests.emit.bundle_edit import copy_bundle, reforge

    ok = verify_source(tp2, tiny_llama)
    assert ok.accepted and ok.weights == len(load_file(str(tp2 / WEIGHTS))), ok.problem
    b = copy_bundle(tp2, tmp_path / "b")
    o0, o1 = (f"model.layers.0.self_attn.o_proj.weight@tp{d}of2" for d in (0, 1))
    head = read_header(b / WEIGHTS)
    raw = bytearray((b / WEIGHTS).read_bytes())
    e0, e1 = head[o0], head[o1]
    raw[e1.offset : e1.offset + e1.nbytes] = raw[e0.offset : e0.offset + e0.nbytes]
    (b / WEIGHTS).write_bytes(bytes(raw))
    reforge(b)
    rep = verify_source(b, tiny_llama)
    src = "model.layers.0.self_attn.o_proj.weight"
    assert rep.problem is not None and rep.problem.startswith(f"weight {o1!r}: element [0, 0]")
    assert f"{src}[0, 32] under cols 32:64" in rep.problem, rep.problem
