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
    for ids in PROMPTS[:2]:
        assert generate_greedy(ck, ids, 12) == _hf_greedy(hf, ids, 12)
