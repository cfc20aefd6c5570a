"""The CUDA source's fused linears (linear_qkv, linear_glu) on the warp dots and on tensor cores.

kernels/device.cu runs a fused linear the way it runs a linear: warps stream four weight rows
at once (the same dots as the host's fused.h, so the bits are the native executor's), or, for
bf16 weights, mma.sync fragments whose linear_glu pairs (gate row 2n, up row 2n + 1) meet in
one lane by a shuffle (split k: both rows' dots go to the partial, the merge applies the glu).
Both run here on the emulation build (device.cu's own code on CPU
threads, tests/runtime/test_cuda.py's fake driver); nothing here needs a GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plow.emit.bundle import compile_bundle
from plow.target import load_target
from tests.runtime.test_cuda import emulator, fresh_driver, on_emulator  # noqa: F401
from tests.runtime.test_fused import cubin  # noqa: F401

FUSED_LINEARS = {"linear_qkv", "linear_glu"}


@pytest.fixture(scope="module")
def fused_bf16_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fused plan of a bf16 tiny llama on an 8-SM h200 (unverified: no shipped target)."""
    from plow.testing import make_tiny_checkpoint
    from tests.runtime.test_cuda import EMU_WORKERS, PROFILE

    root = tmp_path_factory.mktemp("fused-bf16")
    ckpt = make_tiny_checkpoint("llama", 5, root / "ckpt", dtype="bfloat16")
    small = load_target("h200").model_copy(update={"workers": EMU_WORKERS})
    out = root / "bundle"
    compile_bundle(ckpt, out, small, PROFILE.model_copy(update={"fuse": True}))
    return out


@pytest.mark.usefixtures("on_emulator")
def test_the_fused_bf16_plan_on_the_warp_dots_gives_the_native_bits(
    fused_bf16_bundle: Path,
) -> None:
    from plow.runtime.cuda import open_cuda
    from plow.runtime.native import NativeModel
    from tests.runtime.test_cuda import _tokens_and_logits

    want, want_logits = _tokens_and_logits(
        NativeModel.from_bundle(fused_bf16_bundle, max_batch=4, verify=False)
    )
    got, got_logits = _tokens_and_logits(
        open_cuda(fused_bf16_bundle, max_batch=4, verify=False, tensor_cores=False)
    )
    assert got == want
    assert np.array_equal(got_logits, want_logits)


@pytest.mark.usefixtures("on_emulator")
def test_fused_linears_run_on_emulated_tensor_cores_within_the_scalar_paths_tolerance(
    fused_bf16_bundle: Path,
) -> None:
    """Every bf16 linear_qkv and linear_glu is marked for tensor cores, and the result is the
    scalar path's within 1e-3 (another summation order: not its bits) with the same tokens."""
    from plow.bundle.files import OpTable
    from plow.runtime.cuda import open_cuda
    from tests.runtime.test_cuda import _tokens_and_logits

    scalar = open_cuda(fused_bf16_bundle, max_batch=4, verify=False, tensor_cores=False)
    want, want_logits = _tokens_and_logits(scalar)
    tc = open_cuda(fused_bf16_bundle, max_batch=4, verify=False, tensor_cores=True)
    got, got_logits = _tokens_and_logits(tc)
    bucket = tc.decode_bucket(4)
    ops = OpTable.model_validate_json(
        (fused_bf16_bundle / "plan" / f"{bucket.name}.ops.json").read_bytes()
    ).ops
    kinds = [o.kind for o in ops]
    assert set(kinds) >= FUSED_LINEARS
    linears = sum(k in FUSED_LINEARS | {"linear", "lm_head"} for k in kinds)
    # R19's lm_head (the final norm in its prologue) runs kernels/fused_lm.h's tile instead
    linears -= sum(o.kind == "lm_head" and len(o.inputs) == 3 for o in ops)
    assert tc.cuda._rung(tc.plan(bucket)).tensor_core_ops == linears
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-3, atol=1e-3)
    assert not np.array_equal(got_logits, want_logits)  # it did run the other path
    assert got == want


@pytest.mark.usefixtures("on_emulator")
def test_a_split_fused_plan_on_the_warp_dots_gives_the_native_bits(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Cheap tiles on 16 SMs split add_rmsnorm's row (partial sums of squares + a merge):
    the warp-per-row tile writes the partials fused.h writes, bit for bit."""
    from plow.bundle.files import OpTable
    from plow.runtime.cuda import open_cuda
    from plow.runtime.native import NativeModel
    from tests.runtime.test_cuda import EMU_WORKERS, PROFILE, _tokens_and_logits

    split = load_target("h200").model_copy(
        update={"workers": 2 * EMU_WORKERS, "tile_overhead_ns": 10}
    )
    out = tmp_path / "bundle"
    compile_bundle(tiny_checkpoints["llama"], out, split, PROFILE.model_copy(update={"fuse": True}))
    ops = OpTable.model_validate_json((out / "plan" / "decode_b4_s96.ops.json").read_bytes()).ops
    norms = [o for o in ops if o.kind == "add_rmsnorm"]
    assert norms and any(a.steps > 1 for o in norms for a in o.axes[1:2])
    want, want_logits = _tokens_and_logits(NativeModel.from_bundle(out, max_batch=4, verify=False))
    got, got_logits = _tokens_and_logits(
        open_cuda(out, max_batch=4, verify=False, tensor_cores=False)
    )
    assert got == want
    assert np.array_equal(got_logits, want_logits)


@pytest.fixture(scope="module")
def split_bf16_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fused plan of a bf16 tiny llama for 64 SMs with cheap tiles (its fused matmuls split
    k); made before the emulator replaces the driver import."""
    from plow.testing import make_tiny_checkpoint
    from tests.runtime.test_cuda import PROFILE

    root = tmp_path_factory.mktemp("fused-bf16-split")
    ckpt = make_tiny_checkpoint("llama", 5, root / "ckpt", dtype="bfloat16")
    wide = load_target("h200").model_copy(update={"workers": 64, "tile_overhead_ns": 10})
    compile_bundle(ckpt, root / "bundle", wide, PROFILE.model_copy(update={"fuse": True}))
    return root / "bundle"


@pytest.mark.usefixtures("on_emulator")
def test_split_k_fused_bf16_linears_on_tensor_cores_and_warp_dots(
    split_bf16_bundle: Path,
) -> None:
    """A bf16 fused plan for 64 SMs with cheap tiles splits linear_glu's and linear_qkv's k:
    the warp dots write fused.h's partials (the native bits), and the tensor-core tiles'
    partials (gate and up rows kept apart, not shuffled into act(gate) * up) merge to the
    scalar path's logits within 1e-3 with the same tokens."""
    from plow.bundle.files import OpTable
    from plow.runtime.cuda import open_cuda
    from plow.runtime.native import NativeModel
    from tests.runtime.test_cuda import _tokens_and_logits

    out = split_bf16_bundle
    ops = OpTable.model_validate_json((out / "plan" / "decode_b4_s96.ops.json").read_bytes()).ops
    assert {o.kind for o in ops if o.partial} >= FUSED_LINEARS
    want, want_logits = _tokens_and_logits(NativeModel.from_bundle(out, max_batch=4, verify=False))
    scalar = open_cuda(out, max_batch=4, verify=False, tensor_cores=False)
    got, got_logits = _tokens_and_logits(scalar)
    assert got == want
    assert np.array_equal(got_logits, want_logits)
    tc, tc_logits = _tokens_and_logits(open_cuda(out, max_batch=4, verify=False, tensor_cores=True))
    np.testing.assert_allclose(tc_logits, want_logits, rtol=1e-3, atol=1e-3)
    assert not np.array_equal(tc_logits, want_logits)  # it did run the other path
    assert tc == want


@pytest.mark.usefixtures("on_emulator")
def test_an_op_kind_without_a_device_tile_stops_the_step_naming_it(
    fused_bf16_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record whose op kind the device build has no tile for (here: rope's kind number
    replaced by 99 after lowering) stops the step with a one-line error naming the packet and
    the kind, instead of leaving the op's words unwritten (how a dropped dispatch line once
    went unnoticed)."""
    import plow.runtime.cuda.model as cuda_model
    from plow.runtime.cpu import Request, generate
    from plow.runtime.cuda import CudaStepError, open_cuda
    from plow.runtime.native.library import KINDS, PlowOp

    real = cuda_model.lower

    def lower_with_unknown_rope(*a: object, **k: object) -> object:
        low = real(*a, **k)  # type: ignore[arg-type]
        ops = (PlowOp * max(1, low.plan.n_ops)).from_address(low.plan.ops)
        for op in ops:
            if op.kind == KINDS["rope"]:
                op.kind = 99
        return low

    monkeypatch.setattr(cuda_model, "lower", lower_with_unknown_rope)
    m = open_cuda(fused_bf16_bundle, max_batch=4, verify=False, tensor_cores=False, timeout_ms=300)
    with pytest.raises(
        CudaStepError, match=r"packet \d+ \(worker \d+\): op kind '\?' \(99\) has no tile"
    ):
        generate(m, [Request((1, 2, 3), 2)])
