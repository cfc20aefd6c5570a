"""The HIP executor: the CUDA executor's machine (`plow.runtime.cuda.model.CudaMachine`: the
device image, arena, counters, one launch per step or quantum) on an AMD GPU through
`plow.runtime.hip.driver` — `kernels/device.cu` compiled by hipcc (`make hip`, one code object
per architecture in `_build/native/plow_device_<arch>.hsaco`; the first that loads on the GPU
is used). The tensor-core tiles are NVIDIA's (mma.sync): off here; the scalar tiles, scoped
atomics, on-chip pages (LDS) and the multi-step quantum are the same source.

Refusals, one line each (exit 2): no code object built (`make hip`), no HIP runtime, no AMD
GPU, a code object for another architecture only, a bundle whose target is not AMD's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plow.errors import PlowError
from plow.runtime.cpu.bundle import Bundle
from plow.runtime.cpu.engine import generate_request
from plow.runtime.cpu.generate import GenerationStats
from plow.runtime.cuda.model import ROOT, Backend, CudaModel, load_kernel
from plow.runtime.hip.driver import HipUnavailable, device
from plow.runtime.native import library
from plow.runtime.sampler import SamplingParams

BUILD = ROOT / "_build" / "native"
AMD_TARGETS = ("mi350x",)


def code_objects() -> list[tuple[Path, bytes]]:
    """The HIP code objects to try: `PLOW_HIP_HSACO` (one file), else every
    `_build/native/plow_device_<arch>.hsaco`; `HipUnavailable` when there is none."""
    env = os.environ.get("PLOW_HIP_HSACO")
    paths = [Path(env)] if env else sorted(BUILD.glob("plow_device_*.hsaco"))
    found = [(p, p.read_bytes()) for p in paths if p.is_file()]
    if not found:
        where = env or str(BUILD / "plow_device_<arch>.hsaco")
        raise HipUnavailable(where, "the HIP code object is not built (run `make hip`)")
    return found


HIP = Backend("hip", lambda ordinal: device(ordinal), code_objects, "make hip")


def check_amd_target(b: Bundle) -> None:
    t = b.manifest.target
    name, vendor = str(t.get("name", "?")), str(t.get("vendor", "")).lower()
    if vendor != "amd" or name not in AMD_TARGETS:
        raise PlowError(
            b.path,
            f"compiled for target {name!r} ({vendor or 'no vendor'}): the hip executor runs "
            f"plans for an AMD target ({', '.join(AMD_TARGETS)}; recompile with --target mi350x)",
        )


class HipModel(CudaModel):
    """`CudaModel` on the HIP backend (module docstring). Build with `open_hip`."""

    executor_name = "hip"

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("tensor_cores", False)
        super().__init__(*args, backend=HIP, **kw)


def open_hip(
    bundle: Bundle | Path | str, *, verify: bool = True, ordinal: int = 0, **kw: Any
) -> HipModel:
    """A `HipModel` of a bundle. Checked in this order, each a one-line error: a code object is
    built, the bundle opens (and verifies) and is for an AMD target, the HIP runtime and a GPU
    are there and a code object loads on it."""
    code_objects()
    b = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle, verify=verify)
    check_amd_target(b)
    library.load()
    load_kernel(ordinal, HIP)
    m = HipModel.from_bundle(b, verify=verify, ordinal=ordinal, **kw)
    assert isinstance(m, HipModel)
    return m


def generate_hip(
    bundle: Bundle | Path | str,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    params: SamplingParams | None = None,
    stop_ids: tuple[int, ...] = (),
    multi_step: int = 4,
    verify: bool = True,
) -> tuple[list[int], GenerationStats]:
    """One request through a bundle on the HIP executor (`plow generate --executor hip`)."""
    if not prompt_ids:
        raise PlowError("prompt", "empty prompt")
    model = open_hip(bundle, verify=verify, max_batch=1)
    return generate_request(model, prompt_ids, max_new_tokens, params, stop_ids, multi_step)
