"""Block-quantized test checkpoints: a tiny HF checkpoint's matrices as GGML blocks.

The blocks are made by gguf-py's quantizers (llama.cpp's reference algorithms, not plow's),
and `dequantized_checkpoint` writes the exact de-quantization as an ordinary fp32 checkpoint
for transformers: the reference a quantized bundle is gated against.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from plow.checkpoint.quant import BLOCK, METADATA_KEY, QuantTensor, write_metadata
from plow.checkpoint.weights import WeightStore, write_safetensors

_SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _write(path: Path, tensors: dict[str, tuple[str, np.ndarray]], meta: dict[str, str]) -> None:
    write_safetensors(path, tensors, {"format": "pt", **meta})


def _copy_side_files(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for n in _SIDE_FILES:
        if (src / n).is_file():
            shutil.copy2(src / n, dest / n)


def quantize_checkpoint(src: Path, dest: Path, formats: dict[str, str]) -> Path:
    """`dest`: `src` with every 2-D fp32 tensor whose name contains a key of `formats` (first
    match in order) and whose rows are whole blocks stored as that format's blocks."""
    import gguf

    store = WeightStore.open(sorted(src.glob("*.safetensors")), where=src)
    out: dict[str, tuple[str, np.ndarray]] = {}
    quant: dict[str, tuple[str, tuple[int, int]]] = {}
    for name in store:
        a = np.asarray(store[name], dtype=np.float32)
        fmt = next((f for key, f in formats.items() if key in name), None)
        if fmt is not None and a.ndim == 2 and a.shape[1] % BLOCK == 0:
            kind = getattr(gguf.GGMLQuantizationType, fmt.upper())
            blocks = np.asarray(gguf.quants.quantize(a, kind), dtype=np.uint8)
            out[name] = ("U8", blocks)
            quant[name] = (fmt, (a.shape[0], a.shape[1]))
        else:
            out[name] = ("F32", a)
    _copy_side_files(src, dest)
    _write(dest / "model.safetensors", out, {METADATA_KEY: write_metadata(quant)})
    return dest


def dequantized_checkpoint(src: Path, dest: Path) -> Path:
    """`dest`: the quantized checkpoint `src` with every tensor as its exact fp32 values."""
    store = WeightStore.open(sorted(src.glob("*.safetensors")), where=src)
    out = {n: ("F32", np.asarray(store[n], dtype=np.float32)) for n in store}
    _copy_side_files(src, dest)
    _write(dest / "model.safetensors", out, {})
    return dest


def quantized_names(ckpt: Path) -> dict[str, str]:
    """Name → block format of the quantized tensors of a checkpoint."""
    store = WeightStore.open(sorted(ckpt.glob("*.safetensors")), where=ckpt)
    out: dict[str, str] = {}
    for n in store:
        t: object = store[n]
        if isinstance(t, QuantTensor):
            out[n] = t.format
    return out
