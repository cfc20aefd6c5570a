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
from tests.runtime.test_cuda import emulator  # noqa: F401  (fixture)

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


class FakeCooperativeHip(FakeHip):
    """A ROCm 6 runtime: it also exports hipModuleLaunchCooperativeKernel."""

    def __init__(self) -> None:
        super().__init__()
        self.cooperative_calls: list[tuple[object, ...]] = []

    def hipModuleLaunchCooperativeKernel(self, *a: object) -> int:
        self.cooperative_calls.append(a)
        return 0


def test_a_persistent_launch_is_cooperative_only_where_the_runtime_exports_it() -> None:
    """With hipModuleLaunchCooperativeKernel and a device that supports it, plow_step's launch
    goes through it (the runtime then refuses a grid that cannot be resident at once); a
    non-persistent launch (plow_config), or a runtime without the entry point, is plain."""
    dev = object.__new__(driver.HipDevice)
    fake = FakeCooperativeHip()
    dev.lib, dev.stream, dev.cooperative = fake, ctypes.c_void_p(0x5000), True  # type: ignore[assignment]
    args = abi.pack_params({n: 7 for n, _ in abi.PARAMS})
    dev.launch("fn", 132, abi.BLOCK_THREADS, args.address, shmem=4096)
    (call,) = fake.cooperative_calls
    assert call[:8] == ("fn", 132, 1, 1, abi.BLOCK_THREADS, 1, 1, 4096)
    assert call[8] is dev.stream and call[9] == args.address and len(call) == 10
    assert fake.calls == []
    dev.launch("cfg", 1, 8, args.address, persistent=False)
    assert len(fake.calls) == 1 and len(fake.cooperative_calls) == 1



def test_the_device_launches_cooperatively_with_the_entry_point_and_the_attribute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HipDevice's own choice: cooperative only when the runtime exports the module entry
    point and the device reports hipDeviceAttributeCooperativeLaunch."""

    class Rocm6(FakeHipLib):
        def hipModuleLaunchCooperativeKernel(self, *a: object) -> int:
            return 0

    for cls, attr, want in ((Rocm6, 1, True), (Rocm6, 0, False), (FakeHipLib, 1, False)):
        lib = cls(None)  # type: ignore[arg-type]  # no launch of plow_step here
        lib.attrs[driver.ATTR_COOPERATIVE_LAUNCH] = attr
        monkeypatch.setattr(driver, "library", lambda lib=lib: lib)
        assert driver.HipDevice(0).cooperative is want


def test_a_launch_passes_the_packed_parameters_and_the_dynamic_lds() -> None:
    dev = object.__new__(driver.HipDevice)
    fake = FakeHip()
    dev.lib = fake  # type: ignore[assignment]
    dev.stream = ctypes.c_void_p(0x5000)
    dev.cooperative = False  # Debian's ROCm 5.2: no cooperative module launch
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


# -- the HIP loader end to end on an emulated GPU: a fake libamdhip64 (ctypes calling
#    convention: outputs through byref) whose plow_step launch runs the kernel's own code
#    (device.cu's emulation build) -----------------------------------------------------------
class FakeHipLib:
    """Enough of libamdhip64 for `HipDevice`: device memory is host memory; a launch of
    plow_config writes the module's config words, one of plow_step runs the emulated kernel
    with the packed `void*[]` and the dynamic LDS size."""

    def __init__(self, emu: ctypes.CDLL, cus: int = 132) -> None:
        self.emu = emu
        self.mem: dict[int, object] = {}
        self.funcs: dict[int, str] = {}
        self.launches: list[tuple[str, int, int]] = []
        self.attrs = {
            driver.ATTR_MULTIPROCESSOR_COUNT: cus,
            driver.ATTR_WARP_SIZE: 64,
            driver.ATTR_MAX_SHARED_MEMORY_PER_BLOCK: 160 * 1024 + 16,
        }

    @staticmethod
    def _out(ref: object, value: object) -> int:
        ref._obj.value = value  # type: ignore[attr-defined]  # byref(x)._obj is x
        return 0

    def hipInit(self, flags: int) -> int:
        return 0

    def hipGetErrorName(self, err: int) -> bytes:
        return b"hipErrorFake"

    def hipGetDeviceCount(self, ref: object) -> int:
        return self._out(ref, 1)

    def hipSetDevice(self, i: int) -> int:
        return 0

    def hipDeviceGetAttribute(self, ref: object, attr: int, dev: int) -> int:
        return self._out(ref, self.attrs[attr])

    def hipDeviceGetName(self, buf: ctypes.Array, n: int, dev: int) -> int:  # type: ignore[type-arg]
        buf.value = b"Fake MI300X"
        return 0

    def hipStreamCreateWithFlags(self, ref: object, flags: int) -> int:
        assert flags == driver.STREAM_NON_BLOCKING
        return self._out(ref, 0x5000)

    def hipStreamSynchronize(self, s: object) -> int:
        return 0

    def hipMalloc(self, ref: object, n: int) -> int:
        buf = ctypes.create_string_buffer(int(n) + 64)
        self.mem[ctypes.addressof(buf)] = buf
        return self._out(ref, ctypes.addressof(buf))

    def hipFree(self, p: int) -> int:
        return 0

    def hipMemcpyHtoDAsync(self, dst: int, src: int, n: int, s: object) -> int:
        ctypes.memmove(dst, src, n)
        return 0

    hipMemcpyDtoHAsync = hipMemcpyHtoDAsync
    hipMemcpyDtoDAsync = hipMemcpyHtoDAsync

    def hipMemsetD8Async(self, p: int, v: int, n: int, s: object) -> int:
        ctypes.memset(p, v, n)
        return 0

    def hipModuleLoadData(self, ref: object, image: ctypes.Array) -> int:  # type: ignore[type-arg]
        assert bytes(image[:24]) == b"__CLANG_OFFLOAD_BUNDLE__"
        return self._out(ref, 0x6000)

    def hipModuleGetFunction(self, ref: object, module: object, name: bytes) -> int:
        h = 0x7000 + len(self.funcs)
        self.funcs[h] = name.decode()
        return self._out(ref, h)

    def hipFuncGetAttribute(self, ref: object, attr: int, f: object) -> int:
        assert attr == driver.FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
        return self._out(ref, 16)

    def hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(
        self, ref: object, f: object, threads: int, smem: int
    ) -> int:
        return self._out(ref, 1)

    def hipModuleLaunchKernel(
        self, f: ctypes.c_void_p, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
        shmem: int, stream: object, params: int, extra: object,
    ) -> int:  # fmt: skip
        name = self.funcs[int(f.value or 0)]
        self.launches.append((name, gx, shmem))
        if name == abi.CONFIG_KERNEL:
            out = ctypes.c_uint64.from_address(int(ctypes.c_void_p.from_address(params).value or 0))
            cfg = (ctypes.c_int64 * 8)(*abi.expected_config())
            ctypes.memmove(int(out.value), cfg, 64)
            return 0
        assert name == abi.KERNEL and shmem <= self.attrs[driver.ATTR_MAX_SHARED_MEMORY_PER_BLOCK]
        assert self.emu.plow_emu_launch(gx, bx, shmem, params) == 0
        return 0

    def hipEventCreate(self, ref: object) -> int:
        return self._out(ref, 0x8000)

    def hipEventRecord(self, e: object, s: object) -> int:
        return 0

    def hipEventSynchronize(self, e: object) -> int:
        return 0

    def hipEventElapsedTime(self, ref: object, a: object, b: object) -> int:
        return self._out(ref, 0.5)


def test_the_hip_loader_end_to_end_on_an_emulated_gpu_gives_the_native_bits(
    tiny_llama: Path, tmp_path: Path, code_object: Path, monkeypatch: pytest.MonkeyPatch,
    emulator: ctypes.CDLL,  # noqa: F811
) -> None:  # fmt: skip
    """HipModel through HipDevice's own ctypes calls on a fake libamdhip64 whose launches run
    the kernel's code on CPU threads: an mi350x plan for 8 CUs with its pages in (emulated)
    LDS gives the native executor's tokens and logits bit for bit, one step per launch and a
    greedy quantum of 4 steps per launch."""
    from plow.runtime.cpu import Request, generate
    from plow.runtime.cuda import model as cuda_model
    from plow.runtime.hip import HipModel, open_hip
    from plow.runtime.native import NativeModel
    from tests.runtime.test_cuda import EMU_THREADS, EMU_WORKERS, _tokens_and_logits

    fake = FakeHipLib(emulator)
    monkeypatch.setattr(driver, "library", lambda: fake)
    monkeypatch.setattr(abi, "BLOCK_THREADS", EMU_THREADS)
    monkeypatch.setattr(cuda_model, "_KERNELS", {})
    monkeypatch.setenv("PLOW_HIP_HSACO", str(code_object))
    driver.device.cache_clear()
    try:
        target = load_target("mi350x").model_copy(update={"workers": EMU_WORKERS})
        out = tmp_path / "mi350x"
        compile_bundle(tiny_llama, out, target, PROFILE)
        native = NativeModel.from_bundle(out, max_batch=4, verify=False)
        want, want_logits = _tokens_and_logits(native)
        m = open_hip(out, max_batch=4, verify=False)
        assert isinstance(m, HipModel) and m.cuda.dev.name == "Fake MI300X"
        got, got_logits = _tokens_and_logits(m)
        assert got == want and bytes(got_logits.tobytes()) == want_logits.tobytes()
        rung = m.cuda._rung(m.plan(m.decode_bucket(4)))
        assert rung.smem_bytes == 160 * 1024 and rung.tensor_core_ops == 0
        reqs = [Request((5, 17, 93, 2), 8), Request((3, 250), 8)]
        before = len(fake.launches)
        assert generate(m, reqs, multi_step=4) == generate(native, reqs, multi_step=4)
        assert any(n == abi.KERNEL for n, _, _ in fake.launches[before:])
        assert sum(1 for n, _, _ in fake.launches[before:] if n == abi.KERNEL) < 16
    finally:
        driver.device.cache_clear()
