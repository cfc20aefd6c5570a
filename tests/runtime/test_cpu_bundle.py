"""The CPU executor running bundles (plow/runtime/cpu/bundle.py): greedy tokens through the
bundle's packet streams equal transformers' and the in-memory plan's; nops run as queue
entries; random interleavings; an edited plan file refused at load and, forced to run,
caught by the checking mode; `plow generate BUNDLE`, the checkpoint cache, `plow serve`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from plow.bundle.files import ScheduleFile
from plow.bundle.manifest import sha256_file
from plow.bundle.open import BundleRefused
from plow.bundle.wire import HEADER_SIZE, NO_COUNTER, Opcode, read_plan
from plow.checkpoint import load_checkpoint
from plow.cli import app
from plow.emit.bundle import compile_bundle
from plow.profile import CompileProfile
from plow.runtime.cpu import CpuModel, GenerationStats, RaceError, Request, RowInput, generate
from plow.runtime.cpu.bundle import Bundle
from plow.target import load_target

NEW = 16
CONTEXT = 160
PREFIX = "System: you are a terse assistant. Answer in one line. "
SUFFIXES = ["The quick brown fox jumps.", "A", "Café, naïve: 0 1 2 3 4 5 6 7 8 9", "Hi there"]
FAMILIES = ["llama", "qwen3", "gemma3"]
# decode rungs b1/b4 (a batch of 4 rounds up to b4), batch-1 prefill chunks of 64
PROFILE = CompileProfile(name="test", decode_batches=(1, 4), prefill_seqs=(64,), context=CONTEXT)


@pytest.fixture(scope="module")
def bundles(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bundles")
    out = {}
    for fam in FAMILIES:
        out[fam] = root / fam
        compile_bundle(tiny_checkpoints[fam], out[fam], load_target("cpu"), PROFILE, verify=True)
    return out


@pytest.fixture(scope="module")
def refs(tiny_checkpoints: dict[str, Path]) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Per family: the prompts' ids and transformers' greedy tokens."""
    out = {}
    for fam in FAMILIES:
        ckpt = load_checkpoint(tiny_checkpoints[fam])
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_checkpoints[fam], dtype=torch.float32, attn_implementation="eager"
        ).eval()
        prompts = [ckpt.tokenizer.encode(PREFIX + s) for s in SUFFIXES]
        toks = []
        for ids in prompts:
            with torch.no_grad():
                gen = model.generate(
                    torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                    eos_token_id=None, pad_token_id=0,
                )  # fmt: skip
            toks.append(gen[0, len(ids) :].tolist())
        out[fam] = (prompts, toks)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_from_the_bundle_equal_transformers_and_the_in_memory_plan(
    bundles: dict[str, Path], refs: dict, tiny_checkpoints: dict[str, Path], family: str
) -> None:
    prompts, want = refs[family]
    assert len({len(p) for p in prompts}) == 4
    m = CpuModel.from_bundle(bundles[family])
    assert m.bundle is not None and m.max_batch == 4 and m.context == CONTEXT
    st = GenerationStats()
    reqs = [Request(tuple(p), NEW) for p in prompts]
    got = generate(m, reqs, stats=st)
    assert got == want
    assert st.buckets == {"prefill_b1_s64_c160", "decode_b4_s160"}  # the bundle's rungs
    # batch-1 prefill rungs of 64 tokens: one launch per prompt and chunk
    assert st.prefill_launches == sum(-(-len(p) // 64) for p in prompts)
    ckpt = load_checkpoint(tiny_checkpoints[family])
    mem = CpuModel(ckpt.spec, ckpt.weights, max_batch=4, max_context=CONTEXT)
    assert generate(mem, reqs) == got
    assert all(p.wire is not None and p.schedule is None for p in m.plans.values())


def test_the_stream_is_the_plan_file_and_nops_run_as_queue_entries(
    bundles: dict[str, Path],
) -> None:
    b = Bundle.open(bundles["llama"])
    m = CpuModel.from_bundle(b)
    plan = m.plan(m.decode_bucket(4))
    header, arr = read_plan(bundles["llama"] / "plan" / f"{plan.bucket.name}.bin")
    nops = int((arr["opcode"] == Opcode.NOP).sum())
    assert nops > 0 and plan.stream.nops == nops
    assert len(plan.stream.runs) == header.packet_count
    # queues are the records' worker fields in file order
    for w, q in enumerate(plan.stream.queues):
        assert [int(arr["worker"][p]) for p in q] == [w] * len(q)
        assert list(q) == sorted(q)
    rows = []
    for i in range(4):
        t = m.kv.new_table()
        m.kv.reserve(t, 8)
        rows.append(RowInput(t, (3 + i,), (10 + i,)))
    m.write_inputs(plan, rows)
    st = m.dispatch(plan)
    assert st.nops == nops and st.entries == header.packet_count
    assert st.tasks == header.packet_count - nops
    assert m.machine.nops_run == nops
    # a nop that waits really blocks: its worker runs nothing past it before the counter opens
    assert any(
        int(arr["wait_counter"][p]) != NO_COUNTER and not plan.stream.runs[p]
        for p in range(len(arr))
    )


def _decode_steps(m: CpuModel, steps: int = 3) -> tuple[list[list[int]], list[bytes]]:
    prompts = [[5, 17, 93, 2, 44, 8, 61, 30, 12, 7, 99], [3, 250, 41, 6, 77], [120, 9, 9, 18]]
    reqs = [Request(tuple(p), steps) for p in prompts]
    out = generate(m, reqs)
    return out, [m.arena.snapshot()]


def test_random_interleavings_of_the_bundle_stream_are_bitwise_identical(
    bundles: dict[str, Path],
) -> None:
    """Seeded random interleavings over the bundle's packet stream (nops included) on the
    bundle's own arena (shared activation bytes): tokens and the final arena bytes equal
    round-robin's; the checking mode passes."""
    for fam in ("gemma3", "llama"):
        base, snap = _decode_steps(CpuModel.from_bundle(bundles[fam]))
        for seed in range(6 if fam == "gemma3" else 3):
            m = CpuModel.from_bundle(bundles[fam], mode="random", seed=seed, check=seed < 2)
            out, s2 = _decode_steps(m)
            assert out == base, f"{fam} seed {seed}"
            assert s2 == snap, f"{fam} seed {seed}: arena bytes differ"


def test_checking_mode_passes_the_bundle_arena(bundles: dict[str, Path]) -> None:
    """The arena shares bytes only between ops the schedule orders (docs/memory.md "Sharing
    rule"): the checking mode finds no race on the bundle's arena (it found L0.q_rope
    overwriting L0.attn_norm while L0.k_proj could still read it, before the rule)."""
    for fam in FAMILIES:
        m = CpuModel.from_bundle(bundles[fam], check=True)
        _decode_steps(m, steps=2)


def _forge(bundle: Path, edit_rel: str) -> None:
    """Re-hash `edit_rel` in the manifest (what an attacker or a careless tool does)."""
    man = json.loads((bundle / "manifest.json").read_text())
    man["files"][edit_rel] = sha256_file(bundle / edit_rel)
    (bundle / "manifest.json").write_text(json.dumps(man))


def test_edited_plan_file_is_refused_and_forced_runs_are_caught(
    bundles: dict[str, Path], tmp_path: Path
) -> None:
    b = tmp_path / "edited"
    shutil.copytree(bundles["llama"], b)
    rel = "plan/decode_b4_s160.bin"
    sf = ScheduleFile.model_validate_json((b / "plan/decode_b4_s160.schedule.json").read_bytes())
    cid = sf.counters.name.index("L1.attn.done")
    th = sf.counters.threshold[cid]
    assert th >= 2
    _, arr = read_plan(b / rel)
    rec = next(
        i
        for i in range(len(arr))
        if int(arr["wait_counter"][i]) == cid and int(arr["opcode"][i]) != Opcode.NOP
    )
    data = bytearray((b / rel).read_bytes())
    at = HEADER_SIZE + 64 * rec + 16  # wait_threshold
    data[at : at + 4] = (th - 1).to_bytes(4, "little")
    (b / rel).write_bytes(bytes(data))
    # 1. the hash alone catches it, naming the file
    with pytest.raises(BundleRefused) as info:
        Bundle.open(b)
    assert rel in str(info.value) and "sha256 differs" in str(info.value)
    # 2. hash re-forged: the stale certificate is re-checked, checkpoint D rejects
    _forge(b, rel)
    with pytest.raises(BundleRefused) as info:
        Bundle.open(b)
    msg = str(info.value)
    assert "checkpoint D rejects bucket decode_b4_s160" in msg and f"threshold {th - 1}" in msg
    assert "\n" not in msg and info.value.exit_code == 1
    res = CliRunner().invoke(app, ["generate", str(b), "--executor", "cpu", "--prompt-ids", "5,6"])
    assert res.exit_code == 1 and "checkpoint D rejects" in res.output
    # 3. forced to run: the checking mode names the packet and the counter
    m = CpuModel.from_bundle(b, verify=False, arena="private", check=True)
    with pytest.raises(RaceError) as race:
        _decode_steps(m, steps=2)
    msg = str(race.value)
    assert "L1.o_proj" in msg and "packet" in msg
    assert f"counter {cid} 'L1.attn.done' has threshold {th - 1} but {th} tasks signal it" in msg


def test_missing_certificates_are_refused(bundles: dict[str, Path], tmp_path: Path) -> None:
    b = tmp_path / "uncertified"
    shutil.copytree(bundles["qwen3"], b)
    (b / "certificates" / "E.json").unlink()
    with pytest.raises(BundleRefused, match=r"certificates/E\.json: missing"):
        Bundle.open(b)
    assert Bundle.open(b, verify=False).spec.family == "qwen3"


def test_cli_generate_bundle_and_checkpoint_cache(
    bundles: dict[str, Path],
    refs: dict,
    tiny_checkpoints: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts, want = refs["qwen3"]
    args = ["--prompt-ids", ",".join(map(str, prompts[1])), "--max-new-tokens", "12"]
    args += ["--ignore-eos", "--json", "--executor", "cpu"]
    res = CliRunner().invoke(app, ["generate", str(bundles["qwen3"]), *args])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["token_ids"] == want[1][:12]
    bad = CliRunner().invoke(
        app, ["generate", str(bundles["qwen3"]), "--prompt-ids", "1", "--executor", "reference"]
    )
    assert bad.exit_code == 2 and "--executor native, cpu or cuda" in bad.output
    monkeypatch.setenv("PLOW_CACHE", str(tmp_path / "cache"))
    for _ in range(2):
        res = CliRunner().invoke(app, ["generate", str(tiny_checkpoints["qwen3"]), *args])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["token_ids"] == want[1][:12]
    cached = list((tmp_path / "cache" / "bundles").iterdir())
    assert len(cached) == 1 and (cached[0] / "certificates" / "D.json").is_file()
    assert not [p for p in (tmp_path / "cache" / "bundles").iterdir() if "partial" in p.name]


def test_serve_a_bundle(bundles: dict[str, Path], refs: dict) -> None:
    from fastapi.testclient import TestClient

    from plow.serve.http import Server, load_served_model

    prompts, want = refs["llama"]
    m = load_served_model(bundles["llama"], max_num_seqs=4)
    assert m.engine.kind == "cpu" and m.max_context == CONTEXT
    with TestClient(Server([m]).app()) as client:
        r = client.post(
            "/v1/completions",
            json={"model": m.name, "prompt": prompts[0], "max_tokens": 6, "temperature": 0},
        )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    assert r.json()["choices"][0]["text"] == m.tokenizer.decode(want[0][:6])
