"""Batch invariance through the whole serving tick: a request's greedy tokens and logprobs are
the same bits whether it is served alone, with fifteen others at once, or arriving one per
tick in a shuffled order (so it shares decode launches of different rungs with different
neighbours, and its prompt is prefilled in different packs), on the native executor. The
`cpu` emulator computes its tiles with numpy (BLAS), whose blocking depends on the batch: its
tokens agree, its logprobs only to 1e-5. Across rungs whose default splits differ (a
16-worker target), the compiler's one-row reduction steps keep the bits equal; a slow control
shows the per-bucket default does not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plow.graph.ops import OpKind
from plow.runtime.cpu.bundle import Bundle
from plow.runtime.executors import EXECUTORS
from plow.runtime.sampler import SamplingParams
from plow.serve.dispatcher import Dispatcher, GenerationEvent, Request
from plow.serve.prefill_cost import PrefillFit

Outcome = tuple[list[int], list[tuple[float, tuple[tuple[int, float], ...]]]]


@pytest.fixture(scope="module")
def bundle(tiny_bundle_dir: Path) -> Bundle:
    return Bundle.open(tiny_bundle_dir)


def serve(
    bundle: Bundle, executor: str, prompts: list[list[int]], order: list[int], per_tick: int
) -> tuple[dict[int, Outcome], set[int]]:
    """Each prompt's tokens and logprobs, submitted in `order`, `per_tick` per tick (0: all at
    once), and the decode batch sizes the ticks ran."""
    eng = EXECUTORS[executor].open_engine(bundle, max_batch=8)
    d = Dispatcher("t", eng, bundle.tokenizer.decode, eos_token_ids=(),
                   prefill_fit=PrefillFit(launch_s=0.0, per_row_s=1e-5),
                   max_num_batched_tokens=64)  # fmt: skip
    events: dict[int, list[GenerationEvent]] = {i: [] for i in order}
    queue = [Request(f"r{i}", prompts[i], SamplingParams(), 16, events[i].append, logprobs=3)
             for i in order]  # fmt: skip
    batches: set[int] = set()
    while queue or not d._idle():
        for _ in range(per_tick or len(queue)):
            if queue:
                d.submit(queue.pop(0))
        decoding = sum(1 for r in d._active.values() if r.generated and not r.finished)
        batches.add(decoding)
        d._tick()
    assert eng.kv_usage().pages_used == 0
    out = {
        i: ([t for e in ev for t in e.token_ids],
            [(x.logprob, x.top) for e in ev for x in e.logprobs])
        for i, ev in events.items()
    }  # fmt: skip
    return out, batches


@pytest.mark.parametrize("executor", ["native", pytest.param("cpu", marks=pytest.mark.slow)])
def test_sixteen_prompts_alone_together_and_shuffled_are_bitwise_equal(
    bundle: Bundle, executor: str
) -> None:
    if EXECUTORS[executor].unavailable_reason() is not None:
        pytest.skip(EXECUTORS[executor].unavailable_reason() or "")
    rng = np.random.default_rng(7)
    # lengths 2..30: prompts past the 16-row prefill rung are prefilled in several launches
    prompts = [rng.integers(1, 250, size=int(n)).tolist() for n in rng.integers(2, 31, size=16)]
    alone: dict[int, Outcome] = {}
    for i in range(16):
        alone.update(serve(bundle, executor, prompts, [i], 0)[0])
    together, b_all = serve(bundle, executor, prompts, list(range(16)), 0)
    order = rng.permutation(16).tolist()
    shuffled, b_shuf = serve(bundle, executor, prompts, order, 1)
    # full batches (16 tokens each: the first requests still decode when the eighth prompt's
    # prefill, one launch a tick, completes); several rungs' sizes
    assert max(b_all) == 8 and len(b_shuf - {0}) >= 3
    for i in range(16):
        assert len(alone[i][0]) == 16
        if executor == "native":  # the plan fixes every reduction order: the same bits
            assert together[i] == alone[i], f"prompt {i} together"
            assert shuffled[i] == alone[i], f"prompt {i} shuffled"
        else:  # the numpy emulator's tiles go through BLAS, whose blocking follows the batch
            for other in (together[i], shuffled[i]):
                assert other[0] == alone[i][0], f"prompt {i}: tokens"
                np.testing.assert_allclose([v for v, _ in other[1]],
                                           [v for v, _ in alone[i][1]], atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("executor", ["native", "cpu"])
def test_plain_requests_sample_on_the_device_with_the_host_samplers_tokens(
    bundle: Bundle, executor: str
) -> None:
    """A decode launch whose rows are all plain requests samples in the step epilogue (no
    logits row read); its tokens equal sampling the logits on the host, greedy and seeded."""
    if EXECUTORS[executor].unavailable_reason() is not None:
        pytest.skip(EXECUTORS[executor].unavailable_reason() or "")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 250, size=int(n)).tolist() for n in rng.integers(2, 20, size=6)]
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.8, top_k=20, seed=2),
              SamplingParams(temperature=1.2, top_p=0.9, seed=3), SamplingParams(),
              SamplingParams(temperature=1.0, min_p=0.05, seed=4)]  # fmt: skip
    out: dict[bool, list[list[int]]] = {}
    calls: dict[bool, list[str]] = {}
    for device in (True, False):
        eng = EXECUTORS[executor].open_engine(bundle, max_batch=8)
        seen: list[str] = []
        for name in ("decode", "decode_sampled"):
            inner = getattr(eng, name)

            def spy(*a: object, _inner: object = inner, _name: str = name,
                    _seen: list[str] = seen) -> object:  # fmt: skip
                _seen.append(_name)
                return _inner(*a)  # type: ignore[operator]

            setattr(eng, name, spy)
        d = Dispatcher("t", eng, bundle.tokenizer.decode, eos_token_ids=(),
                       prefill_fit=PrefillFit(launch_s=0.0, per_row_s=1e-5),
                       max_num_batched_tokens=64, device_sampling=device)  # fmt: skip
        events: list[list[GenerationEvent]] = [[] for _ in prompts]
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            d.submit(Request(f"r{i}", p, sp, 10, events[i].append))
        while not d._idle():
            d._tick()
        out[device] = [[t for e in ev for t in e.token_ids] for ev in events]
        calls[device] = seen
    assert out[True] == out[False] and all(len(t) == 10 for t in out[True])
    assert set(calls[True]) == {"decode_sampled"} and set(calls[False]) == {"decode"}


WIDE_PROFILE = dict(decode_batches=(1, 2, 8), prefill_seqs=(16,), context=64)


def wide_compile(ckpt: Path, out: Path, *, invariant: bool) -> Bundle:
    """`ckpt` for a 16-worker cpu target, whose tiler splits attention's keys 8 ways at batch
    1, 4 at batch 2 and not at batch 8 by default; `invariant=False`: that default (the
    tiler's per-bucket choice), else every rung takes the one-row reduction steps."""
    from plow.emit.bundle import compile_bundle
    from plow.profile import CompileProfile
    from plow.target import load_target

    target = load_target("cpu").model_copy(update={"workers": 16})
    profile = CompileProfile(name="wide", **WIDE_PROFILE)  # type: ignore[arg-type]
    mp = pytest.MonkeyPatch()
    if not invariant:
        import functools

        import plow.compile
        from plow.tiles.tiler import TilingOptions

        mp.setattr(plow.compile, "TilingOptions",
                   functools.partial(TilingOptions, rung_invariant=False))  # fmt: skip
    try:
        compile_bundle(ckpt, out, target, profile, verify=False)
    finally:
        mp.undo()
    return Bundle.open(out, verify=False)


def reduction_steps(b: Bundle) -> dict[str, dict[str, int]]:
    """Per rung, each reducing op's steps along its reduction axis (from tiles.json)."""
    import json

    from plow.tiles.tiler import REDUCTION_AXIS

    tiles = json.loads((b.path / "tiles.json").read_text())
    out: dict[str, dict[str, int]] = {}
    for bk in tiles["buckets"]:
        out[bk["bucket"]] = {
            o["name"]: o["axes"][REDUCTION_AXIS[OpKind(o["kind"])]]["steps"]
            for o in bk["ops"] if OpKind(o["kind"]) in REDUCTION_AXIS
        }  # fmt: skip
    return out


@pytest.fixture(scope="module")
def wide_bundle(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    return wide_compile(tiny_ckpt, tmp_path_factory.mktemp("wide") / "inv", invariant=True)


def sixteen_prompts() -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, 250, size=int(n)).tolist() for n in rng.integers(2, 31, size=16)]
    return prompts, rng.permutation(16).tolist()


def test_every_rung_of_a_wide_target_reduces_a_row_in_one_order(
    wide_bundle: Bundle, tiny_ckpt: Path
) -> None:
    """The 16-worker target's default splits differ between rungs (attention keys 8 / 4 / 1
    ways); the compiled bundle gives every rung the one-row steps, and serves 16 prompts
    alone, all at once and shuffled with the same bits (native), through rungs 1, 2 and 8."""
    from plow.checkpoint import load_spec
    from plow.egraph.apply import RULES, extracted_instances, fuse_graph
    from plow.graph import Bucket, build_graph
    from plow.target import load_target
    from plow.tiles.tiler import REDUCTION_AXIS, TilingOptions, tile_graph

    spec = load_spec(tiny_ckpt)
    target = load_target("cpu").model_copy(update={"workers": 16})
    # the bundle's graph: fused as the compile fuses it (the one-row rung's extraction)
    chosen = extracted_instances(build_graph(spec, Bucket.decode(1, 64)), target, RULES)
    default = {}
    for bk in (Bucket.decode(1, 64), Bucket.decode(8, 64)):
        graph = fuse_graph(build_graph(spec, bk), target, RULES, None, chosen).graph
        tg = tile_graph(graph, target, TilingOptions(rung_invariant=False))
        default[bk.batch] = {o.name: o.axes[REDUCTION_AXIS[OpKind(o.kind)]].steps
                             for o in tg.ops if OpKind(o.kind) in REDUCTION_AXIS}  # fmt: skip
    assert default[1] != default[8]  # the default splits do differ per rung
    steps = reduction_steps(wide_bundle)
    assert len(steps) == 4 and all(v == steps["decode_b1_s64"] for v in steps.values())
    assert steps["decode_b1_s64"] == default[1]  # the one-row choice, kept at batch 1
    if EXECUTORS["native"].unavailable_reason() is not None:
        pytest.skip(EXECUTORS["native"].unavailable_reason() or "")
    prompts, order = sixteen_prompts()
    alone: dict[int, Outcome] = {}
    for i in range(16):
        alone.update(serve(wide_bundle, "native", prompts, [i], 0)[0])
    together, b_all = serve(wide_bundle, "native", prompts, list(range(16)), 0)
    shuffled, b_shuf = serve(wide_bundle, "native", prompts, order, 1)
    assert max(b_all) == 8 and len(b_shuf - {0}) >= 3
    for i in range(16):
        assert len(alone[i][0]) == 16
        assert together[i] == alone[i], f"prompt {i} together"
        assert shuffled[i] == alone[i], f"prompt {i} shuffled"


@pytest.mark.slow
def test_the_default_per_rung_splits_are_not_invariant(
    tiny_ckpt: Path, tmp_path: Path
) -> None:
    """The control: the same target compiled with the tiler's per-bucket choice gives some
    prompt different logprob bits alone than in a batch (so the test above can fail)."""
    if EXECUTORS["native"].unavailable_reason() is not None:
        pytest.skip(EXECUTORS["native"].unavailable_reason() or "")
    b = wide_compile(tiny_ckpt, tmp_path / "default", invariant=False)
    steps = reduction_steps(b)
    assert steps["decode_b1_s64"] != steps["decode_b8_s64"]
    prompts, _ = sixteen_prompts()
    alone: dict[int, Outcome] = {}
    for i in range(16):
        alone.update(serve(b, "native", prompts, [i], 0)[0])
    together, _ = serve(b, "native", prompts, list(range(16)), 0)
    assert any(together[i] != alone[i] for i in range(16))
