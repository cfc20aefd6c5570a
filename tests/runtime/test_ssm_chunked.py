"""Chunked prefill of the recurrent layers (issue 18 items 2 and 3): Kimi Delta Attention and
Mamba-2's scan run a prompt of more than one token in the chunked form (the WY form of
transformers' `chunk_kimi_delta_attention`, the SSD form of `mamba2_chunk_scan`) on the `cpu`
executor, the reference and the native host kernels (kernels/kda.h, kernels/ssm.h), 16 tokens
of a row at a time; decode steps keep the recurrence.

- the numpy chunked forms equal the token-by-token recurrence (chunk 1) to fp32 rounding, for
  chunks that do and do not divide the row, a fresh and a carried state, a slice of heads;
- a 100-token prompt (kernel chunks of 16, the last of 4) prefilled in one call and in 24-token
  engine chunks (kernel chunks 16 + 8 each) on `cpu` and `native`: the last logits within
  1e-4 * max(1, |logit|) of transformers' and the greedy continuation transformers' tokens and
  the recurrence's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from plow.emit.bundle import compile_bundle  # noqa: E402
from plow.profile import CompileProfile  # noqa: E402
from plow.runtime import numpy_ops as K  # noqa: E402
from plow.runtime.cpu import CpuModel, Request, generate  # noqa: E402
from plow.target import load_target  # noqa: E402
from plow.testing import make_tiny_checkpoint  # noqa: E402
from plow.testing.fixtures import make_tiny_kimi_linear  # noqa: E402
from tests.runtime.helpers import assert_logits_close, prefill_logits  # noqa: E402

LONG = 100  # > K.CHUNK: the prompt spans 7 chunks of the chunked form
NEW = 6
PROFILE = CompileProfile(name="chunked", decode_batches=(1,), prefill_seqs=(16, 128), context=128)


def _close(got: np.ndarray, want: np.ndarray, rel: float = 1e-5) -> None:
    err = np.abs(got - want)
    assert np.all(err <= rel * np.maximum(1.0, np.abs(want))), float(err.max())


@pytest.mark.parametrize("fresh", [True, False])
def test_chunked_kda_is_the_recurrence(fresh: bool) -> None:
    rng = np.random.default_rng(1)
    h, d, n = 3, 12, 41
    attrs = {"heads": h, "head_dim": d, "eps": 1e-5, "head0": 1}  # heads 1..2 of 3
    x = rng.standard_normal((n, 3 * h * d)).astype(np.float32)
    f, gate = (rng.standard_normal((n, 2 * d)).astype(np.float32) for _ in range(2))
    beta = rng.standard_normal((n, 2)).astype(np.float32)
    dt_bias = rng.standard_normal(2 * d).astype(np.float32)
    a_log = (rng.standard_normal(2) * 0.5).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    state = rng.standard_normal((2, d, d)).astype(np.float32)
    args = (x, f, beta, gate, dt_bias, a_log, w, state, fresh, attrs)
    want, want_s = K.kda_row(*args, chunk=1)
    for chunk in (2, 7, 16, 64):
        got, got_s = K.kda_row(*args, chunk=chunk)
        _close(got, want)
        _close(got_s, want_s)
    assert np.array_equal(state, args[7])  # the caller's state is not written


@pytest.mark.parametrize("fresh", [True, False])
def test_chunked_ssm_scan_is_the_recurrence(fresh: bool) -> None:
    rng = np.random.default_rng(2)
    h, p, nn, g, n = 4, 6, 5, 2, 45
    attrs = {"heads": h, "head_dim": p, "state_size": nn, "groups": g, "dt_min": 0.0,
             "dt_max": None, "head0": 1}  # fmt: skip
    xbc = rng.standard_normal((n, h * p + 2 * g * nn)).astype(np.float32)
    dt_raw = rng.standard_normal((n, 2)).astype(np.float32)
    dt_bias, a_log, dd = (rng.standard_normal(2).astype(np.float32) for _ in range(3))
    state = rng.standard_normal((2, p, nn)).astype(np.float32)
    args = (xbc, dt_raw, dt_bias, a_log, dd, state, fresh, attrs)
    want, want_s = K.ssm_scan_row(*args, chunk=1)
    for chunk in (2, 7, 16, 64):
        got, got_s = K.ssm_scan_row(*args, chunk=chunk)
        _close(got, want)
        _close(got_s, want_s)


def _family(kind: str, root: Path) -> dict[str, object]:
    if kind == "kimi_linear":
        path = make_tiny_kimi_linear(0, root / "ckpt")
    else:
        path = make_tiny_checkpoint("mamba2", seed=3, out=root / "ckpt")
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bundle = root / "bundle"
    compile_bundle(path, bundle, load_target("cpu"), PROFILE, verify=True)
    rng = np.random.default_rng(5)
    vocab = int(hf.config.vocab_size)
    ids = [int(t) for t in rng.integers(3, vocab, LONG)]
    with torch.no_grad():
        seq, logits = list(ids), None
        for _ in range(NEW):  # transformers' greedy tokens by whole-sequence forwards
            out = hf(torch.tensor([seq])).logits[0].numpy()
            logits = out[LONG - 1] if logits is None else logits
            seq.append(int(out[-1].argmax()))
    return {"bundle": bundle, "ids": ids, "logits": logits, "refs": seq[LONG:]}


@pytest.fixture(scope="module", params=["kimi_linear", "mamba2"])
def fam(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _family(request.param, tmp_path_factory.mktemp(request.param))


def _cpu(bundle: Path) -> object:
    return CpuModel.from_bundle(bundle, max_batch=1)


def _native(bundle: Path) -> object:
    from plow.runtime.native import open_native

    return open_native(bundle, max_batch=1)


@pytest.mark.parametrize("open_model", [_cpu, _native], ids=["cpu", "native"])
def test_a_long_prompt_prefills_chunked_with_transformers_logits_and_tokens(
    fam: dict, open_model: object
) -> None:
    ids, bundle = fam["ids"], fam["bundle"]
    for chunk in (LONG, 24):  # one call, and 24-token engine chunks (kernel chunks 16 + 8)
        got = prefill_logits(open_model(bundle), ids, chunk=chunk)  # type: ignore[operator]
        assert_logits_close(got, fam["logits"])
    got_tokens = generate(open_model(bundle), [Request(tuple(ids), NEW)])  # type: ignore[operator]
    assert got_tokens == [fam["refs"]]


def test_the_recurrence_gives_the_same_tokens(fam: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cpu executor with the chunked form off (chunks of one token: the recurrence)
    continues the prompt with the chunked form's tokens, its logits within 1e-4."""
    ids, bundle = fam["ids"], fam["bundle"]
    chunked = prefill_logits(_cpu(bundle), ids, chunk=LONG)
    monkeypatch.setattr(K, "CHUNK", 1)
    recurrent = prefill_logits(_cpu(bundle), ids, chunk=LONG)
    assert_logits_close(recurrent, chunked)
    assert generate(_cpu(bundle), [Request(tuple(ids), NEW)]) == [fam["refs"]]  # type: ignore[arg-type]
