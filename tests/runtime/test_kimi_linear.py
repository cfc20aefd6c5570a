"""Kimi-Linear (kimi_linear, issue 18 item 2) against transformers' own KimiLinearForCausalLM.

A tiny checkpoint made by `plow.testing` (layers KDA / MLA / KDA; KDA 2 heads of head_dim 12,
a 3-tap conv; NoPE MLA with 12 + 8 key columns and 10 value columns; layer 0 dense, layers
1-2 top-2 of 8 sigmoid experts in 2 groups of which 1 is eligible, one shared expert). The
family's spec reads both config layouts and refuses what it cannot honour; plow's reference
forward, the `cpu` and the `native` executors (from a bundle certified A-F) give
transformers' greedy tokens and logits within 1e-4 * max(1, |logit|); checkpoint A names an
edited kda op, D a consumer of kda no longer ordered after it. transformers runs its torch
fallbacks of the fla / causal-conv1d kernels (neither package is installed).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from plow.checkpoint import load_checkpoint  # noqa: E402
from plow.checkpoint.families import kimi_linear  # noqa: E402
from plow.emit.bundle import compile_bundle  # noqa: E402
from plow.emit.verify import verify_bundle  # noqa: E402
from plow.graph import Bucket, OpKind, TensorRole, build_graph  # noqa: E402
from plow.profile import CompileProfile  # noqa: E402
from plow.runtime.cpu import CpuModel, Request, generate  # noqa: E402
from plow.runtime.reference import forward_logits, generate_greedy  # noqa: E402
from plow.target import load_target  # noqa: E402
from plow.testing.fixtures import make_tiny_kimi_linear  # noqa: E402
from tests.runtime.helpers import (  # noqa: E402
    PROMPTS,
    assert_logits_close,
    prefill_logits,
    rewire_wait,
)

NEW = 32
FAST = 8  # tokens per prompt in the fast tests (2 prompts; the 32 x 4 sweep is slow)
PROFILE = CompileProfile(name="kimi", decode_batches=(1, 8), prefill_seqs=(16,), context=96)


def _hf(path: Path) -> object:
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _assert_hf_greedy(hf: object, prompt: list[int], ours: list[int]) -> None:
    """`ours` are transformers' greedy tokens: each is the argmax of transformers' logits
    after the prompt and our earlier tokens (one forward of the whole sequence; by induction
    the same tokens as `generate`, without its slow per-token torch fallback loop)."""
    logits = _hf_logits(hf, prompt + ours[:-1])[len(prompt) - 1 :]
    want = [int(i) for i in logits.argmax(axis=-1)]
    assert ours == want, f"ours {ours}\ntransformers' {want}"


def _hf_logits(hf: object, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()  # type: ignore[operator]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("kimi")
    path = make_tiny_kimi_linear(0, root / "ckpt")
    ckpt = load_checkpoint(path)
    ids = [ckpt.tokenizer.encode(p) for p in PROMPTS]
    bundle = root / "bundle"
    compile_bundle(path, bundle, load_target("cpu"), PROFILE, verify=True)
    return {"root": root, "path": path, "ckpt": ckpt, "hf": _hf(path), "ids": ids, "bundle": bundle}


def test_the_fixture_is_what_the_issue_asks_for(kimi: dict) -> None:
    spec = kimi["ckpt"].spec  # type: ignore[attr-defined]
    assert [lay.mixer for lay in spec.layers] == ["kda", "attention", "kda"]
    assert [lay.moe for lay in spec.layers] == [False, True, True]
    k, m, moe = spec.kda, spec.mla, spec.moe
    assert (k.heads, k.head_dim, k.conv_kernel) == (2, 12, 3)
    assert m is not None and not m.rotate and m.q_lora_rank is None
    assert (moe.experts, moe.top_k, moe.n_group, moe.topk_group) == (8, 2, 2, 1)
    assert moe.shared_intermediate == 24 and moe.scoring == "sigmoid"
    g = build_graph(spec, Bucket.decode(2, 32))
    kinds = [op.kind for op in g.ops]
    assert kinds.count(OpKind.kda) == 2 and kinds.count(OpKind.attention) == 1
    assert OpKind.rope not in kinds  # Kimi's MLA is NoPE
    states = {n: t.shape for n, t in g.tensors.items() if t.role is TensorRole.state}
    assert states["L0.kda_state"] == (2, 2, 12, 12) and states["L2.conv_state"] == (2, 72, 2)


def test_spec_reads_both_layouts_and_refuses_what_it_cannot_honour(kimi: dict) -> None:
    saved = json.loads((kimi["path"] / "config.json").read_text())  # type: ignore[operator]
    # Moonshot's layout: only linear_attn_config and the attribute-map names
    moonshot = {
        k: v
        for k, v in saved.items()
        if k not in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads")
        and k != "linear_conv_kernel_dim"
    }
    assert "num_experts" in moonshot and "num_local_experts" not in moonshot
    # transformers' own names, no linear_attn_config
    own = {k: v for k, v in saved.items() if k != "linear_attn_config"}
    for alias, field in (
        ("num_experts", "num_local_experts"),
        ("num_experts_per_token", "num_experts_per_tok"),
        ("num_expert_group", "n_group"),
    ):
        own[field] = own.pop(alias)
    a, b = kimi_linear.to_spec(moonshot), kimi_linear.to_spec(own)
    assert a == b == kimi["ckpt"].spec  # type: ignore[attr-defined]
    for bad, field in (
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        ({"num_expert_group": 3}, "n_group"),
        ({"layer_types": ["linear_attention", "sliding", "full_attention"]}, "layer_types"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ):
        with pytest.raises(ValueError, match=field):
            kimi_linear.to_spec({**moonshot, **bad})


def test_reference_forward_and_greedy_equal_transformers(kimi: dict) -> None:
    ckpt, hf = kimi["ckpt"], kimi["hf"]
    ids = kimi["ids"][0]  # type: ignore[index]
    assert_logits_close(forward_logits(ckpt, ids)[-1], _hf_logits(hf, ids)[-1])  # type: ignore[arg-type]
    _assert_hf_greedy(hf, ids, generate_greedy(ckpt, ids, FAST))  # type: ignore[arg-type]


def test_bundle_certifies_with_every_checkpoint(kimi: dict) -> None:
    report = verify_bundle(kimi["bundle"])  # type: ignore[arg-type]
    assert report.accepted, report.first_rejection()
    verdicts = {r.checkpoint: r.verdict for r in report.rows}
    assert all(verdicts.get(c) == "accept" for c in "ABCDEF"), verdicts


def _check_executor(kimi: dict, open_model: object, new: int, prompts: int) -> None:
    """Greedy tokens of the first `prompts` prompts in one batch; the logits after the
    59-token prompt prefilled in 16-token chunks (the state carried across chunks)."""
    m = open_model(kimi["bundle"])  # type: ignore[operator]
    ids = kimi["ids"][:prompts]
    got = generate(m, [Request(tuple(p), new) for p in ids])
    for p, ours in zip(ids, got, strict=True):
        assert len(ours) == new
        _assert_hf_greedy(kimi["hf"], p, ours)
    long = kimi["ids"][3]
    assert len(long) == 59
    got_l = prefill_logits(open_model(kimi["bundle"]), long)  # type: ignore[operator]
    assert_logits_close(got_l, _hf_logits(kimi["hf"], long)[-1])


def _cpu(bundle: Path) -> CpuModel:
    return CpuModel.from_bundle(bundle, max_batch=8)


def test_cpu_greedy_tokens_and_logits_equal_transformers(kimi: dict) -> None:
    _check_executor(kimi, _cpu, FAST, 2)


def _native(bundle: Path) -> object:
    from plow.runtime.native import open_native

    return open_native(bundle, max_batch=8)


def test_native_greedy_tokens_and_logits_equal_transformers(kimi: dict) -> None:
    _check_executor(kimi, _native, FAST, 2)


@pytest.mark.slow
def test_cpu_and_native_32_tokens_x_4_prompts(kimi: dict) -> None:
    _check_executor(kimi, _cpu, NEW, 4)
    _check_executor(kimi, _native, NEW, 4)


def test_an_edited_kda_op_is_rejected_by_checkpoint_a(kimi: dict, tmp_path: Path) -> None:
    """kda is checked as an instruction of its own kind against the graph config.json lowers
    to: its forget gate and output gate operands swapped (same shapes, so B and the shapes
    cannot tell) are named in A's reason."""
    from tests.emit.bundle_edit import copy_bundle, edit_rung, first_rung

    b = copy_bundle(kimi["bundle"], tmp_path / "b")

    def swap(doc: dict) -> None:
        op = next(o for o in doc["ops"] if o["name"] == "L2.kda")
        op["inputs"][1], op["inputs"][3] = op["inputs"][3], op["inputs"][1]

    edit_rung(b, first_rung(b), ops=swap)
    rows = verify_bundle(b).rows
    bad = [r.reason for r in rows if r.checkpoint == "A" and r.rejected]
    assert bad and "L2.kda" in bad[0], [(r.checkpoint, r.verdict, r.reason) for r in rows]


def test_a_freed_request_frees_its_state_slot_and_prefix_caching_is_off(kimi: dict) -> None:
    from plow.runtime.cpu.engine import CpuEngine
    from plow.runtime.engine import PrefillChunk

    m = _cpu(kimi["bundle"])
    eng = CpuEngine(m)  # type: ignore[arg-type]
    assert m.kv.free_state_slots == set(range(8))
    long = list(range(3, 40))  # two full 16-token blocks a cache could share
    eng.add(0, long)
    tok = int(np.argmax(eng.prefill([PrefillChunk(0, len(long))])[0]))
    eng.decode([0], [tok])
    assert (eng.kv_usage().state_slots_used, eng.kv_usage().state_slots_total) == (1, 8)
    eng.free(0)
    assert m.kv.free_state_slots == set(range(8)) and eng.kv_usage().state_slots_used == 0
    eng.add(2, long)  # the same prompt again: nothing may be skipped (no state snapshot)
    assert eng.prefix_tokens_skipped == 0


def test_o_proj_no_longer_waiting_for_kda_is_rejected_by_d(kimi: dict, tmp_path: Path) -> None:
    """L2.o_proj's tasks wait on the counter kda's own tasks wait on instead of kda's, with
    the schedule's edges from kda into them dropped: only the derived data flow (kda's rule:
    its tiles write their heads' columns of L2.kda) can see o_proj read them unordered."""
    from tests.emit.bundle_edit import copy_bundle, edit_rung, rungs

    b = copy_bundle(kimi["bundle"], tmp_path / "b")
    rung = next(r for r in rungs(b) if r["name"] == "decode_b8_s96")
    edit_rung(b, rung, schedule=rewire_wait("L2.o_proj", "L2.kda.done", "L2.kda_conv.done"))
    rep = verify_bundle(b, checkpoints=("B", "D"))
    bad = [r for r in rep.rows if r.rejected]
    assert [r.checkpoint for r in bad] == ["D"], [(r.checkpoint, r.reason) for r in bad]
    assert "(L2.kda#" in (bad[0].reason or ""), bad[0].reason


def test_a_kda_op_whose_heads_do_not_match_its_tiles_is_rejected_by_b(
    kimi: dict, tmp_path: Path
) -> None:
    """4 heads of 6 columns instead of 2 of 12 (the same output width): checkpoint B's kda
    rule (batch rows x heads) gives 4 heads where the plan's axis says 2."""
    from tests.emit.bundle_edit import copy_bundle, edit_rung, first_rung

    b = copy_bundle(kimi["bundle"], tmp_path / "b")

    def edit(doc: dict) -> None:
        op = next(o for o in doc["ops"] if o["name"] == "L0.kda")
        op["attrs"].update(heads=4, head_dim=6)

    edit_rung(b, first_rung(b), ops=edit)
    bad = [r for r in verify_bundle(b, checkpoints=("B",)).rows if r.rejected]
    assert bad and all(r.checkpoint == "B" for r in bad), [(r.checkpoint, r.reason) for r in bad]
    assert 'op "L0.kda" axis 1 (cols): extent 2 but the tensors\' shapes give 4' in (
        bad[0].reason or ""
    ), bad[0].reason
