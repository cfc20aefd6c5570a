"""Kimi-Linear in the CUDA source (kernels/device.cu + kernels/kda.h): an h200 plan of the
tiny kimi_linear for 8 SMs, run by the kernel's own code on CPU threads (the emulation build
of tests/runtime/test_cuda.py), gives the native executor's tokens and logits bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.runtime.test_cuda import emulator, fresh_driver, on_emulator  # noqa: F401


@pytest.fixture(scope="module")
def cubin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stub module file: the emulated driver only checks its ELF magic."""
    stub = tmp_path_factory.mktemp("stub") / "plow_device.cubin"
    stub.write_bytes(b"\x7fELF" + bytes(60))
    return stub


@pytest.mark.slow
def test_the_emulated_cuda_kernel_runs_kimi_linear_with_the_native_bits(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> None:
    """The kda tiles run on one thread of each CTA, the conv on ssm.h's, MLA on the attention
    and the experts on the MoE tiles."""
    from plow.emit.bundle import compile_bundle
    from plow.runtime.native import NativeModel
    from plow.target import load_target
    from plow.testing.fixtures import make_tiny_kimi_linear
    from tests.runtime.test_cuda import EMU_WORKERS, PROFILE, _tokens_and_logits

    root = tmp_path_factory.mktemp("kimicuda")
    ckpt = make_tiny_kimi_linear(0, root / "ckpt")
    path = root / "bundle"
    small = load_target("h200").model_copy(update={"workers": EMU_WORKERS})
    compile_bundle(ckpt, path, small, PROFILE)  # unverified: not the shipped h200 spec
    want, want_logits = _tokens_and_logits(NativeModel.from_bundle(path, max_batch=4, verify=False))
    request.getfixturevalue("on_emulator")
    from plow.runtime.cuda import open_cuda

    m = open_cuda(path, max_batch=4, verify=False)
    got, got_logits = _tokens_and_logits(m)
    assert got == want
    assert np.array_equal(got_logits, want_logits)
