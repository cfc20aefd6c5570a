"""The CUDA executor (kernels/device.cu + plow/runtime/cuda).

Here, without a GPU: the CUDA sources compile with nvcc for sm_90a (warnings as errors); the
parameter list the loader packs for `cuLaunchKernel` is the compiled kernel's (names from the
source, sizes from the PTX `.entry` signature, offsets and sizes from the cubin's parameter
table, the module's `plow_device_config` against the loader's structure sizes); the device
image of a certified h200 plan moves every pointer the kernel follows into uploaded memory,
with the queues, per-step signal counts and counter scopes the host build derives; the whole
loader on an emulated GPU (a fake driver whose launch runs the uploaded image through the host
build) gives the native executor's tokens and logits bit for bit — so nothing the kernel reads
is left un-uploaded, untranslated or not copied back; bad input (no module, a CPU target's
bundle, no cuda-python / driver / GPU) is a one-line error, exit 2. And the kernel itself, built
for the host with PLOW_EMULATE (one OS thread per CTA, its threads fibers switched at
barriers), run through the same loader: tokens and logits equal the native executor's bit for
bit on three families, identical whatever the timing, a lowered threshold shows as wrong bytes
and a raised one stops the step naming the blocked worker.

With a GPU (`gpu` marker; skipped with the reason otherwise): tokens from the CUDA executor
equal the native executor's on the same h200 bundles for two tiny fixtures; 20 repeated runs
(timing perturbed) are bitwise identical; a lowered threshold is detected by wrong bytes; a
raised one stops the step with the blocked worker named.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import shutil
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest

from plow.bundle.wire import HEADER_SIZE, read_plan
from plow.emit.bundle import compile_bundle
from plow.errors import PlowError
from plow.profile import CompileProfile
from plow.runtime.cpu import Request, RowDevice, RowInput, generate
from plow.runtime.cpu.plan import REMAINING, RING
from plow.runtime.cuda import abi, driver
from plow.runtime.cuda.driver import CudaUnavailable, gpu_present
from plow.runtime.cuda.image import build_image, counter_tables
from plow.runtime.native import NativeModel
from plow.runtime.native.library import PlowOp
from plow.runtime.native.lower import lower
from plow.runtime.sampler import SamplingParams
from plow.target import load_target

ROOT = Path(__file__).resolve().parents[2]
DEVICE_SRC = ROOT / "kernels" / "device.cu"
BUILT_CUBIN = ROOT / "_build" / "native" / "plow_device.cubin"
BUILT_PTX = ROOT / "_build" / "native" / "plow_device.ptx"
NEW = 10
CONTEXT = 96
PROMPTS = [[5, 17, 93, 2, 44, 8, 61, 30, 12, 7], [3, 250, 41, 6, 77], [120, 9]]
PROFILE = CompileProfile(name="test", decode_batches=(1, 4), prefill_seqs=(16,), context=CONTEXT)
GPU_FAMILIES = ["llama", "qwen3"]


def _oracle_present() -> bool:
    from plow.oracle.runner import oracle_binary

    try:
        oracle_binary()
    except PlowError:
        return False
    return True


# certified bundles where the oracle is built (here; on a GPU machine only if it was carried)
VERIFY = _oracle_present()
needs_gpu = pytest.mark.skipif(
    not gpu_present(), reason="no NVIDIA GPU (no /dev/nvidia0, nvidia-smi finds none)"
)


# -- the compiled module --------------------------------------------------------------------
def _sources() -> list[Path]:
    return [DEVICE_SRC, *sorted((ROOT / "kernels").glob("*.h")), ROOT / "kernels/Makefile.device"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cubin, ptx): `make cuda`'s outputs when they are newer than the sources, else built
    here by the same rule into a temporary directory."""
    newest = max(p.stat().st_mtime for p in _sources())
    if all(p.is_file() and p.stat().st_mtime >= newest for p in (BUILT_CUBIN, BUILT_PTX)):
        return BUILT_CUBIN, BUILT_PTX
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: the CUDA sources cannot be compiled here")
    out = tmp_path_factory.mktemp("cuda")
    cubin, ptx = out / "plow_device.cubin", out / "plow_device.ptx"
    r = subprocess.run(
        ["make", "--no-print-directory", "-f", "kernels/Makefile.device", "cuda",
         f"DEVICE_CUBIN={cubin}", f"DEVICE_PTX={ptx}"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return cubin, ptx


@pytest.fixture(scope="module")
def cubin(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled module where nvcc (or a fresh `make cuda`) is there, else a stub file: the
    loader only reads it when a real driver loads it, and the tests that take this fixture use
    none."""
    fresh = BUILT_CUBIN.is_file() and BUILT_CUBIN.stat().st_mtime >= max(
        p.stat().st_mtime for p in _sources()
    )
    if fresh or shutil.which("nvcc") is not None:
        return Path(request.getfixturevalue("compiled")[0])
    stub = tmp_path_factory.mktemp("stub") / "plow_device.cubin"
    stub.write_bytes(b"\x7fELF" + bytes(60))
    return stub


def test_the_cuda_sources_compile_with_nvcc_for_sm_90a(compiled: tuple[Path, Path]) -> None:
    cubin, ptx = compiled
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF"
    text = ptx.read_text()
    assert ".target sm_90a" in text
    assert f".entry {abi.KERNEL}(" in text
    # warnings are errors in the rule itself (kernels/Makefile.device)
    rule = (ROOT / "kernels/Makefile.device").read_text()
    assert "-arch=$(CUDA_ARCH)" in rule and "-Werror all-warnings" in rule
    assert "CUDA_ARCH ?= sm_90a" in rule and "--fmad=false" in rule


def test_the_loader_packs_the_parameters_the_compiled_kernel_declares(
    compiled: tuple[Path, Path],
) -> None:
    cubin, ptx = compiled
    names = [n for n, _ in abi.PARAMS]
    sizes = [ctypes.sizeof(ct) for _, ct in abi.PARAMS]
    assert abi.source_params(DEVICE_SRC.read_text()) == names
    text = ptx.read_text()
    assert abi.ptx_params(text) == sizes
    # the driver copies kernelParams[i] by the cubin's table: ordinal i, its offset and size
    table = abi.cubin_params(cubin)
    assert [p.ordinal for p in table] == list(range(len(names)))
    assert [p.size for p in table] == sizes
    offset = 0
    for p, size in zip(table, sizes, strict=True):
        offset = -(-offset // size) * size  # natural alignment
        assert p.offset == offset
        offset += size
    # the loader asks the driver for two kernels: both exported functions of the module (the
    # config word itself is a device object, LOCAL in a whole-program cubin: read via a kernel)
    symbols = abi.cubin_symbols(cubin)
    assert symbols[abi.KERNEL] == ("GLOBAL", "FUNC")
    assert symbols[abi.CONFIG_KERNEL] == ("GLOBAL", "FUNC")
    assert symbols[abi.CONFIG_SYMBOL][1] == "OBJECT"
    assert abi.ptx_params(text, abi.CONFIG_KERNEL) == [8]
    assert [p.size for p in abi.cubin_params(cubin, abi.CONFIG_KERNEL)] == [8]
    # the module's own constants: the structures the loader uploads have its sizes
    assert abi.config_mismatch(abi.ptx_config(text)) is None
    assert abi.ptx_config(text)[4] == ctypes.sizeof(abi.PlowPlan)
    # what each slot of the void*[] holds is the value given, at the declared width
    values = {n: (0x1234_5678_9ABC_DEF0 + 977 * i) & ((1 << (8 * s - 1)) - 1)
              for i, (n, s) in enumerate(zip(names, sizes, strict=True))}  # fmt: skip
    args = abi.pack_params(values)
    assert args.read_back() == values
    assert len(args.array) == len(names) and args.address == ctypes.addressof(args.array)
    with pytest.raises(ValueError, match="missing"):
        abi.pack_params({k: v for k, v in values.items() if k != "step"})


def test_the_hip_sources_compile_for_gfx90a_or_the_check_says_why(tmp_path: Path) -> None:
    if shutil.which("hipcc") is None:
        pytest.skip("hipcc not installed (Debian: apt-get install hipcc)")
    built = ROOT / "_build" / "native" / "plow_device_gfx90a.hsaco"
    newest = max(p.stat().st_mtime for p in [*_sources(), ROOT / "kernels/hip/build.sh"])
    if built.is_file() and built.stat().st_mtime >= newest:  # make hip-check ran on these
        assert built.stat().st_size > 0
        return
    r = subprocess.run(
        ["kernels/hip/build.sh", str(tmp_path), "gfx90a", "gfx942"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    names = sorted(p.name for p in tmp_path.glob("*.hsaco"))
    assert "plow_device_gfx90a.hsaco" in names, r.stdout
    assert "plow_device_gfx942.hsaco" in names or "skipped gfx942" in r.stdout, r.stdout


# -- the device image (no GPU: a recording uploader) ----------------------------------------
@pytest.fixture(scope="module")
def h200_bundles(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cuda-bundles")
    out = {}
    for fam in GPU_FAMILIES:
        out[fam] = root / f"{fam}-h200"
        compile_bundle(tiny_checkpoints[fam], out[fam], load_target("h200"), PROFILE, verify=VERIFY)
    return out


class Recorder:
    """A fake device: each upload gets a fresh address; what was uploaded is kept."""

    def __init__(self) -> None:
        self.next = 0x7F00_0000_0000
        self.blobs: dict[int, bytes] = {}
        self.cached: dict[tuple[int, int], int] = {}

    def __call__(self, arr: np.ndarray, cache: bool) -> int:
        key = (int(arr.ctypes.data), int(arr.nbytes))
        if cache and key in self.cached:
            return self.cached[key]
        addr = self.next
        self.next += -(-max(1, arr.nbytes) // 256) * 256
        self.blobs[addr] = arr.tobytes()
        if cache:
            self.cached[key] = addr
        return addr


def test_the_device_image_moves_every_pointer_the_kernel_follows(h200_bundles: dict) -> None:
    m = NativeModel.from_bundle(h200_bundles["llama"], max_batch=4, verify=VERIFY)
    rec = Recorder()
    images = []
    for rows in (1, 4):
        plan = m.plan(m.decode_bucket(rows))
        low = lower(plan, m.arena, m.weights, Path(plan.source), m.bundle.rung(plan.bucket))  # type: ignore[union-attr]
        img = build_image(low, rec)
        images.append(img)
        p = low.plan
        host_ops = (PlowOp * p.n_ops).from_address(p.ops)
        # the plan and op table uploaded are the host's with device pointers
        assert rec.blobs[img.plan] == bytes(img.plan_host)
        assert rec.blobs[img.plan_host.ops] == bytes(img.ops_host)
        assert img.plan_host.n_workers == p.n_workers == load_target("h200").workers
        _, records = read_plan(Path(plan.source) / m.bundle.rung(plan.bucket).plan)  # type: ignore[union-attr]
        assert rec.blobs[img.plan_host.records] == records.tobytes()
        if p.bounds:
            n = p.n_chunks + 1
            assert rec.blobs[img.plan_host.bounds] == ctypes.string_at(p.bounds, 8 * n)
        for i in range(p.n_ops):
            for f, nbytes in (("w0", None), ("w1", None), ("table", None), ("merge", None)):
                h, d = getattr(host_ops[i], f), getattr(img.ops_host[i], f)
                assert (h is None) == (d is None), (i, f)
                if h is None:
                    continue
                blob = rec.blobs[d]
                assert blob == ctypes.string_at(h, len(blob)), (i, f)
                del nbytes
        # each worker's queue: its records in file order
        w = records["worker"]
        for worker in range(p.n_workers):
            q = img.queue_host[img.queue_start_host[worker] : img.queue_start_host[worker + 1]]
            assert q.tolist() == np.flatnonzero(w == worker).tolist()
        assert img.queue_start_host[-1] == len(records)
        # signals per step and scopes: every signaller of a counter carries the counter's scope
        per_step, scope = counter_tables(records, p.n_counters)
        sig = records["signal_counter"]
        live = sig != abi.NO_COUNTER
        assert int(per_step.sum()) == int(live.sum())
        assert np.array_equal(scope[sig[live]], records["scope"][live])
        assert set(np.unique(records["scope"]).tolist()) <= {0, 1}  # cta and device on one GPU
        assert img.scratch_floats >= 16
    # weights are uploaded once for both rungs
    w0 = [images[k].ops_host[0].w0 for k in range(2)]
    assert w0[0] == w0[1]


# -- bad input: one line, exit 2 ------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg.strip()
    assert getattr(e, "exit_code", None) == 2
    return msg


def test_a_missing_module_is_a_one_line_error_naming_it(
    h200_bundles: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plow.runtime.cuda import open_cuda

    monkeypatch.setenv("PLOW_CUDA_CUBIN", str(tmp_path / "nope.cubin"))
    with pytest.raises(CudaUnavailable) as e:
        open_cuda(h200_bundles["llama"], verify=VERIFY)
    msg = _one_line(e.value)
    assert "nope.cubin" in msg and "make cuda" in msg


def test_a_cpu_targets_bundle_is_refused(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plow.runtime.cuda import open_cuda

    fake = tmp_path / "any.cubin"
    fake.write_bytes(b"\x7fELF")  # only its presence is checked before the bundle
    monkeypatch.setenv("PLOW_CUDA_CUBIN", str(fake))
    out = tmp_path / "cpu"
    compile_bundle(tiny_llama, out, load_target("cpu"), PROFILE)
    with pytest.raises(PlowError) as e:
        open_cuda(out, verify=False)
    msg = _one_line(e.value)
    assert "compiled for target 'cpu'" in msg and "--target h200" in msg


@pytest.fixture
def fresh_driver(monkeypatch: pytest.MonkeyPatch) -> object:
    """Driver caches cleared before and after (a fake driver must not leak)."""
    from plow.runtime.cuda import model

    driver.bindings.cache_clear()
    driver.device.cache_clear()
    monkeypatch.setattr(model, "_KERNELS", {})
    yield None
    driver.bindings.cache_clear()
    driver.device.cache_clear()


def test_no_cuda_python_or_no_gpu_is_a_one_line_error(
    h200_bundles: dict, cubin: Path, monkeypatch: pytest.MonkeyPatch, fresh_driver: object,
) -> None:  # fmt: skip
    if gpu_present():
        pytest.skip("a GPU is present: the refusal cannot be seen here")
    from plow.runtime.cuda import open_cuda

    monkeypatch.setenv("PLOW_CUDA_CUBIN", str(cubin))
    with pytest.raises(CudaUnavailable) as e:
        open_cuda(h200_bundles["llama"], verify=VERIFY)
    msg = _one_line(e.value)
    assert "pip install cuda-python" in msg or "no NVIDIA" in msg or "GPU" in msg


def test_a_driver_that_cannot_load_is_a_one_line_error(
    h200_bundles: dict, cubin: Path, monkeypatch: pytest.MonkeyPatch, fresh_driver: object,
) -> None:  # fmt: skip
    """cuda-python present, no NVIDIA driver: its cuInit raises (as cuda-bindings 13 does when
    libcuda.so is not found)."""
    from plow.runtime.cuda import open_cuda

    fake = types.ModuleType("cuda.bindings.driver")

    def cu_init(flags: int) -> tuple[int]:
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system')

    fake.cuInit = cu_init  # type: ignore[attr-defined]
    real = importlib.import_module
    monkeypatch.setattr(
        driver.importlib, "import_module",
        lambda name: fake if name == "cuda.bindings.driver" else real(name),
    )  # fmt: skip
    monkeypatch.setenv("PLOW_CUDA_CUBIN", str(cubin))
    with pytest.raises(CudaUnavailable) as e:
        open_cuda(h200_bundles["llama"], verify=VERIFY)
    msg = _one_line(e.value)
    assert msg.startswith("GPU") and "no NVIDIA driver" in msg


def test_without_cuda_python_the_error_names_the_install(
    monkeypatch: pytest.MonkeyPatch, fresh_driver: object
) -> None:
    def missing(name: str) -> object:
        raise ImportError(name)

    monkeypatch.setattr(driver.importlib, "import_module", missing)
    with pytest.raises(CudaUnavailable) as e:
        driver.bindings()
    assert "pip install cuda-python" in _one_line(e.value)


# -- on a GPU -------------------------------------------------------------------------------
def _tokens_and_logits(m: object) -> tuple[list[list[int]], np.ndarray]:
    toks = generate(m, [Request(tuple(p), NEW) for p in PROMPTS])  # type: ignore[arg-type]
    # the prefill logits of the first prompt (one 16-token launch)
    mm = m  # a CpuModel subclass
    t = mm.kv.new_table()  # type: ignore[attr-defined]
    ids = PROMPTS[0]
    mm.kv.reserve(t, len(ids))  # type: ignore[attr-defined]
    plan = mm.plan(mm.prefill_bucket(1, len(ids)))  # type: ignore[attr-defined]
    mm.run_quantum(  # type: ignore[attr-defined]
        plan, [RowInput(t, tuple(range(len(ids))), tuple(ids))],
        [RowDevice(SamplingParams(), None, 1)], 1,
    )  # fmt: skip
    lg = mm.logits(plan)[0]  # type: ignore[attr-defined]
    mm.kv.release(t)  # type: ignore[attr-defined]
    return toks, lg


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_cuda_tokens_equal_the_native_executors_on_the_same_bundle(
    h200_bundles: dict, family: str
) -> None:
    from plow.runtime.cuda import open_cuda

    path = h200_bundles[family]
    native = NativeModel.from_bundle(path, max_batch=4, verify=VERIFY)  # runs any target's plan
    want, want_logits = _tokens_and_logits(native)
    got, got_logits = _tokens_and_logits(open_cuda(path, max_batch=4, verify=VERIFY))
    assert got == want
    # the dots and reductions have the host build's order; expf / sinf / cosf are CUDA's
    # (within its ulp bounds of glibc's), so the logits agree closely, not necessarily bitwise
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    print(f"{family}: logits bitwise equal to the host build: "
          f"{bool(np.array_equal(got_logits, want_logits))}")  # fmt: skip


@pytest.fixture(scope="module")
def h200_bf16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(checkpoint, bundle): a tiny llama with bf16 weights, compiled for the h200 target."""
    from plow.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("cuda-bf16")
    ck = make_tiny_checkpoint("llama", 4, root / "ckpt", dtype="bfloat16")
    out = root / "bundle"
    compile_bundle(ck, out, load_target("h200"), PROFILE, verify=VERIFY)
    return ck, out


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("name", "tensor_cores"),
                         [("llama", False), ("llama-bf16-split", False),
                          ("llama-bf16-split", True)])  # fmt: skip
def test_cuda_weight_pages_give_the_bits_of_weights_read_from_global_memory(
    small_h200_bundles: dict, name: str, tensor_cores: bool
) -> None:
    """On the GPU: linear tiles reading their weights from the filled shared-memory weight
    windows (in-line copies and cp.async hoisted loads) give the bits of the same kernel
    reading them from global memory (`smem_pages=False`; a copy changes no value and the
    order of the arithmetic is the same), and the native executor's tokens. (The emulated
    test's mutations are not repeated here: a real SM's shared memory keeps what an earlier
    launch left, so a skipped fill can read the right bytes by chance.) The plans of 8 and
    16 workers: tasks share queues, so loads are hoisted (a 132-worker plan of a tiny model
    has one task per queue and hoists none)."""
    from plow.runtime.cuda import open_cuda

    path = small_h200_bundles[name]
    paged = open_cuda(path, max_batch=4, verify=VERIFY, tensor_cores=tensor_cores)
    table = paged.cuda._rung(paged.plan(paged.decode_bucket(4))).page_table
    assert table is not None, "the page budget did not fit this GPU: nothing to test"
    dev = table.device_table()
    assert np.count_nonzero(dev[:, 5]) > 0 and np.count_nonzero(dev[:, 3]) > 0
    got, got_logits = _tokens_and_logits(paged)
    arena = open_cuda(path, max_batch=4, verify=VERIFY, tensor_cores=tensor_cores,
                      smem_pages=False)  # fmt: skip
    want, want_logits = _tokens_and_logits(arena)
    assert got == want and np.array_equal(got_logits, want_logits)
    native = NativeModel.from_bundle(path, max_batch=4, verify=VERIFY)
    assert got == _tokens_and_logits(native)[0]


@pytest.mark.gpu
@needs_gpu
def test_cuda_tensor_core_tiles_agree_with_the_scalar_path_and_transformers(
    h200_bf16: tuple[Path, Path],
) -> None:
    """bf16 linears on mma.sync (x as bf16 hi + lo, fp32 accumulate): logits within 1e-3 of
    the scalar device path's and within 2e-3 of transformers' fp32 forward of the same bf16
    weights (stated tolerances: a different summation order, x kept to ~16 mantissa bits);
    greedy tokens equal both."""
    import torch
    import transformers

    from plow.runtime.cuda import open_cuda

    ck, path = h200_bf16
    tc = open_cuda(path, max_batch=4, verify=VERIFY, tensor_cores=True)
    scalar = open_cuda(path, max_batch=4, verify=VERIFY, tensor_cores=False)
    got, got_logits = _tokens_and_logits(tc)
    want, want_logits = _tokens_and_logits(scalar)
    assert tc.cuda._rung(tc.plan(tc.decode_bucket(4))).tensor_core_ops >= 4
    assert got == want
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-3, atol=1e-3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ck, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[0]])).logits[0, -1].numpy()
        ref_toks = [
            hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(p) :].tolist()
            for p in PROMPTS
        ]  # fmt: skip
    np.testing.assert_allclose(got_logits, ref, rtol=2e-3, atol=2e-3)
    assert got == ref_toks
    print(f"tensor cores: max |logit - scalar| {np.abs(got_logits - want_logits).max():.2e}, "
          f"max |logit - transformers| {np.abs(got_logits - ref).max():.2e}")  # fmt: skip


@pytest.mark.gpu
@needs_gpu
def test_cuda_quantum_launch_equals_one_launch_per_step(h200_bundles: dict) -> None:
    from plow.runtime.cuda import open_cuda

    path = h200_bundles["llama"]
    reqs = [Request(tuple(p), NEW) for p in PROMPTS]
    runs = []
    for quantum in (False, True):
        m = open_cuda(path, max_batch=4, verify=VERIFY, device_quantum=quantum)
        toks = generate(m, reqs, multi_step=4)
        runs.append((toks, m.cuda.launches, m.steps))
    assert runs[1][0] == runs[0][0] and runs[1][2] == runs[0][2]
    assert runs[1][1] < runs[0][1]  # fewer launches: 4 steps in one


@pytest.mark.gpu
@needs_gpu
def test_cuda_quantum_samples_stochastic_rows_like_the_native_executor(h200_bundles: dict) -> None:
    from plow.runtime.cuda import open_cuda

    path = h200_bundles["llama"]
    params = [SamplingParams(temperature=0.9, top_k=7, seed=11),
              SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02, seed=5)]  # fmt: skip
    reqs = [Request(tuple(p), NEW, params=sp) for p, sp in zip(PROMPTS, params, strict=False)]
    want = generate(NativeModel.from_bundle(path, max_batch=4, verify=VERIFY), reqs, multi_step=4)
    m = open_cuda(path, max_batch=4, verify=VERIFY)
    assert generate(m, reqs, multi_step=4) == want
    assert m.cuda.launches < m.steps  # the quantum ran them: fewer launches than steps


def _run(path: Path, **kw: object) -> tuple[list[list[int]], bytes]:
    from plow.runtime.cuda import open_cuda

    m = open_cuda(path, max_batch=4, verify=False, **kw)
    toks = generate(m, [Request(tuple(p), NEW) for p in PROMPTS])
    return toks, m.cuda.snapshot().tobytes()


@pytest.mark.gpu
@needs_gpu
def test_twenty_runs_are_bitwise_identical_whatever_the_timing(h200_bundles: dict) -> None:
    path = h200_bundles["llama"]
    first = _run(path)
    for i in range(20):
        assert _run(path, jitter_ns=2000 if i % 2 else 0) == first, f"run {i}"


def _edit_thresholds(src: Path, dst: Path, rung: str, delta: int) -> int:
    """Copy the bundle; lower (delta < 0) or raise (delta > 0, one record) by |delta| the
    thresholds of waits on counters that records of other workers signal (a lowered one lets
    the record start before its producers finish). Returns how many records changed."""
    shutil.copytree(src, dst)
    plan_file = dst / "plan" / rung
    _, arr = read_plan(plan_file)
    sig, worker = arr["signal_counter"], arr["worker"]
    cand = [
        i for i in range(len(arr))
        if arr["wait_counter"][i] != abi.NO_COUNTER and arr["wait_threshold"][i] >= -delta
        and np.any((sig == arr["wait_counter"][i]) & (worker != worker[i]))
    ]  # fmt: skip
    if delta > 0:
        cand = cand[len(cand) // 2 : len(cand) // 2 + 1]
    data = bytearray(plan_file.read_bytes())
    for i in cand:
        at = HEADER_SIZE + 64 * i + 16
        new = int(arr["wait_threshold"][i]) + delta
        data[at : at + 4] = new.to_bytes(4, "little")
    plan_file.write_bytes(bytes(data))
    return len(cand)


@pytest.mark.gpu
@needs_gpu
def test_a_lowered_threshold_is_detected_by_wrong_bytes(h200_bundles: dict, tmp_path: Path) -> None:
    path = h200_bundles["llama"]
    want = _run(path)
    broken = tmp_path / "low"
    assert _edit_thresholds(path, broken, "decode_b4_s96.bin", -1) > 0
    runs = [_run(broken, jitter_ns=5000) for _ in range(5)]
    assert any(r != want for r in runs), "a lowered threshold went unnoticed in 5 runs"


@pytest.mark.gpu
@needs_gpu
def test_a_raised_threshold_stops_the_step_naming_the_blocked_worker(
    h200_bundles: dict, tmp_path: Path
) -> None:
    from plow.runtime.cuda import CudaStepError, open_cuda

    broken = tmp_path / "high"
    assert _edit_thresholds(h200_bundles["llama"], broken, "decode_b4_s96.bin", +1) == 1
    m = open_cuda(broken, max_batch=4, verify=False, timeout_ms=300)
    with pytest.raises(CudaStepError, match=r"step stuck: worker \d+ blocked at packet \d+"):
        generate(m, [Request(tuple(p), 3) for p in PROMPTS])


# -- the whole loader on an emulated GPU (no GPU: the driver is a fake whose launch runs the
#    uploaded image through the host build) -------------------------------------------------
class FakeDriver(types.ModuleType):
    """Enough of `cuda.bindings.driver` for the loader, with cuda-python's calling convention
    (a `(CUresult, *values)` tuple per call, int addresses). Device memory is host memory; a
    launch reads the packed `void*[]`, and runs the plan the kernel would read — the uploaded
    PlowPlan, whose every pointer is a "device" address — through the host build
    (`plow_plan_new` / `plow_plan_dispatch`), writing the status word as the kernel does. So
    whatever the loader fails to upload, translate or copy back changes the tokens."""

    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1

    class CUdevice_attribute:
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = "sms"
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = "major"
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = "minor"
        CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH = "coop"
        CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = "optin"

    class CUfunction_attribute:
        CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = "static"
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = "dynamic"

    class CUstream_flags:
        CU_STREAM_NON_BLOCKING = 1

    def __init__(self) -> None:
        super().__init__("cuda.bindings.driver")
        from plow.runtime.native import library

        self.lib = library.load()
        self.mem: dict[int, np.ndarray] = {}
        self.handles: dict[int, tuple[int, int]] = {}
        self.launches: list[dict[str, int]] = []
        self.config = np.array(abi.expected_config(), dtype=np.int64)
        self.attrs = {"sms": 132, "major": 9, "minor": 0, "coop": 1, "optin": 232448}
        self.smem_allowed = 0
        ok = self.CUresult.CUDA_SUCCESS
        self.cuInit = lambda flags: (ok,)
        self.cuGetErrorName = lambda e: (ok, b"CUDA_ERROR_FAKE")
        self.cuDeviceGetCount = lambda: (ok, 1)
        self.cuDeviceGet = lambda i: (ok, i)
        self.cuDevicePrimaryCtxRetain = lambda d: (ok, "ctx")
        self.cuCtxSetCurrent = lambda c: (ok,)
        self.cuDeviceGetAttribute = lambda a, d: (ok, self.attrs[a])
        self.cuDeviceGetName = lambda n, d: (ok, b"Fake H200".ljust(n, b"\0"))
        self.cuStreamCreate = lambda flags: (ok, "stream")
        self.cuStreamSynchronize = lambda s: (ok,)
        self.cuMemFree = lambda p: (ok,)
        self.cuModuleGetFunction = lambda m, name: (ok, "fn:" + name.decode())
        self.cuOccupancyMaxActiveBlocksPerMultiprocessor = lambda f, t, s: (ok, 1)
        self.cuEventCreate = lambda flags: (ok, object())
        self.cuEventRecord = lambda e, s: (ok,)
        self.cuEventSynchronize = lambda e: (ok,)
        self.cuEventElapsedTime = lambda a, b: (ok, 0.25)
        self.cuFuncGetAttribute = lambda a, f: (ok, 16)

    def cuFuncSetAttribute(self, f: str, attr: str, value: int) -> tuple[int]:
        assert attr == "dynamic" and value <= self.attrs["optin"] - 16
        self.smem_allowed = value
        return (0,)

    def cuMemAlloc(self, n: int) -> tuple[int, int]:
        buf = np.zeros(int(n) + 64, dtype=np.uint8)
        addr = int(buf.ctypes.data)
        self.mem[addr] = buf
        return (0, addr)

    def cuMemcpyHtoDAsync(self, dst: int, src: int, n: int, s: object) -> tuple[int]:
        ctypes.memmove(dst, src, n)
        return (0,)

    cuMemcpyDtoHAsync = cuMemcpyHtoDAsync
    cuMemcpyDtoDAsync = cuMemcpyHtoDAsync

    def cuMemcpyDtoH(self, dst: int, src: int, n: int) -> tuple[int]:
        ctypes.memmove(dst, src, n)
        return (0,)

    def cuMemsetD8Async(self, p: int, v: int, n: int, s: object) -> tuple[int]:
        ctypes.memset(p, v, n)
        return (0,)

    def cuModuleLoadData(self, image: int) -> tuple[int, str]:
        assert ctypes.string_at(image, 4) == b"\x7fELF"
        return (0, "module")

    def cuLaunchKernel(
        self, f: str, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int,
        stream: object, params: int, extra: object,
    ) -> tuple[int]:  # fmt: skip
        """Only the config kernel is launched plainly: it writes plow_device_config."""
        assert f == "fn:" + abi.CONFIG_KERNEL and (gx, gy, gz, by, bz) == (1, 1, 1, 1, 1)
        assert bx >= 8
        out = ctypes.c_uint64.from_address(int(ctypes.c_void_p.from_address(params).value or 0))
        ctypes.memmove(int(out.value), int(self.config.ctypes.data), int(self.config.nbytes))
        return (0,)

    def cuLaunchCooperativeKernel(
        self, f: str, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int,
        stream: object, params: int,
    ) -> tuple[int]:  # fmt: skip
        assert f == "fn:plow_step" and (gy, gz, by, bz) == (1, 1, 1, 1)
        assert bx == abi.BLOCK_THREADS and shmem <= max(self.smem_allowed, 48 * 1024)
        arr = (ctypes.c_void_p * len(abi.PARAMS)).from_address(params)
        p = {n: int(ct.from_address(int(arr[i])).value) for i, (n, ct) in enumerate(abi.PARAMS)}
        self.launches.append(p)
        plan = abi.PlowPlan.from_address(p["plan"])
        assert gx == plan.n_workers
        err = ctypes.create_string_buffer(512)
        if p["plan"] not in self.handles:
            h = self.lib.plow_plan_new(ctypes.byref(plan), err, len(err))
            assert h, err.value
            self.handles[p["plan"]] = (h, 0)
        h, steps = self.handles[p["plan"]]
        assert p["step"] == steps + 1  # steps numbered on as host.cpp counts them
        self.handles[p["plan"]] = (h, steps + p["n_steps"])
        if p["quantum"]:  # a quantum launch: the host build's quantum on the uploaded tables
            dq = abi.DeviceQuantum.from_address(p["quantum"])
            assert (dq.arrive, dq.go) == (0, 0)
            rc = self.lib.plow_plan_quantum(
                h, p["arena"], 0, 2, 20_000, p["n_steps"], ctypes.byref(dq.q),
                ctypes.cast(dq.rows, ctypes.POINTER(abi.DeviceRow)), err,
                len(err),
            )  # fmt: skip
        else:
            assert p["n_steps"] == 1
            rc = self.lib.plow_plan_dispatch(h, p["arena"], 0, 2, 20_000, err, len(err))
        assert rc == 0, err.value
        counts = (ctypes.c_int64 * 3)()
        self.lib.plow_plan_last_counts(h, counts)
        st = abi.DeviceStatus.from_address(p["status"])
        st.tasks, st.nops = counts[0], counts[1]
        return (0,)


def test_the_loader_end_to_end_on_an_emulated_gpu_gives_the_native_tokens(
    h200_bundles: dict, cubin: Path, monkeypatch: pytest.MonkeyPatch, fresh_driver: object,
) -> None:  # fmt: skip
    from plow.runtime.cuda import open_cuda

    fake = FakeDriver()
    real = importlib.import_module
    monkeypatch.setattr(
        driver.importlib, "import_module",
        lambda name: fake if name == "cuda.bindings.driver" else real(name),
    )  # fmt: skip
    monkeypatch.setenv("PLOW_CUDA_CUBIN", str(cubin))
    path = h200_bundles["llama"]
    native = NativeModel.from_bundle(path, max_batch=4, verify=VERIFY)
    want, want_logits = _tokens_and_logits(native)
    m = open_cuda(path, max_batch=4, timing=True, verify=VERIFY)
    got, got_logits = _tokens_and_logits(m)
    assert got == want
    assert np.array_equal(got_logits, want_logits)  # the same host arithmetic, bit for bit
    assert m.cuda.last_kernel_us == 250.0
    assert len(fake.launches) == m.steps  # one launch per step
    # a quantum of 4 greedy steps is one launch: its rows, stop ids and epilogue words
    # uploaded (the fake runs the host build's quantum on them); the native library's tokens
    reqs = [Request(tuple(p), NEW, stop_ids=(int(want[0][3]),)) for p in PROMPTS]
    native_q = generate(
        NativeModel.from_bundle(path, max_batch=4, verify=VERIFY), reqs, multi_step=4
    )
    before = len(fake.launches)
    assert generate(m, reqs, multi_step=4) == native_q
    quanta = fake.launches[before:]
    assert sum(p["n_steps"] for p in quanta) == m.steps - before
    assert any(p["n_steps"] == 4 and p["quantum"] for p in quanta)
    # the device arena is allocated once; weights are uploaded once across rungs
    assert len({p["arena"] for p in fake.launches}) == 1
    assert len({p["plan"] for p in fake.launches}) == len(m.cuda._rungs)
    # a stochastic row's epilogue reads the logits from the device
    params = SamplingParams(temperature=0.8, top_k=20, seed=3)
    a = generate(m, [Request(tuple(PROMPTS[1]), NEW, params)])
    native = NativeModel.from_bundle(path, max_batch=4, verify=VERIFY)
    b = generate(native, [Request(tuple(PROMPTS[1]), NEW, params)])
    assert a == b


# -- the kernel itself on CPU threads (kernels/device.cu built with PLOW_EMULATE) ------------
EMU_THREADS = 64  # threads per CTA in the emulation build (2 warps: the column split runs)
EMU_WORKERS = 8  # an h200 plan for 8 SMs: 8 OS threads of 64 fibers per launch


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """device.cu compiled for the host with PLOW_EMULATE: `plow_emu_launch` runs plow_step
    with one std::thread per GPU thread (the same source as the CUDA build)."""
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler for the emulation build")
    out = tmp_path_factory.mktemp("emu") / "plow_device_emu.so"
    r = subprocess.run(
        [cxx, "-std=c++20", "-O2", "-DPLOW_EMULATE", f"-DPLOW_BLOCK_THREADS={EMU_THREADS}",
         "-x", "c++", "-fPIC", "-shared", "-pthread", "-ffp-contract=off",
         "-Wall", "-Wextra", "-Werror", str(DEVICE_SRC), "-o", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    lib = ctypes.CDLL(str(out))
    lib.plow_emu_launch.restype = ctypes.c_int
    lib.plow_emu_launch.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p]
    return lib


class EmulatedGpu(FakeDriver):
    """The fake driver whose launch runs the kernel's own code (the emulation build)."""

    def __init__(self, emu: ctypes.CDLL) -> None:
        super().__init__()
        self.emu = emu

    def cuLaunchCooperativeKernel(
        self, f: str, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int,
        stream: object, params: int,
    ) -> tuple[int]:  # fmt: skip
        arr = (ctypes.c_void_p * len(abi.PARAMS)).from_address(params)
        self.launches.append(
            {n: int(ct.from_address(int(arr[i])).value) for i, (n, ct) in enumerate(abi.PARAMS)}
        )
        assert shmem <= max(self.smem_allowed, 48 * 1024)
        assert self.emu.plow_emu_launch(gx, bx, shmem, params) == 0
        return (0,)


@pytest.fixture
def on_emulator(
    emulator: ctypes.CDLL, cubin: Path, monkeypatch: pytest.MonkeyPatch, fresh_driver: object,
) -> EmulatedGpu:  # fmt: skip
    monkeypatch.setattr(abi, "BLOCK_THREADS", EMU_THREADS)
    # the scalar path unless a test asks for tensor cores: its bits are the host build's
    monkeypatch.setenv("PLOW_CUDA_TENSOR_CORES", "0")
    gpu = EmulatedGpu(emulator)
    real = importlib.import_module
    monkeypatch.setattr(
        driver.importlib, "import_module",
        lambda name: gpu if name == "cuda.bindings.driver" else real(name),
    )  # fmt: skip
    monkeypatch.setenv("PLOW_CUDA_CUBIN", str(cubin))
    return gpu


@pytest.fixture(scope="module")
def small_h200_bundles(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """h200 plans for a few SMs: 8 workers (nothing split), and 16 workers with cheap tiles so
    the tiler splits linear, rmsnorm, attention and sample (partials + merges)."""
    from plow.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("cuda-small")
    h200 = load_target("h200")
    small = h200.model_copy(update={"workers": EMU_WORKERS})
    split = h200.model_copy(update={"workers": 2 * EMU_WORKERS, "tile_overhead_ns": 10})
    bf16 = make_tiny_checkpoint("llama", 4, root / "llama-bf16-ckpt", dtype="bfloat16")
    sources = {
        "llama": (tiny_checkpoints["llama"], small),
        "qwen3": (tiny_checkpoints["qwen3"], small),
        "gemma3": (tiny_checkpoints["gemma3"], small),
        "llama-split": (tiny_checkpoints["llama"], split),
        "llama-bf16-split": (bf16, split),
    }
    out = {}
    for name, (ck, target) in sources.items():
        out[name] = root / name
        # unverified: `plow verify` holds a bundle to its target's shipped spec (132 SMs)
        compile_bundle(ck, out[name], target, PROFILE)
    return out


EMU_BUNDLES = ["llama", "qwen3", "gemma3", "llama-split", "llama-bf16-split"]


@pytest.mark.parametrize("name", EMU_BUNDLES)
def test_the_kernel_emulated_on_cpu_threads_gives_the_native_bits(
    small_h200_bundles: dict, on_emulator: EmulatedGpu, name: str
) -> None:
    """The kernel's code — queue walk, scoped waits and signals on monotonic counters, the
    warp-parallel GEMV (one row and four-row blocks, fp32 and bf16) and rmsnorm, the
    element-wise split, attention's row split, split reductions and their merges — run with
    real concurrency gives the host build's tokens and logits bit for bit (here the
    transcendentals are glibc's on both sides; on a GPU they are CUDA's)."""
    from plow.runtime.cuda import open_cuda

    path = small_h200_bundles[name]
    native = NativeModel.from_bundle(path, max_batch=4, verify=False)
    want, want_logits = _tokens_and_logits(native)
    want1 = generate(native, [Request(tuple(PROMPTS[1]), NEW)])  # the batch-1 rung
    # the scalar path (tensor cores: test_the_emulated_tensor_core_tiles_...), with the plan's
    # on-chip pages in shared memory: linear inputs staged there, attention's scratch there
    m = open_cuda(path, max_batch=4, verify=False, tensor_cores=False)
    got, got_logits = _tokens_and_logits(m)
    assert got == want
    assert np.array_equal(got_logits, want_logits)
    assert generate(m, [Request(tuple(PROMPTS[1]), NEW)]) == want1
    plan = m.plan(m.decode_bucket(1))
    assert len(plan.stream.queues) in (EMU_WORKERS, 2 * EMU_WORKERS)
    split = {o.kind for o in plan.ops if o.reduction_axis is not None}
    if "split" in name:
        assert {"linear", "attention"} <= split
    if name == "llama-split":  # R18 fuses the first norm: its add_rmsnorms split instead
        assert split & {"rmsnorm", "add_rmsnorm"}
    if "bf16" in name:
        assert str(m.weights["model.layers.0.mlp.down_proj.weight"].dtype) == "bfloat16"
    rung = m.cuda._rung(plan)
    assert rung.smem_bytes > 0 and rung.page_table is not None and rung.tensor_core_ops == 0
    assert np.count_nonzero(rung.page_table.table[:, 1]) > 0


@pytest.mark.slow
def test_the_emulated_kernel_is_deterministic_whatever_the_timing(
    small_h200_bundles: dict, on_emulator: EmulatedGpu
) -> None:
    path = small_h200_bundles["llama"]
    first = _run(path)
    for jitter in (0, 20_000, 100_000):
        assert _run(path, jitter_ns=jitter) == first, jitter


@pytest.mark.slow
def test_the_emulated_kernel_shows_a_lowered_threshold_and_stops_on_a_raised_one(
    small_h200_bundles: dict, on_emulator: EmulatedGpu, tmp_path: Path
) -> None:
    from plow.runtime.cuda import CudaStepError, open_cuda

    path = small_h200_bundles["llama"]
    want = _run(path)
    low = tmp_path / "low"
    assert _edit_thresholds(path, low, "decode_b4_s96.bin", -1) > 0
    assert any(_run(low, jitter_ns=200_000) != want for _ in range(3))
    high = tmp_path / "high"
    assert _edit_thresholds(path, high, "decode_b4_s96.bin", +1) == 1
    m = open_cuda(high, max_batch=4, verify=False, timeout_ms=300)
    with pytest.raises(CudaStepError, match=r"step stuck: worker \d+ blocked at packet \d+"):
        generate(m, [Request(tuple(p), 3) for p in PROMPTS])


def test_a_module_built_from_other_sources_is_refused(
    h200_bundles: dict, cubin: Path, monkeypatch: pytest.MonkeyPatch, fresh_driver: object,
) -> None:  # fmt: skip
    from plow.runtime.cuda import open_cuda

    fake = FakeDriver()
    fake.config[4] += 8  # its PlowPlan is 8 bytes longer than the loader's
    real = importlib.import_module
    monkeypatch.setattr(
        driver.importlib, "import_module",
        lambda name: fake if name == "cuda.bindings.driver" else real(name),
    )  # fmt: skip
    monkeypatch.setenv("PLOW_CUDA_CUBIN", str(cubin))
    with pytest.raises(CudaUnavailable) as e:
        open_cuda(h200_bundles["llama"], verify=VERIFY)
    msg = _one_line(e.value)
    size = ctypes.sizeof(abi.PlowPlan)
    assert (
        "built from other sources" in msg and f"sizeof(PlowPlan) {size + 8} (loader: {size})" in msg
    )
    assert "make cuda" in msg


# -- multi-step quantum, tensor-core tiles, on-chip pages (emulated) -------------------------
def test_the_emulated_quantum_launch_equals_one_launch_per_step(
    small_h200_bundles: dict, on_emulator: EmulatedGpu
) -> None:
    """k greedy decode steps in one launch (the kernel's step barrier and epilogue writing the
    ring, budgets and positions; the sampled id read by the next step's embedding from where
    the sample op wrote it) give the bits of k launches with the host's epilogue: tokens and
    the whole device arena, a stop id and a budget ending rows inside a quantum."""
    from plow.runtime.cuda import open_cuda

    path = small_h200_bundles["llama-split"]
    ref = generate(NativeModel.from_bundle(path, max_batch=4, verify=False),
                   [Request(tuple(p), NEW) for p in PROMPTS])  # fmt: skip
    stop = int(ref[1][5])  # row 1 stops inside a quantum
    reqs = [Request(tuple(p), NEW - 3 * i, stop_ids=(stop,)) for i, p in enumerate(PROMPTS)]
    out = {}
    for quantum in (False, True):
        m = open_cuda(path, max_batch=4, verify=False, tensor_cores=False, device_quantum=quantum)
        before = len(on_emulator.launches)
        toks = generate(m, reqs, multi_step=4)
        launches = on_emulator.launches[before:]
        arena = m.cuda.snapshot().view(np.uint32)
        for rows in (1, 4):  # the ring and budgets: the host's own words under its epilogue
            for slot in (RING, REMAINING):
                off, n = m.cuda._slot(m.plan(m.decode_bucket(rows)), slot)
                arena[off // 4 : (off + n) // 4] = 0
        out[quantum] = (toks, arena.tobytes(), launches, m.steps)
    (t0, a0, l0, s0), (t1, a1, l1, s1) = out[False], out[True]
    assert t1 == t0 and s1 == s0
    assert a1 == a0  # every other word of the device arena: bit for bit
    assert all(p["n_steps"] == 1 and p["quantum"] == 0 for p in l0) and len(l0) == s0
    assert max(p["n_steps"] for p in l1) == 4 and len(l1) < len(l0)
    assert sum(p["n_steps"] for p in l1) == s1
    assert t0[1][-1] == stop and len(t0[1]) < NEW


def test_the_emulated_quantum_samples_stochastic_rows_on_the_device(
    small_h200_bundles: dict, on_emulator: EmulatedGpu
) -> None:
    """Stochastic rows (temperature with top-k, top-p, min-p, and none of them) stay inside
    the quantum's one launch: the CTA's sampler (kernels/device_sampler.h) draws each token
    with the row's own uniforms, and the tokens are the native executor's (the host sampler,
    kernels/sampler.h) — in a batch beside a greedy row, with a stop id inside a quantum."""
    from plow.runtime.cuda import open_cuda

    path = small_h200_bundles["llama-split"]
    params = [
        SamplingParams(temperature=0.9, top_k=7, seed=11),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02, seed=5),
        SamplingParams(temperature=0.7, seed=2),
    ]
    reqs = [Request(tuple(p), NEW, params=sp) for p, sp in zip(PROMPTS, params, strict=True)]
    reqs.append(Request(tuple(PROMPTS[0][:4]), NEW))  # a greedy row beside them
    native = NativeModel.from_bundle(path, max_batch=4, verify=False)
    want = generate(native, reqs, multi_step=4)
    stop = int(want[1][4])  # row 1 stops inside a quantum
    reqs[1] = Request(tuple(PROMPTS[1]), NEW, params=params[1], stop_ids=(stop,))
    want = generate(NativeModel.from_bundle(path, max_batch=4, verify=False), reqs, multi_step=4)
    m = open_cuda(path, max_batch=4, verify=False, tensor_cores=False)
    before = len(on_emulator.launches)
    got = generate(m, reqs, multi_step=4)
    launches = on_emulator.launches[before:]
    assert got == want
    assert want[1][-1] == stop and len(want[1]) < NEW
    assert len({tuple(t) for t in want[:3]}) == 3  # the three draws differ
    assert max(p["n_steps"] for p in launches) == 4  # the stochastic rows ran in the quantum
    greedy = generate(NativeModel.from_bundle(path, max_batch=4, verify=False),
                      [Request(r.prompt, NEW) for r in reqs[:3]])  # fmt: skip
    assert got[:3] != greedy  # it sampled


def test_the_emulated_tensor_core_tiles_agree_with_the_scalar_path(
    small_h200_bundles: dict, on_emulator: EmulatedGpu
) -> None:
    """bf16 linears on (emulated) mma.sync m16n8k16: the fragment layout and the hi/lo split
    of x give the scalar path's logits within 1e-3 (a different summation order: not the same
    bits) and the same greedy tokens."""
    from plow.runtime.cuda import open_cuda

    path = small_h200_bundles["llama-bf16-split"]
    scalar = open_cuda(path, max_batch=4, verify=False, tensor_cores=False)
    want, want_logits = _tokens_and_logits(scalar)
    tc = open_cuda(path, max_batch=4, verify=False, tensor_cores=True)
    got, got_logits = _tokens_and_logits(tc)
    plan = tc.plan(tc.decode_bucket(4))
    assert tc.cuda._rung(plan).tensor_core_ops >= 4
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-3, atol=1e-3)
    assert not np.array_equal(got_logits, want_logits)  # it did run the other path
    assert got == want


@pytest.mark.parametrize("name", ["llama", "llama-bf16-split"])
def test_the_emulated_kernel_reads_linear_weights_from_their_filled_weight_pages(
    small_h200_bundles: dict, on_emulator: EmulatedGpu, monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:  # fmt: skip
    """A linear tile whose weights fit its task's weight window (the page timeline's slab) is
    copied there — by the tile itself, or for a hoisted load (a task's first tile) by the
    record before it on the queue — and read from there: the native executor's bits. Getting
    the fill wrong shows as wrong bytes: the hoisting records not loading the next task's
    tile (the task reads a window nothing filled); the weight window put on the record's
    activation window (x staged over the weights)."""
    from plow.runtime.cuda import image, open_cuda

    path = small_h200_bundles[name]
    native = NativeModel.from_bundle(path, max_batch=4, verify=False)
    reqs = [Request(tuple(p), NEW) for p in PROMPTS]
    want = generate(native, reqs)
    want_logits = _tokens_and_logits(native)[1]
    m = open_cuda(path, max_batch=4, verify=False, tensor_cores=False)
    got, got_logits = _tokens_and_logits(m)
    assert got == want and np.array_equal(got_logits, want_logits)
    table = m.cuda._rung(m.plan(m.decode_bucket(4))).page_table
    dev = table.device_table()
    assert dev.shape[1] == image.PAGE_WORDS
    assert (dev[:, 4:6] == table.weights).all() and np.count_nonzero(dev[:, 5]) > 0
    hoisted = np.flatnonzero(dev[:, 3])
    assert len(hoisted) > 0 and sorted(hoisted) == sorted(dev[dev[:, 2] >= 0, 2])
    # tasks of several tiles: tile 0 loaded ahead, the others copied by the task itself
    rung = m.cuda._rung(m.plan(m.decode_bucket(4)))
    assert (rung.image.records_host["rows"][dev[:, 5] > 0] > 1).any()
    real = image.PageTable.device_table

    def wrong(mutate):  # the tokens and prefill logits with the page table mutated
        def table_of(self: image.PageTable) -> np.ndarray:
            t = real(self)
            mutate(t)
            return t

        monkeypatch.setattr(image.PageTable, "device_table", table_of)
        bad = open_cuda(path, max_batch=4, verify=False, tensor_cores=False)
        toks, lg = _tokens_and_logits(bad)
        monkeypatch.setattr(image.PageTable, "device_table", real)
        return toks != want or not np.array_equal(lg, want_logits)

    def not_hoisted(t: np.ndarray) -> None:  # the record before does not load them
        t[:, 2] = -1

    def on_act(t: np.ndarray) -> None:  # weights filled over the staged input rows
        both = (t[:, 5] > 0) & (t[:, 1] > 0)
        t[both, 4] = t[both, 0]

    assert wrong(not_hoisted)
    assert wrong(on_act)


def test_the_page_table_follows_the_plans_page_timeline(small_h200_bundles: dict) -> None:
    """Each record's shared-memory windows come from its task's page columns: sizes are the
    timeline's pages, every window lies inside the budget, and windows live at the same time
    on one worker never share a byte."""
    from plow.bundle.files import ScheduleFile
    from plow.runtime.cuda.image import assign_pages

    m = NativeModel.from_bundle(small_h200_bundles["llama-split"], max_batch=4, verify=False)
    b = m.bundle
    assert b is not None
    rung = b.rung(m.decode_bucket(4))
    _, records = read_plan(b.path / rung.plan)
    pg = ScheduleFile.model_validate_json((b.path / rung.schedule).read_bytes()).pages
    t = assign_pages(records, pg.budget_pages, pg.page_bytes, pg.start, pg.finish, pg.load,
                     pg.weight_pages, pg.act_pages)  # fmt: skip
    assert t.smem_bytes == pg.budget_pages * pg.page_bytes
    tasks = np.flatnonzero(records["opcode"] != 0)
    wins: dict[int, list[tuple[int, int, int, int]]] = {}
    for i, rec in enumerate(tasks.tolist()):
        for tab, pages, st in (
            (t.table, pg.act_pages, pg.start),
            (t.weights, pg.weight_pages, pg.load),
        ):  # noqa: E501
            off, nbytes = (int(v) for v in tab[rec])
            assert nbytes == pages[i] * pg.page_bytes
            assert off % pg.page_bytes == 0 and off + nbytes <= t.smem_bytes
            if nbytes:
                w = int(records["worker"][rec])
                wins.setdefault(w, []).append((st[i], max(pg.finish[i], st[i] + 1), off, nbytes))
    assert sum(len(v) for v in wins.values()) > len(tasks)  # weight and activation windows
    for lst in wins.values():
        for j, (s0, e0, o0, n0) in enumerate(lst):
            for s1, e1, o1, n1 in lst[j + 1 :]:
                if s0 < e1 and s1 < e0:  # live together
                    assert o0 + n0 <= o1 or o1 + n1 <= o0
    # hoisted weight loads: the record before a hoisted task on its worker prefetches it, and
    # the task's load opens at that record's start (plow.memory.onchip.plan_pages)
    assert t.prefetch is not None
    index = {int(r): i for i, r in enumerate(tasks.tolist())}
    hoisted = [i for i in range(len(tasks)) if pg.weight_pages[i] and pg.load[i] < pg.start[i]]
    assert hoisted and int(np.count_nonzero(t.prefetch >= 0)) == len(hoisted)
    for rec in np.flatnonzero(t.prefetch >= 0).tolist():
        nxt = int(t.prefetch[rec])
        assert index[nxt] in hoisted and records["worker"][nxt] == records["worker"][rec]
        assert pg.load[index[nxt]] == pg.start[index[rec]]
        same = [r for r in tasks.tolist() if records["worker"][r] == records["worker"][rec]]
        assert same[same.index(rec) + 1] == nxt  # the next task on the queue
    assert (t.device_table()[:, 2] == t.prefetch).all()
    # nothing past the budget is placed: one page short, the timeline's peak does not fit
    with pytest.raises(PlowError, match="free pages"):
        assign_pages(records, 1, pg.page_bytes, pg.start, pg.finish, pg.load,
                     pg.weight_pages, pg.act_pages)  # fmt: skip
