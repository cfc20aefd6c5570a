"""A --plan-only bundle on the CPU executor (plow/runtime/cpu/bundle.py): its plans run with
the checkpoint's weights supplied by the caller (what the harness does with the study's
bundles), give the same greedy tokens as the full bundle, and weights that do not match the
bundle's op tables are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plow.bundle.open import BundleRefused
from plow.checkpoint import load_checkpoint
from plow.emit.bundle import compile_bundle
from plow.profile import CompileProfile
from plow.runtime.cpu import CpuModel, Request, generate
from plow.runtime.cpu.bundle import Bundle, load_bundle_plan
from plow.target import load_target

CONTEXT = 96
PROFILE = CompileProfile(name="test", decode_batches=(1, 4), prefill_seqs=(32,), context=CONTEXT)
PROMPTS = [[5, 17, 93, 2, 44, 8, 61, 30, 12, 7, 99], [3, 250, 41, 6, 77], [120, 9, 9, 18]]


@pytest.fixture(scope="module")
def pair(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """The tiny llama compiled twice, verified: a full bundle and a plan-only one."""
    root = tmp_path_factory.mktemp("plan_only")
    src, tgt = tiny_checkpoints["llama"], load_target("cpu")
    compile_bundle(src, root / "full", tgt, PROFILE, verify=True)
    compile_bundle(src, root / "plan", tgt, PROFILE, verify=True, plan_only=True)
    return root / "full", root / "plan"


def test_plan_only_bundle_with_the_checkpoints_weights_gives_the_full_bundles_tokens(
    pair: tuple[Path, Path], tiny_checkpoints: dict[str, Path]
) -> None:
    full, plan = pair
    ckpt = load_checkpoint(tiny_checkpoints["llama"])
    with pytest.raises(BundleRefused, match="plan-only bundle has no weights"):
        Bundle.open(plan)
    b = Bundle.open(plan, weights=ckpt.weights)
    assert b.manifest.plan_only and b.verified
    # the caller's weights, and the fused bundle's re-laid-out ones derived from them
    layouts = json.loads((plan / "rewrites.json").read_text())["layouts"]
    assert {x["layout"] for x in layouts} == {"cat3", "interleave"}
    for lay in layouts:
        src = [np.asarray(ckpt.weights[s]) for s in lay["sources"]]
        w = np.asarray(b.weights[lay["weight"]])
        cat = lay["layout"] == "cat3"
        assert np.array_equal(w, np.concatenate(src) if cat else np.stack(src, 1).reshape(w.shape))
    name = "model.layers.0.self_attn.o_proj.weight"
    assert np.array_equal(b.weights[name], ckpt.weights[name])
    reqs = [Request(tuple(p), 8) for p in PROMPTS]
    got = generate(CpuModel.from_bundle(b), reqs)
    want = generate(CpuModel.from_bundle(full), reqs)
    assert got == want and all(len(t) == 8 for t in got)
    # the plan itself is the plan-only bundle's packet stream
    p = load_bundle_plan(plan, b.ladder[0], weights=ckpt.weights)
    assert p.wire is not None and p.source == str(plan)


def test_plan_only_bundle_refuses_weights_that_do_not_match(
    pair: tuple[Path, Path], tiny_checkpoints: dict[str, Path]
) -> None:
    _, plan = pair
    other = load_checkpoint(tiny_checkpoints["llama_tied_sharded"])  # 4 kv heads, tied
    with pytest.raises(BundleRefused, match="the weights do not match the bundle") as e:
        Bundle.open(plan, weights=other.weights)
    assert "\n" not in str(e.value)
    ckpt = load_checkpoint(tiny_checkpoints["llama"])
    w = {n: ckpt.weights[n] for n in ckpt.weights}
    name = next(n for n in w if n.endswith("o_proj.weight"))  # (q/k/v: read concatenated)
    w[name] = np.zeros((1, *w[name].shape[1:]), dtype=np.float32)
    with pytest.raises(BundleRefused, match=rf"{name!r} has shape \[1, "):
        Bundle.open(plan, weights=w)
    del w[name]
    with pytest.raises(BundleRefused, match=f"no tensor {name!r}"):
        load_bundle_plan(plan, "decode_b1_s96", weights=w)
    # a source of a re-laid-out weight (the fused bundle's cat3 of q, k, v) is named as such
    k = next(n for n in w if n.endswith("k_proj.weight"))
    del w[k]
    with pytest.raises(BundleRefused, match=rf"no tensor {k!r} \(a source of 'cat3\("):
        Bundle.open(plan, weights=w)
