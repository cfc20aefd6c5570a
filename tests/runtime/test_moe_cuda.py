"""Routed experts in the CUDA source (kernels/device.cu + kernels/moe.h): an h200 plan of the
tiny qwen3_moe for 8 SMs, run by the kernel's own code on CPU threads (the emulation build
of tests/runtime/test_cuda.py), gives the native executor's tokens and logits bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plow.emit.bundle import compile_bundle
from plow.runtime.native import NativeModel
from plow.target import load_target
from plow.testing import make_tiny_checkpoint
from tests.runtime.test_cuda import (  # noqa: F401  (fixtures)
    EMU_WORKERS,
    PROFILE,
    EmulatedGpu,
    _tokens_and_logits,
    emulator,
    fresh_driver,
    on_emulator,
)


@pytest.fixture(scope="module")
def cubin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stub module file: the emulated driver only checks its ELF magic (the kernel code
    that runs is the emulation build of the same sources)."""
    stub = tmp_path_factory.mktemp("stub") / "plow_device.cubin"
    stub.write_bytes(b"\x7fELF" + bytes(60))
    return stub


@pytest.fixture(scope="module")
def moe_h200(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """The tiny qwen3_moe planned for an 8-SM h200, and the native executor's tokens and
    logits on it (made before the emulated driver patches imports)."""
    root = tmp_path_factory.mktemp("moe-cuda")
    ckpt = make_tiny_checkpoint("qwen3_moe", 0, root / "ckpt")
    path = root / "bundle"
    small = load_target("h200").model_copy(update={"workers": EMU_WORKERS})
    compile_bundle(ckpt, path, small, PROFILE)  # unverified: not the shipped h200 spec
    return path, _tokens_and_logits(NativeModel.from_bundle(path, max_batch=4, verify=False))


@pytest.mark.slow
def test_the_emulated_kernel_runs_routed_experts_with_the_native_bits(
    moe_h200: tuple[Path, tuple[list[list[int]], np.ndarray]],
    on_emulator: EmulatedGpu,  # noqa: F811
) -> None:
    from plow.runtime.cuda import open_cuda

    path, (want, want_logits) = moe_h200
    m = open_cuda(path, max_batch=4, verify=False)
    got, got_logits = _tokens_and_logits(m)
    assert got == want
    assert np.array_equal(got_logits, want_logits)
    assert any(o.kind == "expert_linear" for o in m.plan(m.decode_bucket(1)).ops)
