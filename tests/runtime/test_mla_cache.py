"""The latent-attention key-value cache holds the latent (plow/graph/mla.py's absorbed form).

On the tiny DeepSeek-V3 fixture (4 heads, 12 + 8 query/key columns, 10 value columns,
kv_lora_rank 16, 3 layers) compiled for `cpu`: the pool has one key-value head per token and
layer, kv_lora_rank + rope = 24 columns wide, stored once (the pool has no value half: the
values are the keys), so a token costs 3 layers x 24 x 4 bytes, not 3 x 4 heads x (20 + 10)
x 4 (the decompressed keys and values). After a prefill, every layer's cached rows hold
transformers' own normalised latent (taken with a forward hook on `kv_a_layernorm`, and equal
to what transformers' own cache holds) at the latent columns and transformers' cached rotated
rope key at the rope columns, and the values read back are those rows. The released
DeepSeek-V3 and Kimi-Linear configs' decode attention tiles on h200.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from plow.checkpoint import load_checkpoint
from plow.checkpoint.families.deepseek_v3 import head_columns
from plow.checkpoint.loader import spec_from_config
from plow.emit.bundle import compile_bundle
from plow.graph.bucket import Bucket
from plow.graph.build import build_graph
from plow.graph.ops import OpKind
from plow.profile import CompileProfile
from plow.runtime.cpu import CpuModel, RowDevice, RowInput
from plow.runtime.sampler import SamplingParams
from plow.target import load_target
from plow.testing.fixtures import make_tiny_deepseek_v3
from plow.tiles.tiler import tile_graph
from tests.runtime.helpers import PROMPTS

PROFILE = CompileProfile(name="mla", decode_batches=(1,), prefill_seqs=(16,), context=32)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CpuModel]:
    root = tmp_path_factory.mktemp("mla")
    path = make_tiny_deepseek_v3(0, root / "ckpt")
    compile_bundle(path, root / "bundle", load_target("cpu"), PROFILE, verify=False)
    return path, CpuModel.from_bundle(root / "bundle", max_batch=1, verify=False)


def test_a_token_costs_the_latent_row_not_the_heads(model: tuple[Path, CpuModel]) -> None:
    path, m = model
    spec = load_checkpoint(path).spec
    la = spec.mla
    assert la is not None
    layers, heads = spec.num_layers, spec.num_heads
    assert (layers, heads, la.kv_lora_rank, la.rope) == (3, 4, 16, 8)
    # one latent row per token and layer: the pool has no value half (values are the keys)
    assert m.kv.halves == 1 and m.arena.kv_shape.halves == 1
    assert m.kv.arena.shape[1] == 1
    assert m.kv.bytes_per_token() == layers * (la.kv_lora_rank + la.rope) * 4 == 288
    decompressed = layers * heads * ((la.nope + la.rope) + la.v_dim) * 4
    assert decompressed == 1440 and m.kv.bytes_per_token() < decompressed


def test_the_cached_rows_are_transformers_latent_and_rope_key(
    model: tuple[Path, CpuModel],
) -> None:
    path, m = model
    spec = load_checkpoint(path).spec
    la = spec.mla
    assert la is not None
    ckpt = load_checkpoint(path)
    ids = ckpt.tokenizer.encode(PROMPTS[1])[:16]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    latents: dict[int, np.ndarray] = {}
    hooks = []
    for n, layer in enumerate(hf.model.layers):
        hooks.append(
            layer.self_attn.kv_a_layernorm.register_forward_hook(
                lambda _m, _i, out, n=n: latents.__setitem__(n, out[0].numpy().copy())
            )
        )
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
    for h in hooks:
        h.remove()
    t = m.kv.new_table()
    m.kv.reserve(t, len(ids))
    plan = m.plan(m.prefill_bucket(1, len(ids)))
    m.run_quantum(
        plan,
        [RowInput(t, tuple(range(len(ids))), tuple(ids))],
        [RowDevice(SamplingParams(), None, 1)],
        1,
    )
    rope_cols, lat_cols = head_columns(la.kv_lora_rank, la.rope, spec.head_dim)
    for n in range(spec.num_layers):
        k, v = m.kv.gather(n, t, len(ids))  # [1, T, D]
        assert k.shape == (1, len(ids), spec.head_dim)
        np.testing.assert_array_equal(k, v)
        np.testing.assert_allclose(k[0][:, lat_cols], latents[n], rtol=1e-5, atol=1e-5)
        # transformers' own cache holds the same two parts: the latent as its "keys" and the
        # rotated shared key (halves order, as plow's row) as its "values"
        cache = out.past_key_values.layers[n]
        np.testing.assert_allclose(
            k[0][:, lat_cols], cache.keys[0, 0].numpy(), rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(
            k[0][:, rope_cols], cache.values[0, 0].numpy(), rtol=1e-5, atol=1e-5
        )
    m.kv.release(t)


def _released(family: str) -> dict[str, object]:
    root = Path(__file__).resolve().parents[1]
    if family == "deepseek_v3":  # the published config, less its MTP layer and fp8 weights
        config = json.loads((root / "data/configs/deepseek-v3/config.json").read_text())
        del config["quantization_config"]
        config["num_nextn_predict_layers"] = 0
        config["num_hidden_layers"] = 4  # 3 dense, 1 MoE: every layer's attention is the same
        return config
    return transformers.KimiLinearConfig().to_dict()


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_linear"])
def test_the_released_configs_decode_attention_tiles_on_h200(family: str) -> None:
    """With the decompressed cache every query row was its own key-value head and the tiler
    refused the decode rung's MLA attention on h200 (`needs 406528 on-chip bytes per tile,
    worker has 233472`); the latent row is one shared head, so it tiles."""
    spec = spec_from_config(_released(family), f"{family} config")
    assert spec.mla is not None and (spec.head_dim, spec.num_kv_heads) == (576, 1)
    tiled = tile_graph(build_graph(spec, Bucket.decode(1, 4096)), load_target("h200"))
    att = [o for o in tiled.ops if o.kind == OpKind.attention.value]
    assert att and all(o.choice.feasible for o in att)


def test_a_one_half_pool_stores_a_row_once_and_reads_it_as_the_value() -> None:
    from plow.runtime.kv_cache import KVCacheError, PagedKVCache

    two = PagedKVCache(2, 1, 8, 4, 4)
    one = PagedKVCache(2, 1, 8, 4, 4, halves=1)
    assert one.arena.nbytes * 2 == two.arena.nbytes
    assert one.bytes_per_token() * 2 == two.bytes_per_token() == 2 * 2 * 8 * 4
    t = one.new_table()
    one.reserve(t, 6)
    k = np.arange(48, dtype=np.float32).reshape(1, 6, 8)
    one.write(1, t, range(6), k, k)
    got_k, got_v = one.gather(1, t, 6)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, k)
    with pytest.raises(KVCacheError, match="values are its keys"):
        one.write(0, t, range(6), k, k + 1)
    with pytest.raises(KVCacheError, match="halves"):
        PagedKVCache(1, 1, 8, 4, 4, halves=3)
