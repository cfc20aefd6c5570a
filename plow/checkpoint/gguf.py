"""Import a GGUF file as a plow checkpoint directory, block-quantized weights kept as blocks.

The directory is what every other stage reads (`config.json`, tokenizer files, one
`model.safetensors`), so nothing downstream has a GGUF special case: a Q4_0/Q4_1/Q8_0 tensor
is stored as its raw blocks (`plow.checkpoint.quant`), byte for byte as in the GGUF file,
float tensors as they are. The only change to the bytes is llama.cpp's rope permutation of
the q/k projection rows, undone as transformers undoes it — a permutation of whole rows, so
of whole blocks. The config and tokenizer come from transformers' own GGUF readers.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from plow.checkpoint.quant import BLOCK, FORMATS, METADATA_KEY, write_metadata
from plow.checkpoint.weights import write_safetensors
from plow.errors import CheckpointError

# GGUF tensor name (per layer with {i}) -> HuggingFace llama name
_LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

_FLOAT = {"F32": ("F32", np.float32), "F16": ("F16", np.float16)}


def hf_name(gguf_name: str) -> str | None:
    """The HuggingFace name of a llama GGUF tensor (None: not a tensor the model uses)."""
    if gguf_name in _LLAMA_NAMES:
        return _LLAMA_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        pat = _LLAMA_NAMES.get(f"blk.{{i}}.{parts[2]}")
        return pat.format(i=parts[1]) if pat else None
    return None


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (transformers' `_reverse_permute_weights`), on
    rows of any width — float rows or rows of blocks."""
    dim = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def import_gguf(src: Path, dest: Path) -> Path:
    """Write the checkpoint directory `dest` (which must not exist, or be empty) from `src`."""
    try:
        import gguf
        import transformers
    except ImportError as e:
        raise CheckpointError(src, f"importing GGUF needs `gguf` and `transformers`: {e}") from e
    if not src.is_file():
        raise CheckpointError(src, "file not found")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise CheckpointError(dest, "exists and is not empty (plow never overwrites a directory)")
    try:
        reader = gguf.GGUFReader(src)
    except (ValueError, OSError) as e:
        raise CheckpointError(src, f"not a readable GGUF file: {e}") from e
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(
            src, f"general.architecture is {arch!r}; plow imports GGUF files of 'llama' models"
        )
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv") or heads)

    tensors: list[tuple[str, str, tuple[int, ...], np.ndarray]] = []  # name, st dtype, shape, bytes
    quant: dict[str, tuple[str, tuple[int, int]]] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        kind = t.tensor_type.name
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))  # ggml ne is inner-first
        data = np.asarray(t.data)
        if kind.lower() in FORMATS:
            fmt = kind.lower()
            if len(shape) != 2 or shape[1] % BLOCK:
                raise CheckpointError(src, f"tensor {t.name!r}: {kind} of shape {list(shape)}")
            raw = data.reshape(shape[0], -1)
            st = "U8"
            quant[name] = (fmt, (shape[0], shape[1]))
        elif kind in _FLOAT:
            st, np_dt = _FLOAT[kind]
            raw = data.astype(np_dt, copy=False).reshape(shape)
        else:
            raise CheckpointError(
                src,
                f"tensor {t.name!r} is {kind}; plow keeps {', '.join(f.upper() for f in FORMATS)} "
                "blocks and F32/F16 tensors",
            )
        if ".attn_q." in t.name:
            raw = unpermute_rows(raw, heads)
        elif ".attn_k." in t.name:
            raw = unpermute_rows(raw, kv_heads)
        tensors.append((name, st, tuple(raw.shape), np.ascontiguousarray(raw)))

    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config = transformers.AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
        for k in ("quantization_config",):
            if hasattr(config, k):
                delattr(config, k)
        config.dtype = "float32"  # activations; the weights keep their stored precision
        if "lm_head.weight" not in {n for n, *_ in tensors}:
            config.tie_word_embeddings = True
        config.save_pretrained(tmp)
        tok = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        tok.save_pretrained(tmp)
        _write_safetensors(tmp / "model.safetensors", tensors, quant)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dest.exists():
        dest.rmdir()  # empty, checked above
    tmp.rename(dest)
    return dest


def _write_safetensors(
    path: Path,
    tensors: list[tuple[str, str, tuple[int, ...], np.ndarray]],
    quant: dict[str, tuple[str, tuple[int, int]]],
) -> None:
    meta = {"format": "pt", "writer": "plow import-gguf"}
    if quant:
        meta[METADATA_KEY] = write_metadata(quant)
    write_safetensors(path, {name: (st, arr) for name, st, _, arr in tensors}, meta)


def gguf_checkpoint(path: Path, cache: Path | None = None) -> Path:
    """`path` itself, or — for a `.gguf` file — its imported checkpoint directory in the plow
    cache (imported once; keyed by the file's name, size and modification time)."""
    import hashlib

    if path.suffix.lower() != ".gguf" or not path.is_file():
        return path
    if cache is None:
        from plow.default_model import cache_dir

        cache = cache_dir()
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    dest = cache / "gguf" / f"{path.stem}-{key[:16]}"
    if (dest / "model.safetensors").is_file():
        return dest
    import sys

    print(f"plow: importing {path.name} with its blocks kept (once): {dest}", file=sys.stderr)
    return import_gguf(path, dest)
