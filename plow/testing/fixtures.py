"""`make_tiny_checkpoint`: a real HuggingFace directory with seeded random weights.

Weights come from transformers' own model classes (so the layout is exactly what HF writes),
saved as safetensors (optionally sharded); the tokenizer is a byte-level BPE trained with
`tokenizers` on text shipped in `plow/testing/data/corpus.txt`. Requires the `dev` extra
(torch CPU + transformers).
"""

from __future__ import annotations

import json
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

# Small, fast on 2 cores, but covering GQA, odd vocabularies and tied/untied embeddings.
_BASE: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=317,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        vocab_size=301,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        max_position_embeddings=256,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "gemma3": dict(
        vocab_size=293,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        tie_word_embeddings=True,
        # sqrt(hidden)-scaled tied embeddings make larger inits repeat the input token.
        initializer_range=0.05,
    ),
    # Routed experts: top-2 of 8, renormalised; layer 1 dense among routed layers 0 and 2;
    # head_dim 24 != hidden 64 / 4 heads; expert width 32 != the dense width 128.
    "qwen3_moe": dict(
        vocab_size=311,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        max_position_embeddings=256,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
}
# Mamba-2: 4 groups of 2 heads, head_dim 12 (!= 64), state 8, conv 3 taps, untied lm_head,
# dt_bias / A_log / D perturbed (`make_tiny_checkpoint`) so every head differs.
_BASE["mamba2"] = dict(
    vocab_size=307,
    hidden_size=48,
    expand=2,
    num_heads=8,
    head_dim=12,
    n_groups=4,
    state_size=8,
    conv_kernel=3,
    num_hidden_layers=3,
    tie_word_embeddings=False,
)
TINY_FAMILIES = tuple(_BASE)


def corpus_text() -> str:
    return resources.files("plow.testing").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer with at most `vocab_size` tokens, trained on the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    return tok


def _hf_config(family: str, seed: int, overrides: dict[str, Any]) -> Any:
    import transformers

    params = dict(_BASE[family])
    params.update(overrides)
    # Larger-than-default init spreads the logits, so greedy decisions are not near-ties
    # that fp32 rounding could flip between two correct implementations.
    params.setdefault("initializer_range", 0.25)
    params.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen3": transformers.Qwen3Config,
        "gemma3": transformers.Gemma3TextConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "mamba2": transformers.Mamba2Config,
    }[family]
    return cls(**params)


def _model_class(family: str) -> Any:
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "mamba2": transformers.Mamba2ForCausalLM,
    }[family]


def make_tiny_checkpoint(
    family: str,
    seed: int = 0,
    out: Path | str | None = None,
    *,
    shards: int = 1,
    dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """Write a tiny HF checkpoint for `family` ("llama", "qwen3", "gemma3", "qwen3_moe") and
    return its dir.

    `shards > 1` splits the weights into about that many safetensors files with an index;
    `dtype` is the stored dtype ("float32", "bfloat16", "float16"); `overrides` replace
    config fields (e.g. `tie_word_embeddings=False`, `num_key_value_heads=4`).
    """
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if family not in _BASE:
        raise ValueError(f"unknown fixture family {family!r} (have {', '.join(_BASE)})")
    directory = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix=f"plow-{family}-"))
    directory.mkdir(parents=True, exist_ok=True)
    config = _hf_config(family, seed, overrides)
    torch.manual_seed(seed)
    model = _model_class(family)(config).eval()
    with torch.no_grad():
        # HF initialises norm weights to constants; perturb them so the norms are exercised.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("mixer.dt_bias", "mixer.A_log", "mixer.D")):  # mamba2
                p.add_(0.3 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    shard_size = max(1, total // shards + 1) if shards > 1 else None
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if shard_size is not None:
        kwargs["max_shard_size"] = shard_size
    model.save_pretrained(directory, **kwargs)
    write_tokenizer(directory, config)
    return directory


def write_tokenizer(directory: Path, config: Any) -> None:
    """The corpus tokenizer of `config.vocab_size` tokens and its tokenizer_config.json."""
    tok = train_tokenizer(config.vocab_size)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": getattr(config, "max_position_embeddings", 2048),
            },
            indent=2,
        )
    )


# Gemma 4 text (`make_tiny_gemma4`): 4 layers sliding / full / sliding / full, window 8;
# sliding head_dim 24 (!= 64 / 4 heads) with 2 kv heads, full layers head_dim 32 with
# proportional rope (a quarter of the angles); soft-capped logits. The MoE variant: top-2 of
# 8 experts of width 32 beside every layer's dense MLP, keys = values on the full layers with
# 1 kv head (num_global_key_value_heads). Gemma 4 has no dense-only layer among MoE layers
# (`enable_moe_block` is the whole model's).
GEMMA4_TINY: dict[str, Any] = dict(
    vocab_size=293,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    global_head_dim=32,
    max_position_embeddings=256,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
        },
    },
    final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0,
    num_kv_shared_layers=0,
    tie_word_embeddings=True,
    initializer_range=0.05,
)
GEMMA4_TINY_MOE: dict[str, Any] = dict(
    GEMMA4_TINY,
    enable_moe_block=True,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=32,
    attention_k_eq_v=True,
    num_global_key_value_heads=1,
)


def _tiny_config(config_cls: Any, base: dict[str, Any], overrides: dict[str, Any]) -> Any:
    """`config_cls` of `base` with `overrides` and the fixture tokenizer's special ids
    (transformers' warnings silenced)."""
    import transformers

    transformers.logging.set_verbosity_error()
    params = dict(base)
    params.update(overrides)
    params.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    return config_cls(**params)


def _save_perturbed(
    config: Any,
    model_cls: Any,
    seed: int,
    out: Path | str | None,
    prefix: str,
    params: tuple[str, ...],
    buffers: dict[str, float],
) -> Path:
    """`model_cls(config)` seeded with `seed`, parameters whose name contains "norm" or ends
    with one of `params` perturbed by 0.1 N(0, 1), buffers ending with a key of `buffers` by
    that scale; saved with the fixture tokenizer to `out` (a new temp dir when None)."""
    import torch

    directory = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix=prefix))
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or (params and name.endswith(params)):
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            for suffix, scale in buffers.items():
                if name.endswith(suffix):
                    b.add_(scale * torch.randn_like(b))
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory, config)
    return directory


def make_tiny_gemma4(
    moe: bool = False, seed: int = 0, out: Path | str | None = None, **overrides: Any
) -> Path:
    """A tiny `Gemma4ForCausalLM` checkpoint (`GEMMA4_TINY`, or `GEMMA4_TINY_MOE` when `moe`)
    through transformers' own classes; norms, router scales and layer scalars perturbed."""
    import transformers

    config = _tiny_config(
        transformers.Gemma4TextConfig, GEMMA4_TINY_MOE if moe else GEMMA4_TINY, overrides
    )
    return _save_perturbed(
        config, transformers.Gemma4ForCausalLM, seed, out, "plow-gemma4-",
        ("router.scale", "per_expert_scale"), {"layer_scalar": 0.2},
    )  # fmt: skip


# DeepSeek-V3 (`make_tiny_deepseek_v3`): latent attention with q_lora_rank 24, kv_lora_rank
# 16, per head 12 unrotated + 8 rotated (interleaved) query / key columns and 10 value columns
# (!= 20); layer 0 dense (first_k_dense_replace 1), layers 1-2 DeepSeekMoE: top-3 of 8
# sigmoid-scored experts of width 24 in 4 groups (the best 2 eligible), correction bias
# perturbed, renormalised, times 2.5, plus one shared expert. No multi-token prediction layer.
DEEPSEEK_V3_TINY: dict[str, Any] = dict(
    vocab_size=301,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    rope_interleave=True,
    num_nextn_predict_layers=0,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    initializer_range=0.2,
)


def make_tiny_deepseek_v3(seed: int = 0, out: Path | str | None = None, **overrides: Any) -> Path:
    """A tiny `DeepseekV3ForCausalLM` checkpoint (`DEEPSEEK_V3_TINY` with `overrides`) through
    transformers' own classes; norms and the routers' correction biases perturbed."""
    import transformers

    config = _tiny_config(transformers.DeepseekV3Config, DEEPSEEK_V3_TINY, overrides)
    return _save_perturbed(
        config, transformers.DeepseekV3ForCausalLM, seed, out, "plow-dsv3-",
        (), {"e_score_correction_bias": 0.1},
    )  # fmt: skip


# Kimi-Linear (`make_tiny_kimi_linear`): layers KDA / MLA / KDA (layer_types); KDA with 2
# heads of head_dim 12 (!= 128), a 3-tap short conv; MLA with no q low rank (Kimi's), kv_lora
# 16, 12 unrotated + 8 shared key columns, values 10 wide, no rope (Kimi's MLA is NoPE); layer
# 0 dense (first_k_dense_replace 1), layers 1-2 MoE: top-2 of 8 sigmoid-scored experts of
# width 24 in 2 groups (the best 1 eligible), correction bias perturbed, renormalised, times
# 2.446, plus one shared expert. A_log / dt_bias perturbed so every head's decay differs.
KIMI_LINEAR_TINY: dict[str, Any] = dict(
    vocab_size=303,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_local_experts=8,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.446,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    linear_attn_config={
        "head_dim": 12,
        "num_heads": 2,
        "short_conv_kernel_size": 3,
        "kda_layers": [1, 3],
        "full_attn_layers": [2],
    },
    max_position_embeddings=256,
    tie_word_embeddings=False,
    initializer_range=0.2,
)


def make_tiny_kimi_linear(seed: int = 0, out: Path | str | None = None, **overrides: Any) -> Path:
    """A tiny `KimiLinearForCausalLM` checkpoint (`KIMI_LINEAR_TINY` with `overrides`) through
    transformers' own classes; norms, A_log / dt_bias and the routers' correction biases
    perturbed."""
    import transformers

    config = _tiny_config(transformers.KimiLinearConfig, KIMI_LINEAR_TINY, overrides)
    return _save_perturbed(
        config, transformers.KimiLinearForCausalLM, seed, out, "plow-kimi-",
        ("A_log", "dt_bias"), {"e_score_correction_bias": 0.1},
    )  # fmt: skip
