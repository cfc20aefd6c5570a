"""Benchmark: `plow serve --replicas` on Ray Serve: requests/s and TTFT of 1 vs 2 replicas, and
the prefix-affinity router's prefix hit rate against Ray's prefix-blind router.

One local Ray; for each case (1 replica; 2 replicas with the prefix router; 2 replicas with Ray's
default power-of-two-choices router, which ignores the prompt) the app is deployed, warmed up,
and sent ``--requests`` streamed completions, ``--concurrency`` at a time, whose prompts are one
of ``--prefixes`` shared prefixes plus a distinct suffix. Per request the client records the
time to the first SSE chunk (TTFT), the end, and the replica that answered (`x-plow-replica`).
A request is a prefix *hit* when its replica had already answered a request with the same prefix
(what that replica's prefix cache reuses); the first request of a prefix on a replica is a
miss, so perfect affinity scores 1 - prefixes / requests.

On this 2-core machine, shared with other jobs, two replicas compete for the same two cores as
the client and Ray itself: the ceiling is about the throughput of one replica with both cores,
so 2 replicas show the routing overhead and the hit rate here rather than a speed-up (that needs
one node or one GPU per replica). Do not publish numbers measured while other jobs load the
machine: ``--dry-run`` runs a few requests of a tiny fixture bundle and writes nothing.

Usage: ``python benchmarks/replicas.py [--model DIR] [--requests N] [--concurrency C]
[--prefixes K] [--max-tokens T] [--dry-run]``. Without ``--dry-run`` it writes
``results/benchmarks/replicas.{json,md}``.
"""

# ruff: noqa: E501  (report tables)
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: 2 shared cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "benchmarks"
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
]
CASES = (
    ("1 replica", 1, "prefix"),
    ("2 replicas, prefix router", 2, "prefix"),
    ("2 replicas, pow-2 router", 2, "pow2"),
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def tiny_bundle(tmp: Path) -> Path:
    """The serving tests' tiny Llama, compiled for the cpu target (context 64)."""
    from plow.emit.bundle import compile_bundle
    from plow.profile import CompileProfile
    from plow.target import load_target
    from plow.testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("llama", 0, tmp / "tiny-llama")
    out = tmp / "tiny-llama-bundle"
    profile = CompileProfile(
        name="bench", decode_batches=(1, 2, 4, 8), prefill_seqs=(16,), context=64
    )
    compile_bundle(ckpt, out, load_target("cpu"), profile, verify=True)
    return out


def prompts(n: int, prefixes: int, prefix_words: int, seed: int = 0) -> list[tuple[int, str]]:
    """``n`` (prefix index, prompt) pairs in a shuffled order, the prefixes used evenly."""
    rng = random.Random(seed)
    heads = [" ".join(rng.choice(WORDS) for _ in range(prefix_words)) for _ in range(prefixes)]
    out = [(i % prefixes, f"{heads[i % prefixes]} {i}") for i in range(n)]
    rng.shuffle(out)
    return out


def one_request(url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        replica = r.headers.get("x-plow-replica", "?")
        for line in r.iter_lines():
            if line.startswith("data:") and ttft is None:
                ttft = time.perf_counter() - t0
        status = r.status_code
    return {"status": status, "replica": replica, "ttft_s": ttft, "e2e_s": time.perf_counter() - t0}


def hit_rate(results: list[dict[str, Any]], order: list[int]) -> float:
    """Share of requests whose replica had answered the same prefix before (in send order)."""
    seen: set[tuple[int, str]] = set()
    hits = 0
    for prefix, r in zip(order, results, strict=True):
        key = (prefix, r["replica"])
        hits += key in seen
        seen.add(key)
    return hits / len(results) if results else 0.0


def run_case(
    model_dir: Path, replicas: int, router: str, port: int, args: argparse.Namespace
) -> dict[str, Any]:
    from ray import serve

    from plow.serve import replicas as rp

    load = {
        "name": "bench",
        "max_num_seqs": args.slots,
        "max_num_batched_tokens": 64,
        "executor": args.executor,
    }
    if args.threads:
        load["threads"] = args.threads
    t0 = time.perf_counter()
    app = rp.build_app(model_dir, replicas, load, router=router, replica_cpus=0.5)
    rp.serve_replicas(app, "127.0.0.1", port, blocking=False)
    started = time.perf_counter() - t0
    url = f"http://127.0.0.1:{port}"
    for _ in range(2):  # warm-up: first requests pay imports and lazy setup
        one_request(url, "bench", "warm up", 2)
    work = prompts(args.requests, args.prefixes, args.prefix_words)
    t1 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda w: one_request(url, "bench", w[1], args.max_tokens), work))
    wall = time.perf_counter() - t1
    serve.delete(rp.APP_NAME)
    ok = [r for r in results if r["status"] == 200]
    ttft = sorted(r["ttft_s"] for r in ok if r["ttft_s"] is not None)
    return {
        "replicas": replicas,
        "router": router,
        "start_s": started,
        "requests": len(results),
        "ok": len(ok),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))] if ttft else None,
        "prefix_hit_rate": hit_rate(results, [p for p, _ in work]),
        "perfect_hit_rate": 1 - len({(p,) for p, _ in work}) / len(work) if work else None,
        "per_replica": {
            k: sum(1 for r in results if r["replica"] == k)
            for k in sorted({r["replica"] for r in results})
        },
    }


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    threads = f", {args.threads} thread(s) per replica" if args.threads else ""
    lines = [
        "# `plow serve --replicas` on Ray Serve",
        "",
        f"`python benchmarks/replicas.py --executor {args.executor}"
        f"{f' --threads {args.threads}' if args.threads else ''}"
        f"{f' --model {args.model}' if args.model else ''}`",
        "",
        f"{args.requests} streamed completions, {args.concurrency} at a time, {args.prefixes} shared "
        f"prefixes, {args.max_tokens} tokens each; model {args.model or 'tiny fixture bundle'}; "
        f"executor {args.executor}{threads}; {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.2f} at the end.",
        "",
        "| case | requests/s | TTFT p50 ms | TTFT p90 ms | prefix hit rate (perfect) | per replica | start s |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for (name, _, _), r in zip(CASES, rows, strict=True):
        lines.append(
            f"| {name} | {r['requests_per_s']:.2f} | {1e3 * (r['ttft_p50_s'] or 0):.1f} | "
            f"{1e3 * (r['ttft_p90_s'] or 0):.1f} | {r['prefix_hit_rate']:.2f} ({r['perfect_hit_rate']:.2f}) | "
            f"{', '.join(str(v) for v in r['per_replica'].values())} | {r['start_s']:.1f} |"
        )
    lines += [
        "",
        "## Limits",
        "",
        f"- One machine with {os.cpu_count()} cores: the client, Ray's proxy and router, the ingress and",
        "  every replica share them, so two replicas cannot serve more than one replica with all",
        "  the cores (the ceiling); the table shows the routing's overhead and its prefix hit",
        "  rate, not a scale-out speed-up (that needs a node or a GPU per replica).",
        "- A prefix hit is counted from the replica that answered (its `x-plow-replica` header),",
        "  in send order; perfect affinity is 1 - prefixes / requests. Ray's prefix router",
        "  balances load instead once queues differ by more than a full batch (the slots).",
        "- One run of each case; no repeats, so differences of a few percent are noise. The",
        "  load average above includes other jobs on the machine when there were any.",
    ]
    if args.threads:
        lines.append(
            f"- {args.threads} host thread(s) per replica in every case: one replica uses "
            f"{args.threads} of the {os.cpu_count()} cores, two use {2 * args.threads}."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", type=Path, help="a bundle or checkpoint (default: the tiny fixture bundle)"
    )
    ap.add_argument("--executor", default="cpu", help="executor of each replica (default cpu)")
    ap.add_argument(
        "--threads", type=int, default=0, help="host threads per replica (--executor native)"
    )
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prefix-words", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--dry-run", action="store_true", help="a few requests of the tiny bundle; write nothing"
    )
    args = ap.parse_args()
    if args.dry_run:
        args.requests, args.concurrency, args.prefixes, args.model = 8, 2, 2, None

    import ray

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tiny_bundle(Path(tmp))
        ray.init(include_dashboard=False, log_to_driver=False, namespace="plow")
        try:
            port = _port()  # Serve's HTTP proxy keeps the port it started on: one for all cases
            rows = [run_case(model_dir, n, router, port, args) for _, n, router in CASES]
        finally:
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    text = report(rows, args)
    print(text)
    if args.dry_run:
        print("(dry run: nothing written)")
        return
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.node(),
        "cores": os.cpu_count(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (OUT / "replicas.json").write_text(json.dumps({"meta": meta, "cases": rows}, indent=1) + "\n")
    (OUT / "replicas.md").write_text(text)


if __name__ == "__main__":
    main()
