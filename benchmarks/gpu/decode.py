"""Batch-1 decode on the CUDA executor against the HBM roofline (benchmarks/gpu/run.sh).

For each shape (Llama-3.2-1B, Llama-3.1-8B): a checkpoint with the model's config
(transformers' LlamaConfig) and generated bf16 weights (random bits of a small magnitude,
streamed straight into safetensors: no framework, no download), compiled for the h200 target
with one decode rung (batch 1) and no prefill rungs, run by `open_cuda`: a short prompt, then
greedy decode in quanta of 4 steps (one launch each), twice: tensor-core linears (the default
for bf16 weights) and the scalar tiles. Reported per shape: µs per decode step (wall: host +
launch + copies; and kernel: CUDA events around the launch; a launch of k steps counts k
steps), the tensor-core linears and shared-memory pages used, whether both runs' tokens
agree, and the roofline — the bytes a step must read from
HBM (every weight the step reads, in its stored dtype, plus the key-value rows attention reads)
over the target's bandwidth (H200: 4.8 TB/s) — and the measured fraction of it.

`--dry-run` does everything that needs no GPU (configs, the weight and byte accounting, a
plan-only compile of each shape) and writes the same JSON / markdown with the GPU columns
empty, so the script's Python is exercised where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}  # fmt: skip
TARGET = "h200"
PROMPT = [128000, 791, 6864, 315, 9822, 374, 12366, 13]


@dataclass
class Row:
    shape: str
    parameters: int
    weight_bytes: int  # stored weights, each tensor once
    step_bytes: float  # HBM bytes one decode step reads (mean over the measured steps)
    context: int
    decode_tokens: int
    roofline_us: float
    compile_s: float = 0.0
    workers: int = 0
    records: int = 0
    wall_us: float | None = None  # per decode step, host round trip included
    kernel_us: float | None = None  # per decode step, the launch alone (CUDA events)
    wall_fraction: float | None = None  # roofline / measured
    kernel_fraction: float | None = None
    tokens: list[int] = field(default_factory=list)
    # the same bundle on the scalar tiles (tensor cores off): the bitwise-deterministic path
    scalar_wall_us: float | None = None
    scalar_kernel_us: float | None = None
    tensor_core_ops: int = 0  # linears of the decode rung on tensor cores (the default run)
    smem_bytes: int = 0  # dynamic shared memory per CTA (the plan's on-chip pages)
    tokens_equal: bool | None = None  # tensor-core tokens == scalar tokens
    note: str = ""


def hf_config(shape: str) -> Any:
    import transformers

    cfg = dict(SHAPES[shape])
    cfg.update(bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")
    return transformers.LlamaConfig(**cfg)


def tensor_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, from transformers' own model class on the meta
    device (no memory)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    out = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def random_bf16(n: int, rng: np.random.Generator, norm: bool) -> np.ndarray:
    """n bf16 values as uint16 bits: norms 1.0; weights a random sign and mantissa with an
    exponent in [2^-8, 2^-4) — magnitudes like a trained model's, generated at memory speed."""
    if norm:
        return np.full(n, 0x3F80, dtype=np.uint16)
    r = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    exp = (np.uint16(0x77) + ((r >> np.uint16(7)) & np.uint16(3))) << np.uint16(7)
    return (r & np.uint16(0x807F)) | exp


def write_checkpoint(shape: str, out: Path, *, weights: bool, seed: int = 0) -> Path:
    """config.json, a tokenizer, and (weights=True) model.safetensors streamed tensor by
    tensor."""
    from plow.testing import train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(shape)
    config.save_pretrained(out)
    if not weights:
        return out
    tok = train_tokenizer(512)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"})
    )
    shapes = tensor_shapes(config)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, shp in shapes.items():
        nbytes = math.prod(shp) * 2
        header[name] = {"dtype": "BF16", "shape": list(shp), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    chunk = 1 << 26
    with (out / "model.safetensors").open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shp in shapes.items():
            left = math.prod(shp)
            while left:
                n = min(left, chunk)
                f.write(random_bf16(n, rng, "norm" in name).tobytes())
                left -= n
    return out


def oracle_present() -> bool:
    from plow.errors import PlowError
    from plow.oracle.runner import oracle_binary

    try:
        oracle_binary()
    except PlowError:
        return False
    return True


def compile_shape(src: Path, out: Path, context: int, *, plan_only: bool) -> tuple[float, bool]:
    from plow.emit.bundle import compile_bundle
    from plow.profile import CompileProfile
    from plow.target import load_target

    profile = CompileProfile(name="gpu-decode", decode_batches=(1,), context=context)
    verify = oracle_present() and not plan_only
    t0 = time.perf_counter()
    compile_bundle(src, out, load_target(TARGET), profile, verify=verify, plan_only=plan_only)
    return time.perf_counter() - t0, verify


def step_bytes(
    bundle: Path, context: int, positions: list[int]
) -> tuple[int, int, float, int, int]:
    """(parameters, stored weight bytes, mean HBM bytes per decode step over `positions`,
    workers, records) from the bundle's decode plan: each weight a step reads once (an
    embedding lookup reads one row), plus attention's key / value rows (fp32 pool)."""
    from plow.bundle.files import OpTable
    from plow.bundle.manifest import read_manifest
    from plow.bundle.wire import read_plan

    m = read_manifest(bundle)
    rung = next(r for r in m.ladder if r.phase == "decode" and r.batch == 1)
    del context
    ops = OpTable.model_validate_json((bundle / rung.ops).read_bytes())
    _, records = read_plan(bundle / rung.plan)
    tensors = ops.tensors
    cfg = json.loads((bundle / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kvh = cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    size = {"bfloat16": 2, "float16": 2, "float32": 4}
    read: dict[str, int] = {}  # bytes a step reads of each weight (a tied table: all of it)
    for op in ops.ops:
        for name in op.inputs[1:]:
            t = tensors.get(name)
            if t is None or t.role != "weight":
                continue
            row = t.shape[-1] if op.kind == "embedding" else math.prod(t.shape)
            read[name] = max(read.get(name, 0), row * size.get(t.dtype, 4))
    params = sum(math.prod(tensors[n].shape) for n in read)
    stored = sum(math.prod(tensors[n].shape) * size.get(tensors[n].dtype, 4) for n in read)
    kv = [layers * 2 * kvh * hd * 4 * (p + 1) for p in positions]  # fp32 key-value pool
    workers = len({int(w) for w in records["worker"]})
    return params, stored, sum(read.values()) + float(np.mean(kv)), workers, len(records)


def measure(
    bundle: Path, verify: bool, new: int, tensor_cores: bool
) -> tuple[float, float, list[int], int, int]:
    """(wall µs, kernel µs) per decode step, the tokens, the decode rung's tensor-core linears
    and its dynamic shared memory. Greedy decode in quanta of 4 steps: one launch each (the
    kernel's step barrier and epilogue); a launch of k steps counts k steps."""
    from plow.runtime.cpu import Request, generate
    from plow.runtime.cuda import open_cuda

    m = open_cuda(bundle, verify=verify, max_batch=1, timing=True, tensor_cores=tensor_cores)
    walls: list[float] = []
    kernels: list[float] = []
    machine = m.cuda
    inner = machine._launch

    def timed(plan: Any, steps: int, quantum: Any) -> Any:
        t0 = time.perf_counter()
        st = inner(plan, steps, quantum)
        if plan.bucket.phase.value == "decode":
            walls.extend([(time.perf_counter() - t0) / steps] * steps)
            kernels.extend([machine.last_kernel_us / steps] * steps)
        return st

    machine._launch = timed  # type: ignore[method-assign]
    try:
        generate(m, [Request(tuple(PROMPT), 8)], multi_step=4)  # warm-up: module, uploads
        walls.clear()
        kernels.clear()
        toks = generate(m, [Request(tuple(PROMPT), new)], multi_step=4)[0]
        rung = machine._rung(m.plan(m.decode_bucket(1)))
        tc, smem = rung.tensor_core_ops, rung.smem_bytes
    finally:
        machine.close()  # the 8B shape's weights: freed before the next run uploads its own
    return 1e6 * float(np.median(walls)), float(np.median(kernels)), toks, tc, smem


def measure_isolated(
    bundle: Path, verify: bool, new: int, tensor_cores: bool, timeout: float = 240.0
) -> tuple[float, float, list[int], int, int] | str:
    """`measure` in a child process (a GPU fault is sticky for its CUDA context: one path's
    failure must not take the other's numbers with it); the error's last line when it fails."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", str(bundle)]
    cmd += ["--new", str(new), "--tc", str(int(tensor_cores))] + (["--verify"] if verify else [])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("MEASURED ")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["?"])[-1]
        return f"exit {r.returncode}: {tail[:300]}"
    w, k, toks, tc, smem = json.loads(lines[-1][len("MEASURED ") :])
    return float(w), float(k), [int(t) for t in toks], int(tc), int(smem)


def tool_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for cmd, key in ((["nvcc", "--version"], "nvcc"), (["nvidia-smi", "-L"], "gpu")):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            out[key] = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        except (OSError, subprocess.SubprocessError):
            out[key] = "absent"
    return out


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    lines = [
        "# Batch-1 decode on the CUDA executor vs the HBM roofline",
        "",
        f"Target {TARGET} ({meta['bandwidth_tb_s']} TB/s), {meta['mode']}; "
        f"GPU: {meta['tools'].get('gpu', '?')}; {meta['tools'].get('nvcc', '')}.",
        "",
        "| shape | parameters | weights (GB) | bytes/step (GB) | context | workers | "
        "roofline (µs) | wall (µs/token) | kernel (µs/token) | % roofline (wall) | "
        "% roofline (kernel) | scalar kernel (µs/token) | tensor-core linears | "
        "smem/CTA (KiB) | tokens equal |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | --- |",
    ]

    def f(v: float | None, spec: str) -> str:
        return "—" if v is None else format(v, spec)

    for r in rows:
        lines.append(
            f"| {r.shape} | {r.parameters / 1e9:.2f} B | {r.weight_bytes / 1e9:.2f} | "
            f"{r.step_bytes / 1e9:.3f} | {r.context} | {r.workers} | {r.roofline_us:.0f} | "
            f"{f(r.wall_us, '.0f')} | {f(r.kernel_us, '.0f')} | "
            f"{f(None if r.wall_fraction is None else 100 * r.wall_fraction, '.1f')} | "
            f"{f(None if r.kernel_fraction is None else 100 * r.kernel_fraction, '.1f')} | "
            f"{f(r.scalar_kernel_us, '.0f')} | {r.tensor_core_ops} | {r.smem_bytes / 1024:.0f} "
            f"| {'—' if r.tokens_equal is None else r.tokens_equal} |"
        )
    lines += ["", "Notes:"] + [f"- {r.shape}: {r.note}" for r in rows if r.note]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "_build/gpu-out")))
    ap.add_argument("--work", type=Path, default=None, help="where checkpoints go (/dev/shm)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=64, help="decode tokens per shape")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: plan-only, no timings")
    ap.add_argument("--no-scalar", action="store_true", help="skip the scalar-tile run")
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s (default: target's)")
    ap.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tc", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.measure is not None:  # the child of measure_isolated: one bundle, one path
        w, k, toks, tc, smem = measure(a.measure, a.verify, a.new, bool(a.tc))
        print("MEASURED " + json.dumps([w, k, toks, tc, smem]), flush=True)
        return 0
    from plow.target import load_target

    bw = a.bandwidth or float(load_target(TARGET).bandwidth_bytes_per_s)
    shm = Path("/dev/shm")
    # the 8B shape needs about 2 x 16 GB while its checkpoint is compiled into its bundle
    roomy = shm.is_dir() and shutil.disk_usage(shm).free > 40e9
    work = a.work or (shm / "plow-gpu-bench" if roomy else ROOT / "_build" / "gpu-bench")
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for shape in [s for s in a.shapes.split(",") if s]:
        t0 = time.perf_counter()
        src, bundle = work / f"{shape}-ckpt", work / f"{shape}-bundle"
        shutil.rmtree(src, ignore_errors=True)
        write_checkpoint(shape, src, weights=not a.dry_run)
        gen_s = time.perf_counter() - t0
        secs, verify = compile_shape(src, bundle, a.context, plan_only=a.dry_run)
        shutil.rmtree(src, ignore_errors=True)  # the bundle holds its own copy of the weights
        new = a.new if "1b" in shape else max(8, a.new // 2)
        positions = list(range(len(PROMPT), len(PROMPT) + new))
        params, stored, per_step, workers, records = step_bytes(bundle, a.context, positions)
        row = Row(shape, params, stored, per_step, a.context, new, 1e6 * per_step / bw,
                  compile_s=secs, workers=workers, records=records)  # fmt: skip
        row.note = f"weights generated in {gen_s:.1f} s, compiled in {secs:.1f} s" + (
            " (certified)"
            if verify
            else " (not verified: no oracle here)"
            if not a.dry_run
            else " (plan only)"
        )
        if not a.dry_run:
            # the scalar tiles, then the default (tensor cores for the bf16 linears), each in
            # its own process
            scalar = None if a.no_scalar else measure_isolated(bundle, verify, new, False)
            if isinstance(scalar, str):
                row.note += f"; scalar run failed: {scalar}"
            elif scalar is not None:
                row.scalar_wall_us, row.scalar_kernel_us = scalar[0], scalar[1]
            got = measure_isolated(bundle, verify, new, True)
            if isinstance(got, str):
                row.note += f"; tensor-core run failed: {got}"
            else:
                wall, kern, toks, row.tensor_core_ops, row.smem_bytes = got
                row.wall_us, row.kernel_us, row.tokens = wall, kern, toks
                row.wall_fraction = row.roofline_us / wall
                row.kernel_fraction = row.roofline_us / kern if kern > 0 else None
                if scalar is not None and not isinstance(scalar, str):
                    row.tokens_equal = scalar[2] == toks
        rows.append(row)
        print(json.dumps({k: v for k, v in asdict(row).items() if k != "tokens"}), flush=True)
        if not a.dry_run:
            shutil.rmtree(bundle, ignore_errors=True)
    meta = {
        "target": TARGET,
        "bandwidth_tb_s": bw / 1e12,
        "mode": "dry run (no GPU: plan-only compiles, no timings)" if a.dry_run else "measured",
        "tools": tool_versions(),
        "prompt": PROMPT,
    }
    (a.out / "gpu_decode.json").write_text(
        json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2)
    )
    (a.out / "gpu_decode.md").write_text(markdown(rows, meta))
    print((a.out / "gpu_decode.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
