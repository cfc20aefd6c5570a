"""`plow serve --debug-ticks N`: a bounded ring of each engine tick's record at /debug/ticks
(benchmarks/serq_predict.py calibrates serQ's per-iteration cost from it)."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import httpx

from plow.serve.http import Server, load_served_model

from .conftest import API_KEY, start_server, stop_server

H = {"Authorization": f"Bearer {API_KEY}"}


def test_debug_ticks_ring(tiny_ckpt: Path) -> None:
    m = load_served_model(tiny_ckpt, name="tiny", max_num_seqs=4, max_num_batched_tokens=64)
    live = start_server(Server([m], api_key=API_KEY, seed=0))
    try:
        off = httpx.get(f"{live.url}/debug/ticks", headers=H, timeout=10)
        assert off.status_code == 404 and "--debug-ticks" in off.text
        m.dispatcher.tick_log = deque(maxlen=5)
        body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 8,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        r = httpx.post(f"{live.url}/v1/completions", json=body, headers=H, timeout=60)
        assert r.status_code == 200, r.text
        ticks = httpx.get(f"{live.url}/debug/ticks", headers=H, timeout=10).json()["tiny"]
        assert len(ticks) == 5  # 8 ticks ran (1 prefill + 7 decodes); the ring keeps the last 5
        nums = [t["tick"] for t in ticks]
        assert nums == list(range(nums[0], nums[0] + 5))
        last = ticks[-1]
        assert last["decode_rows"] == 1 and last["prefill_tokens"] == 0 and last["dur_s"] > 0
        assert all(t["start_s"] < u["start_s"] for t, u in zip(ticks, ticks[1:], strict=False))
    finally:
        stop_server(live)
