"""The HIP executor (kernels/device.cu built by hipcc + plow/runtime/hip).

Here, without an AMD GPU: the HIP runtime library (Debian's libamdhip64, where installed) has
every entry point the loader binds, the attribute numbers the loader uses are the installed
header's, the code object's own argument table (its AMDGPU metadata note) is the parameter list
the loader packs, the launch passes the packed `void*[]` and the dynamic LDS size through, and
bad input (no code object, no GPU, a bundle for another vendor) is one line, exit 2. With an AMD
GPU (`gpu` marker; skipped otherwise): tokens equal the native executor's on an mi350x bundle.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from plow.emit.bundle import compile_bundle
from plow.errors import PlowError
from plow.profile import CompileProfile
from plow.runtime.cuda import abi
from plow.runtime.hip import driver
from plow.runtime.hip.driver import HipUnavailable, amd_gpu_present
from plow.target import load_target

ROOT = Path(__file__).resolve().parents[2]
PROFILE = CompileProfile(name="test", decode_batches=(1, 4), prefill_seqs=(16,), context=96)
HEADER = Path("/usr/include/hip/hip_runtime_api.h")


def _library() -> ctypes.CDLL:
    try:
        return driver.library()
    except HipUnavailable as e:
        pytest.skip(f"no HIP runtime library here ({e})")


def test_the_hip_runtime_has_every_entry_point_the_loader_binds() -> None:
    lib = _library()
    for name in driver._SIG:
        f = getattr(lib, name)
        assert f.restype is ctypes.c_int and f.argtypes == driver._SIG[name], name


def test_the_attribute_numbers_are_the_installed_headers(tmp_path: Path) -> None:
    cxx = shutil.which("g++")
    if cxx is None or not HEADER.is_file():
        pytest.skip("no HIP header or no C++ compiler")
    src = tmp_path / "attrs.cpp"
    src.write_text(
        '#include <hip/hip_runtime_api.h>\n#include <cstdio>\nint main() { printf("%d %d %d '
        '%d %d %d %d\\n", (int)hipDeviceAttributeMultiprocessorCount, '
        "(int)hipDeviceAttributeCooperativeLaunch, (int)hipDeviceAttributeMaxSharedMemoryPerBlock, "
        "(int)hipDeviceAttributeWarpSize, (int)HIP_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, "
        "(int)hipStreamNonBlocking, (int)hipErrorNoBinaryForGpu); }\n"
    )
    exe = tmp_path / "attrs"
    r = subprocess.run([cxx, "-D__HIP_PLATFORM_AMD__", str(src), "-o", str(exe)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    got = [
        int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True).stdout.split()
    ]
    assert got == [
        driver.ATTR_MULTIPROCESSOR_COUNT, driver.ATTR_COOPERATIVE_LAUNCH,
        driver.ATTR_MAX_SHARED_MEMORY_PER_BLOCK, driver.ATTR_WARP_SIZE,
        driver.FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, driver.STREAM_NON_BLOCKING,
        driver.ERROR_NO_BINARY_FOR_GPU,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def code_object(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make hip`'s gfx90a code object when it is newer than the sources, else built here."""
    srcs = [ROOT / "kernels/device.cu", *sorted((ROOT / "kernels").glob("*.h"))]
    built = ROOT / "_build" / "native" / "plow_device_gfx90a.hsaco"
    if built.is_file() and built.stat().st_mtime >= max(p.stat().st_mtime for p in srcs):
        return built
    if shutil.which("hipcc") is None:
        pytest.skip("hipcc not installed (Debian: apt-get install hipcc)")
    out = tmp_path_factory.mktemp("hip")
    r = subprocess.run(["kernels/hip/build.sh", str(out), "gfx90a"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return out / "plow_device_gfx90a.hsaco"


def test_the_code_objects_argument_table_is_the_loaders_parameter_list(code_object: Path) -> None:
    pytest.importorskip("msgpack")
    from plow.runtime.hip.codeobj import kernel_args, unbundle

    entries = unbundle(code_object.read_bytes())
    elf = next(v for k, v in entries.items() if k.endswith("gfx90a"))
    args, meta = kernel_args(elf, abi.KERNEL)
    sizes = [ctypes.sizeof(ct) for _, ct in abi.PARAMS]
    assert [a.size for a in args] == sizes
    offset = 0
    for a, size in zip(args, sizes, strict=True):
        offset = -(-offset // size) * size  # natural alignment: what pack_params' slots hold
        assert a.offset == offset
        offset += size
    # pointers are global buffers, the counts by value
    kinds = {n: a.kind for (n, _), a in zip(abi.PARAMS, args, strict=True)}
    assert kinds["arena"] == "global_buffer" and kinds["n_steps"] == "by_value"
    assert meta[".max_flat_workgroup_size"] >= abi.BLOCK_THREADS
    assert meta[".group_segment_fixed_size"] < 1024  # static LDS: the pages are dynamic
    cfg, _ = kernel_args(elf, abi.CONFIG_KERNEL)
    assert [a.size for a in cfg] == [8]


class FakeHip:
    """Records hipModuleLaunchKernel's arguments (the ctypes values the loader passes)."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def hipModuleLaunchKernel(self, *a: object) -> int:
        self.calls.append(a)
        return 0


def test_a_launch_passes_the_packed_parameters_and_the_dynamic_lds() -> None:
    dev = object.__new__(driver.HipDevice)
    fake = FakeHip()
    dev.lib = fake  # type: ignore[assignment]
    dev.stream = ctypes.c_void_p(0x5000)
    values = {n: 1000 + 17 * i for i, (n, _) in enumerate(abi.PARAMS)}
    args = abi.pack_params(values)
    dev.launch("fn", 132, abi.BLOCK_THREADS, args.address, shmem=65536)
    (call,) = fake.calls
    assert call[:8] == ("fn", 132, 1, 1, abi.BLOCK_THREADS, 1, 1, 65536)
    assert call[8] is dev.stream and call[9] == args.address and call[10] is None
    arr = (ctypes.c_void_p * len(abi.PARAMS)).from_address(int(call[9]))  # type: ignore[call-overload]
    got = {n: int(ct.from_address(int(arr[i])).value) for i, (n, ct) in enumerate(abi.PARAMS)}
    assert got == values


# -- bad input: one line, exit 2 ------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg.strip() and getattr(e, "exit_code", None) == 2
    return msg


def test_no_amd_gpu_is_a_one_line_error() -> None:
    if amd_gpu_present():
        pytest.skip("an AMD GPU is present: the refusal cannot be seen here")
    _library()
    driver.device.cache_clear()
    with pytest.raises(HipUnavailable) as e:
        driver.device(0)
    assert "no usable AMD GPU" in _one_line(e.value) or "no AMD GPU" in str(e.value)


def test_a_missing_code_object_and_another_vendors_bundle_are_refused(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plow.runtime.hip import open_hip

    monkeypatch.setenv("PLOW_HIP_HSACO", str(tmp_path / "nope.hsaco"))
    with pytest.raises(HipUnavailable) as e:
        open_hip(tmp_path / "anything")
    msg = _one_line(e.value)
    assert "nope.hsaco" in msg and "make hip" in msg
    fake = tmp_path / "any.hsaco"
    fake.write_bytes(b"\x7fELF")
    monkeypatch.setenv("PLOW_HIP_HSACO", str(fake))
    out = tmp_path / "h200"
    compile_bundle(tiny_llama, out, load_target("h200"), PROFILE)
    with pytest.raises(PlowError) as e2:
        open_hip(out, verify=False)
    msg = _one_line(e2.value)
    assert "compiled for target 'h200'" in msg and "--target mi350x" in msg


@pytest.mark.gpu
@pytest.mark.skipif(not amd_gpu_present(), reason="no AMD GPU (no /dev/kfd)")
def test_hip_tokens_equal_the_native_executors(tiny_llama: Path, tmp_path: Path) -> None:
    from plow.runtime.cpu import Request, generate
    from plow.runtime.hip import open_hip
    from plow.runtime.native import NativeModel

    out = tmp_path / "mi350x"
    compile_bundle(tiny_llama, out, load_target("mi350x"), PROFILE)
    prompts = [[5, 17, 93, 2, 44], [3, 250, 41]]
    reqs = [Request(tuple(p), 8) for p in prompts]
    want = generate(NativeModel.from_bundle(out, max_batch=4, verify=False), reqs)
    assert generate(open_hip(out, max_batch=4, verify=False), reqs) == want
    assert generate(open_hip(out, max_batch=4, verify=False), reqs, multi_step=4) == want


def test_plow_generate_executor_hip_without_an_amd_gpu_is_one_line_exit_2(
    tiny_llama: Path,
) -> None:
    if amd_gpu_present():
        pytest.skip("an AMD GPU is present")
    from typer.testing import CliRunner

    from plow.cli import app

    res = CliRunner().invoke(
        app, ["generate", str(tiny_llama), "--prompt-ids", "5,17,93", "--executor", "hip"]
    )
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no AMD GPU" in lines[0], res.output
