"""Benchmark: what batch invariance across rungs costs on the native executor.

A bundle's rungs (batch 1, 2, 4, 8; prefill 16, 64) are tiled separately; by default
(`TilingOptions(rung_invariant=True)`) every reducing op takes, in every rung, the reduction
steps the tiler picks for one row, so a request's logits do not depend on the rung it runs in.
This compiles the default model (SmolLM2-135M) for this machine's cpu target twice — invariant
(the default) and with the tiler's per-rung choice (`rung_invariant=False`) — records which ops'
reduction steps differ per rung, and times both bundles on the native executor in the same run:
greedy decode steps at batch 1 and 8 and a 64-token prefill, in interleaved rounds (the
variants' order alternates), wall time and this process's CPU time.

Usage: ``python benchmarks/invariance_cost.py [--rounds N] [--steps N] [--quick]``. Writes
``results/benchmarks/invariance_cost.json`` and ``.md`` (``--quick``: under /tmp only).
"""

# ruff: noqa: E501  (report tables)
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "benchmarks"
sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

from serving_overhead import raw_steps  # noqa: E402

VARIANTS = ("invariant", "per-rung")


def compile_variant(ckpt: Path, out: Path, invariant: bool) -> Path:
    """`ckpt` compiled as `plow serve` compiles it (this machine's cpu target, the checkpoint
    cache's profile for 8 slots), unverified; `invariant=False`: the tiler's per-rung choice."""
    import plow.compile
    from plow.checkpoint.loader import load_spec
    from plow.default_model import cache_dir
    from plow.emit.bundle import compile_bundle
    from plow.runtime.cpu.bundle import _note, cache_profile
    from plow.target.calibrate import cached_cpu_target
    from plow.tiles.tiler import TilingOptions

    spec = load_spec(ckpt)
    target = cached_cpu_target(cache_dir(), _note)
    saved = plow.compile.TilingOptions
    if not invariant:
        plow.compile.TilingOptions = functools.partial(TilingOptions, rung_invariant=False)  # type: ignore[misc,assignment]
    try:
        compile_bundle(ckpt, out, target, cache_profile(spec.max_position, 8), verify=False)
    finally:
        plow.compile.TilingOptions = saved  # type: ignore[misc]
    return out


def reduction_steps(bundle: Path) -> dict[str, dict[str, int]]:
    """Per rung, each reducing op's steps along its reduction axis (tiles.json)."""
    from plow.graph import OpKind
    from plow.tiles.tiler import REDUCTION_AXIS

    tiles = json.loads((bundle / "tiles.json").read_text())
    return {
        bk["bucket"]: {
            o["name"]: o["axes"][REDUCTION_AXIS[OpKind(o["kind"])]]["steps"]
            for o in bk["ops"]
            if OpKind(o["kind"]) in REDUCTION_AXIS
        }
        for bk in tiles["buckets"]
    }


def open_native(bundle: Path) -> Any:
    from plow.runtime.cpu.bundle import Bundle
    from plow.runtime.executors import EXECUTORS

    return EXECUTORS["native"].open_engine(
        Bundle.open(bundle, verify=False), max_batch=8, max_context=512
    )


def prefill_64(engine: Any, prompt: list[int]) -> tuple[float, float]:
    """(wall s, CPU s) of one 64-token prefill."""
    from plow.runtime.engine import PrefillChunk

    engine.add(0, prompt)
    c0, t0 = time.process_time(), time.perf_counter()
    engine.prefill([PrefillChunk(0, len(prompt))])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    engine.free(0)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: SmolLM2-135M)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 8 steps; writes under /tmp")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 8
    if args.model is None:
        from plow.default_model import ensure_default_model

        args.model = ensure_default_model()
    out_dir = Path(tempfile.gettempdir()) if args.quick else OUT
    load0 = os.getloadavg()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="plow-inv-") as tmp:
        t0 = time.time()
        paths = {v: compile_variant(args.model, Path(tmp) / v, v == "invariant") for v in VARIANTS}
        print(f"[invariance] compiled both in {time.time() - t0:.0f} s", flush=True)
        steps = {v: reduction_steps(p) for v, p in paths.items()}
        differ = {bk: sorted(k for k in steps["invariant"][bk] if steps["invariant"][bk][k] != steps["per-rung"][bk][k])
                  for bk in steps["invariant"]}  # fmt: skip
        engines = {v: open_native(p) for v, p in paths.items()}
        batches = (1, 8)
        for v in VARIANTS:  # warm: first touch of the weights, every rung once
            for b in batches:
                raw_steps(
                    engines[v],
                    [[int(x) for x in rng.integers(100, 20000, 16)] for _ in range(b)],
                    3,
                )
            prefill_64(engines[v], [int(x) for x in rng.integers(100, 20000, 64)])
        per: dict[str, dict[str, list[tuple[float, float]]]] = {v: {} for v in VARIANTS}
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
            for b in batches:
                prompts = [[int(x) for x in rng.integers(100, 20000, 16)] for _ in range(b)]
                for v in order:
                    per[v].setdefault(f"decode b{b}", []).append(
                        raw_steps(engines[v], prompts, args.steps + 1)
                    )
            prompt = [int(x) for x in rng.integers(100, 20000, 64)]
            for v in order:
                per[v].setdefault("prefill 64", []).append(prefill_64(engines[v], prompt))
            print(f"[invariance] round {r}: " + ", ".join(
                f"{k} {per['invariant'][k][-1][0] / per['per-rung'][k][-1][0]:.3f}" for k in per["invariant"]
            ), flush=True)  # fmt: skip
    rows = []
    for k in per["invariant"]:
        inv, dfl = per["invariant"][k], per["per-rung"][k]
        wall = [a[0] / b[0] for a, b in zip(inv, dfl, strict=True)]
        cpu = [a[1] / b[1] for a, b in zip(inv, dfl, strict=True)]
        rows.append({"what": k, "invariant_ms": statistics.median(a[0] for a in inv) * 1e3,
                     "per_rung_ms": statistics.median(a[0] for a in dfl) * 1e3,
                     "wall_ratio": statistics.median(wall), "wall_ratio_min": min(wall), "wall_ratio_max": max(wall),
                     "cpu_ratio": statistics.median(cpu), "cpu_ratio_min": min(cpu), "cpu_ratio_max": max(cpu)})  # fmt: skip
    d = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "cpus": os.cpu_count(),
         "model": args.model.name, "rounds": args.rounds, "steps": args.steps, "loadavg_before": load0,
         "loadavg_after": os.getloadavg(), "ops_differing": differ, "rows": rows,
         "command": "python benchmarks/invariance_cost.py " + " ".join(sys.argv[1:])}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "invariance_cost.json").write_text(json.dumps(d, indent=2) + "\n")
    L = ["# Batch invariance across rungs: its cost on the native executor", "",
         f"Run {d['date']} on {d['machine']} ({d['cpus']} CPUs, shared), model {d['model']}, this "
         f"machine's cpu target, the bundle `plow serve` compiles (rungs: decode 1, 2, 4, 8; prefill "
         f"16, 64). Command: `{d['command']}`.", "",
         "## Where the two compiles differ", "",
         "Reducing ops (linear / lm_head k, attention keys, rmsnorm / sample columns) whose reduction "
         "steps differ between the invariant bundle (every rung takes the one-row steps) and the "
         "tiler's per-rung choice:", "",
         "| rung | ops differing | examples |", "|---|---:|---|"]  # fmt: skip
    for bk, names in differ.items():
        ex = ", ".join(
            f"{n} {steps['invariant'][bk][n]} vs {steps['per-rung'][bk][n]}" for n in names[:3]
        )
        L.append(f"| {bk} | {len(names)} | {ex} |")
    L += ["", "## Time, same run, interleaved", "",
          f"{args.rounds} rounds; per round each variant (order alternating) runs {args.steps} greedy "
          "decode steps (`decode_sampled`, 16-token prompts) at batch 1 and 8 and one 64-token "
          "prefill. Medians; ratio = invariant / per-rung per round, median (min..max).", "",
          "| measurement | invariant ms | per-rung ms | wall ratio | CPU ratio |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    for o in rows:
        L.append(f"| {o['what']} | {o['invariant_ms']:.2f} | {o['per_rung_ms']:.2f} | "
                 f"{o['wall_ratio']:.3f} ({o['wall_ratio_min']:.3f}..{o['wall_ratio_max']:.3f}) | "
                 f"{o['cpu_ratio']:.3f} ({o['cpu_ratio_min']:.3f}..{o['cpu_ratio_max']:.3f}) |")  # fmt: skip
    L += ["", "## Limits", "",
          f"- Two shared CPU cores, load average {load0[0]:.2f} at the start and "
          f"{d['loadavg_after'][0]:.2f} at the end (other people's builds and tests): absolute times "
          "are several times a quiet machine's; only the same-run ratios mean anything, and a ratio "
          "within its min..max spread of 1 is no measured difference.",
          "- One model, one target (this machine's calibration, 2 workers); on a target with more "
          "workers the per-rung choices differ in more ops (the 16-worker target of "
          "tests/serve/test_invariance.py: every norm and attention op at batch 8).",
          "- Bundles compiled unverified (the plans are what `plow serve` runs; verification does not "
          "change them). CPU ratio: this process's CPU time, spin-waits included."]  # fmt: skip
    (out_dir / "invariance_cost.md").write_text("\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main()
