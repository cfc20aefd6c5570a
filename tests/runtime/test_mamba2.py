"""Mamba-2 (issue 18 item 3): the family's spec, the graph's ssm ops and the executors against
transformers' own Mamba2ForCausalLM on a tiny non-default checkpoint (4 groups of 2 heads,
head_dim 12, state 8, conv 3 taps, untied lm_head)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from plow.checkpoint import load_checkpoint  # noqa: E402
from plow.checkpoint.families import mamba2  # noqa: E402
from plow.errors import ConfigError  # noqa: E402
from plow.graph import Bucket, OpKind, TensorRole, build_graph  # noqa: E402
from plow.runtime.reference import ReferenceSession, generate_greedy  # noqa: E402
from plow.testing.fixtures import make_tiny_checkpoint  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [1, 2], [300, 299, 12, 12, 12, 60, 61, 62, 63, 64, 65], [9]]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("mamba2", seed=3, out=tmp_path_factory.mktemp("mamba2"))


@pytest.fixture(scope="module")
def hf(ckpt_dir: Path) -> object:
    transformers.logging.set_verbosity_error()
    return transformers.Mamba2ForCausalLM.from_pretrained(ckpt_dir).eval()


def _hf_greedy(hf: object, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(  # type: ignore[attr-defined]
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return [int(t) for t in out[0, len(ids) :]]


def _hf_logits(hf: object, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()  # type: ignore[operator]


def _close(ours: np.ndarray, ref: np.ndarray) -> None:
    tol = 1e-4 * np.maximum(1.0, np.abs(ref))
    bad = np.abs(ours - ref) > tol
    assert not bad.any(), f"max error {np.abs(ours - ref).max()} at {np.argwhere(bad)[0]}"


def test_spec_reads_both_layouts_and_refuses_what_it_cannot_honour() -> None:
    base = dict(
        model_type="mamba2",
        vocab_size=100,
        hidden_size=32,
        num_heads=8,
        head_dim=8,
        n_groups=2,
        state_size=4,
        num_hidden_layers=2,
    )
    five = mamba2.to_spec({**base, "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    four = mamba2.to_spec({**base, "time_step_limit": [0.0, math.inf], "rms_norm": True})
    assert five == four and five.ssm is not None and five.ssm.dt_max == math.inf
    assert five.ssm.conv_dim == 64 + 2 * 2 * 4 and five.ssm.proj_size == 64 + 80 + 8
    assert all(layer.mixer == "ssm" for layer in five.layers)
    for bad, field in (
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rms_norm": False}, "rms_norm"),
        ({"norm_before_gate": True}, "norm_before_gate"),
        ({"expand": 3}, "expand"),
        ({"n_groups": 3}, "n_groups"),
        ({"time_step_limit": [0.5, 0.1]}, "time_step_limit"),
    ):
        with pytest.raises(ValueError, match=field):
            mamba2.to_spec({**base, **bad})


def test_config_error_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "mamba2", "hidden_act": "relu"}')
    with pytest.raises(ConfigError, match="config.json.*hidden_act"):
        load_checkpoint(tmp_path)


def test_graph_has_state_tensors_and_ssm_ops(ckpt_dir: Path) -> None:
    spec = load_checkpoint(ckpt_dir).spec
    g = build_graph(spec, Bucket.prefill(2, 8, 64))
    kinds = [op.kind for op in g.ops]
    assert kinds.count(OpKind.ssm_scan) == spec.num_layers == kinds.count(OpKind.ssm_conv)
    assert OpKind.attention not in kinds
    state = {n: t.shape for n, t in g.tensors.items() if t.role is TensorRole.state}
    assert state["L0.ssm_state"] == (2, 8, 12, 8) and state["L0.conv_state"] == (2, 160, 2)


def test_reference_prefill_logits_match_transformers(ckpt_dir: Path, hf: object) -> None:
    ck = load_checkpoint(ckpt_dir)
    ids = PROMPTS[2]
    session = ReferenceSession(ck.spec, ck.weights, context=64)
    _close(session.step(ids), _hf_logits(hf, ids))


def test_reference_chunked_prefill_continues_the_state(ckpt_dir: Path, hf: object) -> None:
    """A prompt fed in three chunks (state carried between them) gives the one-shot logits."""
    ck = load_checkpoint(ckpt_dir)
    ids = PROMPTS[2]
    session = ReferenceSession(ck.spec, ck.weights, context=64)
    parts = [session.step(ids[:4]), session.step(ids[4:5]), session.step(ids[5:])]
    _close(np.concatenate(parts), _hf_logits(hf, ids))


def test_reference_greedy_matches_transformers(ckpt_dir: Path, hf: object) -> None:
    ck = load_checkpoint(ckpt_dir)
    assert generate_greedy(ck, PROMPTS[0], 8) == _hf_greedy(hf, PROMPTS[0], 8)


# -- the cpu executor (the checking emulator: counters, arena, tile kernels) -------------------


def _cpu_model(ckpt_dir: Path, **kw: object) -> object:
    from plow.runtime.cpu.model import CpuModel

    ck = load_checkpoint(ckpt_dir)
    return CpuModel(ck.spec, ck.weights, max_batch=4, max_context=64, **kw)  # type: ignore[arg-type]


def _cpu_greedy(model: object, prompts: list[list[int]], n: int) -> list[list[int]]:
    from plow.runtime.cpu.generate import Request, generate

    return generate(model, [Request(tuple(p), n) for p in prompts])  # type: ignore[arg-type]


def test_cpu_executor_logits_match_transformers(ckpt_dir: Path, hf: object) -> None:
    """Prefill then decode through the engine (the state carried in the arena's state region
    by slot), each step's logits against transformers' logits of the whole sequence."""
    from plow.runtime.cpu.engine import CpuEngine
    from plow.runtime.engine import PrefillChunk

    eng = CpuEngine(_cpu_model(ckpt_dir, check=True))  # type: ignore[arg-type]
    ids = PROMPTS[0]
    eng.add(1, ids)
    rows = [eng.prefill([PrefillChunk(1, len(ids))])[0]]
    seq = list(ids)
    for _ in range(5):
        seq.append(int(np.argmax(rows[-1])))
        rows.append(eng.decode([1], [seq[-1]])[0])
    ref = _hf_logits(hf, seq)[len(ids) - 1 :]
    _close(np.stack(rows), ref)


def test_cpu_executor_greedy_matches_transformers_short(ckpt_dir: Path, hf: object) -> None:
    got = _cpu_greedy(_cpu_model(ckpt_dir), PROMPTS[:2], 8)
    assert got == [_hf_greedy(hf, p, 8) for p in PROMPTS[:2]]


@pytest.mark.slow
def test_cpu_and_native_greedy_match_transformers_32x4(
    ckpt_dir: Path, bundle: Path, hf: object
) -> None:
    """The issue's sweep: 32 tokens x 4 prompts, batched, on the cpu executor (compiled in
    memory) and the native executor (from the certified bundle)."""
    want = [_hf_greedy(hf, p, 32) for p in PROMPTS]
    assert _cpu_greedy(_cpu_model(ckpt_dir), PROMPTS, 32) == want
    assert _cpu_greedy(_native_model(bundle), PROMPTS, 32) == want


def test_cpu_batch_of_two_equals_each_alone(ckpt_dir: Path) -> None:
    m = _cpu_model(ckpt_dir)
    pair = _cpu_greedy(m, [PROMPTS[0], PROMPTS[2]], 10)
    alone = [_cpu_greedy(m, [p], 10)[0] for p in (PROMPTS[0], PROMPTS[2])]
    assert pair == alone


def test_freed_request_frees_its_state_slot_and_prefix_cache_is_off(ckpt_dir: Path) -> None:
    from plow.runtime.cpu.engine import CpuEngine
    from plow.runtime.engine import PrefillChunk

    m = _cpu_model(ckpt_dir)
    eng = CpuEngine(m)  # type: ignore[arg-type]
    kv = m.kv  # type: ignore[attr-defined]
    assert kv.free_state_slots == {0, 1, 2, 3}
    long = list(range(3, 40))  # two full 16-token blocks a cache could share
    eng.add(0, long)
    tok = int(np.argmax(eng.prefill([PrefillChunk(0, len(long))])[0]))
    eng.decode([0], [tok])  # the engine offers the prompt's blocks to the prefix cache here
    assert kv.free_state_slots == {1, 2, 3}
    assert (eng.kv_usage().state_slots_used, eng.kv_usage().state_slots_total) == (1, 4)
    eng.free(0)
    assert kv.free_state_slots == {0, 1, 2, 3}
    assert eng.kv_usage().state_slots_used == 0  # what plow serve's metric reports
    eng.add(2, long)  # the same prompt again: nothing may be skipped (no state snapshot)
    assert eng.prefix_tokens_skipped == 0


# -- the bundle: compile, certify (oracle B-F), run from its files --------------------------------


@pytest.fixture(scope="module")
def bundle(ckpt_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plow.emit.bundle import compile_bundle
    from plow.profile import CompileProfile
    from plow.target import load_target

    out = tmp_path_factory.mktemp("m2bundle") / "b"
    profile = CompileProfile(name="m2", decode_batches=(1, 2), prefill_seqs=(16,), context=64)
    compile_bundle(ckpt_dir, out, load_target("cpu"), profile, verify=True)
    return out


def test_bundle_certifies_with_every_checkpoint(bundle: Path) -> None:
    from plow.emit.verify import verify_bundle

    report = verify_bundle(bundle)
    assert report.accepted, report.first_rejection()
    seen = {r.checkpoint for r in report.rows}  # type: ignore[attr-defined]
    assert {"B", "C", "D", "E", "F"} <= seen
    ops = (bundle / "plan").glob("*.ops.json")
    text = "".join(p.read_text() for p in ops)
    assert '"ssm_scan"' in text and '"role":"state"' in text.replace(" ", "")


def test_cpu_executor_from_the_bundle_matches_transformers(bundle: Path, hf: object) -> None:
    from plow.runtime.cpu.model import CpuModel

    m = CpuModel.from_bundle(bundle, check=True)
    got = _cpu_greedy(m, [PROMPTS[0], PROMPTS[2]], 8)
    assert got == [_hf_greedy(hf, p, 8) for p in (PROMPTS[0], PROMPTS[2])]


# -- the native executor (kernels/ssm.h through the persistent kernel) --------------------------


def _native_model(bundle: Path) -> object:
    from plow.runtime.native.library import available
    from plow.runtime.native.model import NativeModel

    if not available():
        pytest.skip("no native build (make native)")

    return NativeModel.from_bundle(bundle)


def test_native_executor_logits_and_greedy_match_transformers(bundle: Path, hf: object) -> None:
    from plow.runtime.cpu.engine import CpuEngine
    from plow.runtime.engine import PrefillChunk

    m = _native_model(bundle)
    eng = CpuEngine(m)  # type: ignore[arg-type]
    ids = PROMPTS[2]
    eng.add(0, ids)
    rows = [eng.prefill([PrefillChunk(0, len(ids))])[0]]
    seq = list(ids)
    for _ in range(4):
        seq.append(int(np.argmax(rows[-1])))
        rows.append(eng.decode([0], [seq[-1]])[0])
    _close(np.stack(rows), _hf_logits(hf, seq)[len(ids) - 1 :])
    eng.free(0)
    pair = _cpu_greedy(m, [PROMPTS[0], PROMPTS[1]], 8)
    assert pair == [_hf_greedy(hf, p, 8) for p in (PROMPTS[0], PROMPTS[1])]
