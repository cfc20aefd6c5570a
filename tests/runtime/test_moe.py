"""Routed experts (qwen3_moe) on the `cpu` and `native` executors against transformers.

A tiny `Qwen3MoeForCausalLM` made by `plow.testing` (top-2 of 8 experts, a dense layer
between two routed ones, head_dim 24 != 64 / 4): greedy tokens equal transformers' (32
tokens x 4 prompts) from a certified bundle, logits within 1e-4 * max(1, |logit|); random
interleavings of the emulator give the same arena bytes; a row inside a batch of 8 rows that
route to different experts gives its tokens alone; an expert tile whose expert no row chose
computes nothing and still signals (every task of the step ran).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from plow.checkpoint import load_checkpoint
from plow.emit.bundle import compile_bundle
from plow.profile import CompileProfile
from plow.runtime.cpu import CpuModel, Request, RowInput, generate
from plow.runtime.native import open_native
from plow.target import load_target
from plow.testing import make_tiny_checkpoint
from tests.runtime.helpers import PROMPTS, assert_logits_close, prefill_logits

NEW = 32
PROFILE = CompileProfile(name="moe", decode_batches=(1, 8), prefill_seqs=(16,), context=96)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("moe")
    path = make_tiny_checkpoint("qwen3_moe", 0, root / "ckpt")
    bundle = root / "bundle"
    compile_bundle(path, bundle, load_target("cpu"), PROFILE, verify=True)
    ckpt = load_checkpoint(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = [ckpt.tokenizer.encode(p) for p in PROMPTS]
    refs = []
    for p in ids:
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        refs.append(gen[0, len(p) :].tolist())
    return {"path": path, "bundle": bundle, "ckpt": ckpt, "hf": hf, "ids": ids, "refs": refs}




def test_the_fixture_is_what_the_issue_asks_for(moe: dict) -> None:
    spec = moe["ckpt"].spec  # type: ignore[attr-defined]
    assert spec.moe is not None and (spec.moe.experts, spec.moe.top_k) == (8, 2)
    assert [lay.moe for lay in spec.layers] == [True, False, True]
    assert spec.head_dim * spec.num_heads != spec.hidden_size


@pytest.mark.slow
def test_bundle_greedy_tokens_equal_transformers(moe: dict) -> None:
    m = CpuModel.from_bundle(moe["bundle"], max_batch=8)
    got = generate(m, [Request(tuple(p), NEW) for p in moe["ids"]])  # type: ignore[attr-defined]
    assert got == moe["refs"]


def test_logits_within_1e_4_of_transformers(moe: dict) -> None:
    m = CpuModel.from_bundle(moe["bundle"], max_batch=8)
    for ids in moe["ids"]:  # type: ignore[attr-defined]  # all four prompts
        with torch.no_grad():
            want = moe["hf"](torch.tensor([ids])).logits[0, -1].numpy()  # type: ignore[operator]
        got = prefill_logits(m, ids)
        assert_logits_close(got, want)


@pytest.mark.slow
def test_native_greedy_tokens_and_logits_equal_transformers(moe: dict) -> None:
    m = open_native(moe["bundle"], max_batch=8)
    got = generate(m, [Request(tuple(p), NEW) for p in moe["ids"]])  # type: ignore[attr-defined]
    assert got == moe["refs"]
    for ids in moe["ids"]:  # type: ignore[attr-defined]  # all four prompts
        with torch.no_grad():
            want = moe["hf"](torch.tensor([ids])).logits[0, -1].numpy()  # type: ignore[operator]
        assert_logits_close(prefill_logits(m, ids), want)
    work = m.plan(m.decode_bucket(1))
    assert any(o.kind == "expert_linear" for o in work.ops)


def test_random_interleavings_give_identical_bytes(moe: dict) -> None:
    ckpt = moe["ckpt"]
    ids = moe["ids"][3]  # type: ignore[index]
    snaps = set()
    for seed in range(3):
        m = CpuModel(
            ckpt.spec, ckpt.weights, max_batch=1, max_context=96,  # type: ignore[attr-defined]
            mode="random", seed=seed, check=seed == 0,
        )  # fmt: skip
        toks = generate(m, [Request(tuple(ids), 4)])
        snaps.add((tuple(toks[0]), m.arena.snapshot()))
    assert len(snaps) == 1


@pytest.mark.slow
def test_a_row_in_a_batch_of_eight_gives_its_tokens_alone(moe: dict) -> None:
    rng = np.random.default_rng(7)
    extra = [rng.integers(3, 300, size=int(n)).tolist() for n in (5, 9, 13, 3)]
    prompts = [*moe["ids"], *extra]  # type: ignore[misc]
    # the rows' last prompt tokens route to different experts (transformers' router logits)
    chosen = set()
    for p in prompts:
        with torch.no_grad():
            out = moe["hf"](torch.tensor([p]), output_router_logits=True)  # type: ignore[operator]
        chosen.add(tuple(sorted(torch.topk(out.router_logits[0][-1], 2).indices.tolist())))
    assert len(chosen) >= 4
    m = CpuModel.from_bundle(moe["bundle"], max_batch=8)
    together = generate(m, [Request(tuple(p), 8) for p in prompts])
    solo = CpuModel.from_bundle(moe["bundle"], max_batch=8)
    for i, p in enumerate(prompts):  # every row alone on the cpu executor too
        assert generate(solo, [Request(tuple(p), 8)])[0] == together[i]
    # the native executor: every row of the batch of 8 gives its tokens alone
    nat = generate(open_native(moe["bundle"], max_batch=8), [Request(tuple(p), 8) for p in prompts])
    assert nat == together
    for i, p in enumerate(prompts):
        assert (
            generate(open_native(moe["bundle"], max_batch=8), [Request(tuple(p), 8)])[0] == nat[i]
        )


def test_idle_expert_tiles_compute_nothing_and_still_signal(moe: dict) -> None:
    ckpt = moe["ckpt"]
    m = CpuModel(ckpt.spec, ckpt.weights, max_batch=1, max_context=96)  # type: ignore[attr-defined]
    generate(m, [Request(tuple(moe["ids"][1]), 1)])  # type: ignore[index]
    plan = m.plan(m.decode_bucket(1))
    t = m.kv.new_table()
    m.kv.reserve(t, 2)
    m.write_inputs(plan, [RowInput(t, (0,), (5,))])
    m.machine.counts.clear()
    st = m.dispatch(plan)
    assert plan.schedule is not None
    assert st.tasks == len(plan.schedule.tasks)  # every task ran and signalled
    tiles = {
        top.name: len(top.tiles)
        for top in plan.tiles.ops
        if top.kind == "expert_linear"  # type: ignore[union-attr]
    }
    # one token, top-2 of 8: six experts' tiles are idle in each routed layer's two ops
    busy_per_op = {n: c * 2 // 8 for n, c in tiles.items()}
    idle = sum(tiles.values()) - sum(busy_per_op.values())
    assert m.machine.counts["experts.idle_tiles"] == idle
    assert m.machine.counts["experts.rows"] == sum(busy_per_op.values())


@pytest.mark.slow
def test_without_renormalisation_and_with_a_sparse_step_the_reference_matches(
    tmp_path: Path,
) -> None:
    """norm_topk_prob false (the top-k softmax weights as they are) and decoder_sparse_step 2
    (layers 1 and 3 routed): plow's reference forward against transformers."""
    from plow.runtime.reference import forward_logits

    path = make_tiny_checkpoint(
        "qwen3_moe", 1, tmp_path / "ckpt", num_hidden_layers=4, norm_topk_prob=False,
        decoder_sparse_step=2, mlp_only_layers=[],
    )  # fmt: skip
    ckpt = load_checkpoint(path)
    assert [lay.moe for lay in ckpt.spec.layers] == [False, True, False, True]
    assert ckpt.spec.moe is not None and not ckpt.spec.moe.norm_topk_prob
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = ckpt.tokenizer.encode(PROMPTS[3])
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    got = forward_logits(ckpt, ids)
    tol = 1e-4 * max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) <= tol


def test_an_expert_task_that_does_not_wait_for_the_router_is_rejected(
    moe: dict, tmp_path: Path
) -> None:
    """The router's weights gate every expert tile: a schedule whose expert task on another
    worker no longer waits on the router (files kept consistent, hashes re-forged) is
    rejected by checkpoint D's data flow, naming the two tasks."""
    from plow.emit.verify import verify_bundle
    from tests.emit.bundle_edit import copy_bundle, edit_rung, rungs

    b = copy_bundle(moe["bundle"], tmp_path / "b")  # type: ignore[arg-type]
    rung = next(r for r in rungs(b) if r["phase"] == "decode" and r["batch"] == 1)
    seen: list[str] = []

    def drop_router_wait(s: dict) -> None:
        t, names = s["tasks"], s["counters"]["name"]
        router = next(i for i, n in enumerate(t["name"]) if n.startswith("L0.router#"))
        done = names.index("L0.router.done")
        for i, n in enumerate(t["name"]):
            if n.startswith("L0.experts_gate_up#") and t["worker"][i] != t["worker"][router]:
                t["waits"][i] = [c for c in t["waits"][i] if c != done]
                seen.append(n)

    edit_rung(b, rung, schedule=drop_router_wait)
    assert seen
    report = verify_bundle(b, checkpoints=("D",))
    assert not report.accepted
    row = report.first_rejection()
    assert row is not None and row.checkpoint == "D"
    assert "L0.router#0" in row.reason and seen[0] in row.reason, row.reason
