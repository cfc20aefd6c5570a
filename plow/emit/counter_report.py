"""`plow inspect --counters`: the collapse decision (C8) of every op edge of a bundle's plan,
re-derived from its `config.json`, target and profile (the compiler's own `compile_plan`),
with the routed-expert edges (plow/schedule/routing.py) spelled out: coarse certified for
all routings (`Plow.Gatedproof.coupled_c7r_all_routings`), or the sampled estimate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ALL_ROUTINGS = "Plow.Gatedproof.coupled_c7r_all_routings"


def _verdict(reason: str) -> str:
    if "C7r for all routings" in reason:
        return f"coarse for all routings ({ALL_ROUTINGS})"
    if "every slice reads all" in reason:
        return "coarse: every slice reads every producer"
    if "two-stage model over" in reason:
        return "estimate over sampled routings (not a theorem)"
    return reason.split(";")[0]


def counter_decisions_of_bundle(bundle: Path) -> dict[str, Any]:
    """Per bucket of the ladder: edges, fine edges, and each routed edge's verdict and
    reason. The plan is rebuilt and must have the bundle's task count (else the bundle was
    not compiled by this plow, and the report says nothing about it)."""
    from plow.bundle.files import ScheduleFile
    from plow.bundle.manifest import MalformedBundle, load_json, read_manifest
    from plow.compile import compile_plan
    from plow.emit.verify import verify_bundle
    from plow.profile import CompileProfile
    from plow.target import Target

    bundle = Path(bundle)
    m = read_manifest(bundle)
    row = verify_bundle(bundle, checkpoints=()).rows[0]
    if row.rejected:
        raise MalformedBundle(bundle, f"{row.reason} (see `plow verify {bundle}`)")
    res = compile_plan(bundle, Target.model_validate(m.target), CompileProfile(**m.profile))
    buckets = []
    for rung, bp in zip(m.ladder, res.buckets, strict=True):
        sf: ScheduleFile = load_json(bundle / rung.schedule, ScheduleFile)
        assert bp.schedule is not None
        if len(sf.tasks.name) != len(bp.schedule.tasks):
            raise MalformedBundle(
                bundle,
                f"bucket {rung.name}: the rebuilt plan has {len(bp.schedule.tasks)} tasks, the "
                f"bundle {len(sf.tasks.name)} (compiled by another plow?)",
            )
        ds = bp.schedule.decisions
        routed = [d for d in ds if d.reason.startswith("routed consumer slices")]
        buckets.append(
            {
                "bucket": rung.name,
                "edges": len(ds),
                "fine_edges": sum(d.fine for d in ds),
                "routed_edges": len(routed),
                "c7r_all_routings": sum("C7r for all routings" in d.reason for d in routed),
                "estimated": sum("two-stage model over" in d.reason for d in routed),
                "routed": [
                    {
                        "producer": d.producer,
                        "consumer": d.consumer,
                        "fine": d.fine,
                        "verdict": _verdict(d.reason),
                        "reason": d.reason,
                    }
                    for d in routed
                ],
            }
        )
    return {"bundle": str(bundle), "theorem": ALL_ROUTINGS, "buckets": buckets}


def render_counters(doc: dict[str, Any]) -> str:
    """The text of `plow inspect --counters`: a line per bucket, a line per routed verdict
    kind with its edges' count, and layer 0's routed edges in full."""
    lines = [f"{doc['bundle']}: collapse decisions (C8), the plan rebuilt"]
    for b in doc["buckets"]:
        lines.append(
            f"{b['bucket']}: {b['edges']} op edges, {b['fine_edges']} with fine counters; "
            f"{b['routed_edges']} into routed expert slices: {b['c7r_all_routings']} coarse "
            f"for all routings ({doc['theorem']}), {b['estimated']} by the sampled estimate"
        )
        kinds: dict[str, int] = {}
        for r in b["routed"]:
            kinds[r["verdict"]] = kinds.get(r["verdict"], 0) + 1
        lines += [f"  {v}: {n} edge(s)" for v, n in kinds.items()]
        lines += [
            f"  {r['producer']} -> {r['consumer']}: {'fine' if r['fine'] else 'coarse'}: "
            f"{r['reason']}"
            for r in b["routed"]
            if r["consumer"].startswith("L0.")
        ]
    return "\n".join(lines)
