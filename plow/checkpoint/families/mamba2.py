"""Mamba-2 (transformers' `Mamba2ForCausalLM`): every layer is `x + mixer(rmsnorm(x))`, the
mixer a selective state-space layer (`plow.checkpoint.spec.SsmSpec`); a final `norm_f`; a
tied or untied lm_head. No attention, no feed-forward, no positions: a sequence's state is
the conv window (conv_kernel - 1 inputs of the conv channels) and the SSM state
(heads x head_dim x state_size) of each layer, fixed in size whatever the context.

Both config layouts are read: transformers 4 (`rms_norm`, `time_step_limit` a tuple) and 5
(the same fields, `rms_norm` dropped). Fields plow cannot honour are refused with one line
naming them: an activation other than SiLU, `rms_norm` false, `norm_before_gate` true,
`hidden_size * expand != num_heads * head_dim`, heads not a multiple of `n_groups`, a
`time_step_limit` that is not two numbers lo <= hi.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from plow.checkpoint.families.common import HeadDim, Heads, Hidden, Layers, Positions, Vocab
from plow.checkpoint.spec import LayerSpec, ModelSpec, RopeSpec, SsmSpec

MODEL_TYPES = ("mamba2",)

# The largest state / conv / group sizes a config may ask for (Codestral-Mamba: state 128,
# conv 4, 8 groups).
MAX_STATE = 4096
MAX_CONV = 64


def _json_float(v: object) -> object:
    """A float as either layout writes it: transformers 4 `Infinity` (Python's JSON reads a
    float), transformers 5 `{"__float__": "Infinity"}`."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        return float(v["__float__"])
    return v


JsonFloat = Annotated[float, BeforeValidator(_json_float)]


class Mamba2Config(BaseModel):
    """transformers' `Mamba2Config`; unknown fields are ignored, sizes bounded as in
    `plow.checkpoint.families.common`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model_type: str
    vocab_size: Vocab = 32768
    hidden_size: Hidden = 4096
    num_hidden_layers: Layers = 64
    num_heads: Heads = 128
    head_dim: HeadDim = 64
    state_size: int = Field(default=128, ge=1, le=MAX_STATE)
    n_groups: Heads = 8
    expand: int = Field(default=2, ge=1, le=64)
    conv_kernel: int = Field(default=4, ge=1, le=MAX_CONV)
    layer_norm_epsilon: float = Field(default=1e-5, gt=0)
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    time_step_limit: list[JsonFloat] = Field(default_factory=lambda: [0.0, math.inf])
    tie_word_embeddings: bool = False
    # transformers 4 only (always true there); refused when false
    rms_norm: bool = True
    # mamba_ssm's option (the gate applied after the norm); transformers applies it before
    norm_before_gate: bool = False
    max_position_embeddings: Positions = 2048
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None
    dtype: str | None = None


def to_spec(config: dict[str, Any]) -> ModelSpec:
    cfg = Mamba2Config.model_validate(config)
    if cfg.hidden_act != "silu":
        raise ValueError(
            f"field 'hidden_act': {cfg.hidden_act!r} is not supported for mamba2 (silu)"
        )
    if not cfg.rms_norm:
        raise ValueError("field 'rms_norm': false (no gated norm) is not supported for mamba2")
    if cfg.norm_before_gate:
        raise ValueError("field 'norm_before_gate': true is not supported for mamba2")
    inner = cfg.hidden_size * cfg.expand
    if inner != cfg.num_heads * cfg.head_dim:
        raise ValueError(
            f"field 'expand': hidden_size {cfg.hidden_size} x expand {cfg.expand} != num_heads "
            f"{cfg.num_heads} x head_dim {cfg.head_dim}"
        )
    if cfg.num_heads % cfg.n_groups:
        raise ValueError(
            f"field 'n_groups': num_heads {cfg.num_heads} is not a multiple of {cfg.n_groups}"
        )
    lim = cfg.time_step_limit
    if len(lim) != 2 or not lim[0] <= lim[1] or lim[0] < 0:
        raise ValueError(f"field 'time_step_limit': {lim} is not two numbers 0 <= lo <= hi")
    eos = cfg.eos_token_id
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    ssm = SsmSpec(
        heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        state_size=cfg.state_size,
        groups=cfg.n_groups,
        conv_kernel=cfg.conv_kernel,
        conv_bias=cfg.use_conv_bias,
        proj_bias=cfg.use_bias,
        dt_min=float(lim[0]),
        dt_max=float(lim[1]),
    )
    no_rope = RopeSpec(theta=10000.0)  # unused: no layer attends
    return ModelSpec(
        family="mamba2",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=inner,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        norm_eps=cfg.layer_norm_epsilon,
        layers=tuple(LayerSpec(rope=no_rope, mixer="ssm") for _ in range(cfg.num_hidden_layers)),
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position=cfg.max_position_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_ids=eos_ids,
        dtype=cfg.dtype or cfg.torch_dtype or "float32",
        ssm=ssm,
    )
