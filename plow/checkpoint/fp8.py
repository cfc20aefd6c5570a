"""fp8 (e4m3) weights with their scales, as fp8 checkpoints ship them.

A quantized `[N, K]` weight `W` is stored as `float8_e4m3fn` beside a float scale tensor:
`W_scale_inv` `[ceil(N/bn), ceil(K/bk)]` (block scales, `quantization_config.weight_block_size
= [bn, bk]`, DeepSeek-V3 / Qwen3-FP8 layout) or `W_scale` `[N]` / `[N, 1]` (one scale per output
channel). The real weight is `W[n, k] * scale[n // bn, k // bk]` (resp. `* scale[n]`), computed
in fp32. `np.asarray(t, np.float32)` gives that de-quantization, so the `cpu` executor, the
reference and the native loader (which widens what it cannot read in place to fp32) see the
same weights; the bytes stay fp8 in the checkpoint and the bundle.

The block size is not in the tensors: a `[N, K]` weight with `[sN, sK]` scales has blocks of
the power of two `bn` with `ceil(N / bn) = sN` (unique when `sN > 1`; any `bn >= N` when
`sN = 1`) — the config's `weight_block_size` must agree (`plow.checkpoint.families.common`).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from plow.errors import CheckpointError

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_SUFFIXES = ("_scale_inv", "_scale")


def block_of(extent: int, scales: int) -> int:
    """The power-of-two block with `ceil(extent / block) == scales` (module docstring)."""
    b = 1
    while -(-extent // b) > scales:
        b *= 2
    return b


class Fp8Tensor:
    """An fp8 weight and its scales; `np.asarray(t, np.float32)` de-quantizes (each call)."""

    __slots__ = ("values", "scale", "block")

    def __init__(self, values: np.ndarray, scale: np.ndarray, where: str) -> None:
        # [.., N, K] (stacked experts: leading dims), scales [.., sN, sK] or per channel
        *lead, n, k = values.shape
        s = np.asarray(scale, dtype=np.float32)
        if s.shape == (*lead, n) or s.shape == (*lead, n, 1):
            s = s.reshape(*lead, n, 1)
            block = (1, k)
        elif s.ndim == values.ndim and tuple(s.shape[:-2]) == tuple(lead):
            block = (block_of(n, s.shape[-2]), block_of(k, s.shape[-1]))
        else:
            raise CheckpointError(
                where, f"fp8 scale of shape {list(s.shape)} for weight {list(values.shape)}"
            )
        if -(-n // block[0]) != s.shape[-2] or -(-k // block[1]) != s.shape[-1]:
            raise CheckpointError(
                where,
                f"fp8 scale of shape {list(s.shape)} does not tile weight {list(values.shape)}",
            )
        self.values = values
        self.scale = s
        self.block = block

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def dtype(self) -> np.dtype:
        return FP8

    @property
    def ndim(self) -> int:
        return int(self.values.ndim)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        n, k = self.values.shape[-2:]
        bn, bk = self.block
        s = np.repeat(np.repeat(self.scale, bn, axis=-2)[..., :n, :], bk, axis=-1)[..., :k]
        w = (np.asarray(self.values, dtype=np.float32) * s).astype(np.float32)
        return w if dtype is None else w.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"Fp8Tensor({list(self.shape)}, block {list(self.block)})"


def quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """`w` [N, K] as fp8 e4m3 with block scales `[ceil(N/bn), ceil(K/bk)]` (each block's
    `amax / 448`): what an fp8 checkpoint stores (tests build fixtures with it)."""
    n, k = w.shape
    bn, bk = block
    sn, sk = -(-n // bn), -(-k // bk)
    scale = np.zeros((sn, sk), dtype=np.float32)
    q = np.zeros((n, k), dtype=FP8)
    for i in range(sn):
        for j in range(sk):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].astype(np.float32)
            s = float(np.abs(blk).max()) / 448.0 or 1.0
            scale[i, j] = s
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (blk / s).astype(FP8)
    return q, scale
