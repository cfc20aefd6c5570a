"""Config fields and rope parsing shared by the families' pydantic models."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from plow.checkpoint.spec import RopeSpec

# What this machine can plan (docs/bundle.md, "Config sizes"): each size field of a config is
# an integer (not a float such as the JSON number 1e9, not a bool) in 1..its bound, and the
# whole model at most MAX_PARAMETERS parameters (checked in `plow.checkpoint.loader`). The
# bounds are well above every released dense model (Llama-3.1-405B: 126 layers, hidden 16384,
# intermediate 53248; Gemma-3: vocabulary 262144) and far below what hangs the planner.
MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 17
MAX_INTERMEDIATE = 1 << 20
MAX_VOCAB = 1 << 22
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_POSITIONS = 1 << 24


def _json(v: object) -> str:
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


def _size_check(bound: int) -> Callable[[object], int]:
    def check(v: object) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"must be an integer in 1..{bound}, got {_json(v)}")
        if not 1 <= v <= bound:
            raise ValueError(f"must be in 1..{bound}, got {v}")
        return v

    return check


# Strict positive integers at most their bound (the config's size fields).
Layers = Annotated[int, BeforeValidator(_size_check(MAX_LAYERS))]
Hidden = Annotated[int, BeforeValidator(_size_check(MAX_HIDDEN))]
Intermediate = Annotated[int, BeforeValidator(_size_check(MAX_INTERMEDIATE))]
Vocab = Annotated[int, BeforeValidator(_size_check(MAX_VOCAB))]
Heads = Annotated[int, BeforeValidator(_size_check(MAX_HEADS))]
HeadDim = Annotated[int, BeforeValidator(_size_check(MAX_HEAD_DIM))]
Positions = Annotated[int, BeforeValidator(_size_check(MAX_POSITIONS))]


class DecoderConfig(BaseModel):
    """Fields every decoder-only family has; unknown fields are ignored, missing ones fail."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model_type: str
    vocab_size: Vocab
    hidden_size: Hidden
    intermediate_size: Intermediate
    num_hidden_layers: Layers
    num_attention_heads: Heads
    num_key_value_heads: Heads | None = None
    head_dim: HeadDim | None = None
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    max_position_embeddings: Positions = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None
    dtype: str | None = None
    # Old layout: rope_theta + rope_scaling; transformers >= 5 writes rope_parameters.
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    # fp8 checkpoints (plow.checkpoint.fp8): {"quant_method": "fp8", "fmt": "e4m3",
    # "weight_block_size": [bn, bk], ...}; int4 (plow.checkpoint.int4): {"quant_method":
    # "compressed-tensors", "format": "pack-quantized", ...}; any other method is refused
    quantization_config: dict[str, Any] | None = None

    def weight_block(self) -> tuple[int, int] | None:
        """The fp8 block `[bn, bk]` of `quantization_config` (None: not quantized, or
        per-channel scales); `ValueError` naming the field for what plow cannot read."""
        q = self.quantization_config
        if not q:
            return None
        method = q.get("quant_method")
        if method == "compressed-tensors":  # int4 experts: repacked as q4_0 (plow.checkpoint.int4)
            check_int4_pack(q)
            return None
        if method != "fp8":
            raise ValueError(
                f"field 'quantization_config': quant_method {method!r} is not supported "
                "(fp8, compressed-tensors)"
            )
        if q.get("fmt", "e4m3") != "e4m3":
            raise ValueError(
                f"field 'quantization_config': fp8 format {q.get('fmt')!r} is not supported (e4m3)"
            )
        block = q.get("weight_block_size")
        if block is None:
            return None
        if (
            not isinstance(block, list)
            or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise ValueError(
                f"field 'quantization_config': weight_block_size {block!r} is not two positive "
                "integers"
            )
        return (block[0], block[1])

    def kv_heads(self) -> int:
        kv = self.num_key_value_heads or self.num_attention_heads
        if self.num_attention_heads % kv:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {kv}"
            )
        return kv

    def head_size(self) -> int:
        if self.head_dim:
            return self.head_dim
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_attention_heads} and head_dim is not given"
            )
        return self.hidden_size // self.num_attention_heads

    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def dtype_name(self) -> str:
        return self.dtype or self.torch_dtype or "float32"


# compressed-tensors' weights scheme plow reads (Kimi K2/K3's routed experts): 4-bit
# symmetric int in groups of 32, packed in int32 — q4_0 blocks up to layout
_INT4_WEIGHTS = {
    "num_bits": 4,
    "type": "int",
    "symmetric": True,
    "strategy": "group",
    "group_size": 32,
}


def check_int4_pack(q: dict[str, Any]) -> None:
    """A compressed-tensors `quantization_config` is pack-quantized int4, group 32, symmetric,
    weights only; `ValueError` naming the first field that is not."""
    f = "field 'quantization_config'"
    if q.get("format") != "pack-quantized":
        raise ValueError(f"{f}: format {q.get('format')!r} is not supported (pack-quantized)")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{f}: config_groups {_json(groups)} is not a non-empty object")
    ignore = q.get("ignore", [])
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise ValueError(f"{f}: ignore {_json(ignore)} is not a list of layer names")
    for gname, g in groups.items():
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            raise ValueError(f"{f}: config_groups.{gname}.weights is missing")
        for key, want in _INT4_WEIGHTS.items():
            if w.get(key) != want or type(w.get(key)) is not type(want):
                raise ValueError(
                    f"{f}: config_groups.{gname}.weights.{key} {_json(w.get(key))} is not "
                    f"supported ({_json(want)})"
                )
        if g.get("input_activations") is not None:
            raise ValueError(
                f"{f}: config_groups.{gname}.input_activations: quantized activations are not "
                "supported (weights only)"
            )


def spec_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `ModelSpec` fields every family reads the same way from its config."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.kv_heads(),
        head_dim=cfg.head_size(),
        norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias,
        max_position=cfg.max_position_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_ids=cfg.eos_ids(),
        dtype=cfg.dtype_name(),
        weight_block=cfg.weight_block(),
    )


def rope_from_dict(
    params: dict[str, Any] | None, theta: float, field: str = "rope_parameters"
) -> RopeSpec:
    """A `RopeSpec` from either layout's dict (`rope_type` or the older `type` key); `field`
    names the config field it came from in a refusal."""
    if not params:
        return RopeSpec(theta=theta)
    kind = str(params.get("rope_type", params.get("type", "default")))
    theta = float(params.get("rope_theta", theta))
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeSpec(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(
        f"field {field!r}: rope type {kind!r} is not supported (default, linear, llama3)"
    )


def global_rope(cfg: DecoderConfig, default_theta: float) -> RopeSpec:
    """The rope of full-attention layers, from whichever layout the config uses."""
    theta = cfg.rope_theta if cfg.rope_theta is not None else default_theta
    if cfg.rope_parameters is not None:
        params = cfg.rope_parameters
        if "full_attention" in params:  # per-layer-type layout (Gemma 3 in transformers >= 5)
            params = params["full_attention"]
        return rope_from_dict(params, theta, "rope_parameters")
    return rope_from_dict(cfg.rope_scaling, theta, "rope_scaling")
