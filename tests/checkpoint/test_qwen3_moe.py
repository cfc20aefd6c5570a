"""The qwen3_moe family: its config in the transformers-4 and -5 layouts, the layers it
routes, the fields it refuses (one line naming the field), and the per-expert tensors a
checkpoint stores read as the stacked tensors the graph names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from plow.checkpoint.loader import spec_from_config
from plow.checkpoint.weights import WeightStore
from plow.errors import CheckpointError, ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"

# transformers-4 layout (the published Qwen3-30B-A3B config, shrunk)
V4: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "torch_dtype": "bfloat16",
}


def _v5(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same model as transformers 5 writes it."""
    out = dict(cfg)
    out["num_local_experts"] = out.pop("num_experts")
    theta = out.pop("rope_theta")
    out.pop("rope_scaling")
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    out["dtype"] = out.pop("torch_dtype")
    return out


def test_both_layouts_give_the_same_spec() -> None:
    a, b = spec_from_config(V4, "v4"), spec_from_config(_v5(V4), "v5")
    assert a == b
    assert a.moe is not None
    assert (a.moe.experts, a.moe.top_k, a.moe.intermediate_size) == (8, 2, 32)
    assert a.moe.norm_topk_prob
    assert [lay.moe for lay in a.layers] == [True, False, True, True]
    assert a.layers[0].rope.theta == 1000000.0 and a.dtype == "bfloat16"


def test_decoder_sparse_step_routes_every_nth_layer() -> None:
    spec = spec_from_config({**V4, "decoder_sparse_step": 2, "mlp_only_layers": []}, "c")
    assert [lay.moe for lay in spec.layers] == [False, True, False, True]
    dense = spec_from_config({**V4, "num_experts": 0}, "c")
    assert dense.moe is None and not any(lay.moe for lay in dense.layers)


def test_weight_shapes_name_the_stacked_experts_of_routed_layers_only() -> None:
    shapes = spec_from_config(V4, "c").weight_shapes()
    assert shapes["model.layers.0.mlp.gate.weight"] == (8, 64)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (8, 64, 64)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (8, 64, 32)
    assert "model.layers.0.mlp.gate_proj.weight" not in shapes
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (96, 64)
    assert "model.layers.1.mlp.gate.weight" not in shapes


def test_the_real_30b_a3b_config_counts_its_published_sizes() -> None:
    cfg = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    spec = spec_from_config(cfg, "qwen3-30b-a3b")
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B activated (the model card)
    assert 30.4e9 < spec.parameter_count() < 30.6e9
    assert 3.2e9 < spec.active_parameter_count() < 3.4e9


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size"),
        ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"mlp_only_layers": [7]}, "mlp_only_layers"),
        ({"num_local_experts": 16}, "num_local_experts"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "field 'rope_scaling'"),
        ({"num_experts": 2000}, "num_experts"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config"),
    ],
)
def test_a_field_plow_cannot_honour_is_refused_naming_it(change: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        spec_from_config({**V4, **change}, "config.json")
    msg = str(e.value)
    assert field in msg and "\n" not in msg and msg.startswith("config.json")


def _per_expert_checkpoint(tmp: Path, experts: int = 3, drop: str | None = None) -> dict:
    rng = np.random.default_rng(0)
    t: dict[str, np.ndarray] = {}
    for e in range(experts):
        for kind, shape in (("gate_proj", (4, 6)), ("up_proj", (4, 6)), ("down_proj", (6, 4))):
            t[f"model.layers.0.mlp.experts.{e}.{kind}.weight"] = rng.standard_normal(
                shape, dtype=np.float32
            )
    if drop:
        del t[drop]
    save_file(t, str(tmp / "model.safetensors"))
    return t


def test_per_expert_tensors_read_as_the_stacked_ones(tmp_path: Path) -> None:
    t = _per_expert_checkpoint(tmp_path)
    store = WeightStore.open([tmp_path / "model.safetensors"])
    p = "model.layers.0.mlp.experts."
    gu = store[p + "gate_up_proj"]
    want = np.stack(
        [
            np.concatenate([t[f"{p}{e}.gate_proj.weight"], t[f"{p}{e}.up_proj.weight"]])
            for e in range(3)
        ]
    )
    assert gu.shape == (3, 8, 6) and np.array_equal(gu, want)
    dn = store[p + "down_proj"]
    assert np.array_equal(dn, np.stack([t[f"{p}{e}.down_proj.weight"] for e in range(3)]))
    # the stacked entry is the per-expert bytes in order (what a bundle copies)
    entry = store.entry(p + "gate_up_proj")
    assert entry.nbytes == sum(x.nbytes for x in entry.pieces) == want.nbytes
    assert store.nbytes == sum(a.nbytes for a in t.values())  # stacked views not double-counted


def test_a_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    _per_expert_checkpoint(tmp_path, drop="model.layers.0.mlp.experts.1.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"experts\.1\.up_proj\.weight' is missing"):
        WeightStore.open([tmp_path / "model.safetensors"])
