"""The arena: one flat buffer of 4-byte words holding everything a step reads and writes
except the weights.

Layout of the buffer (word offsets):

    [0, kv_words)                 the paged key-value pool, head-major
                                  [layers, 2 (K, V), blocks, kv_heads, block_size, head_dim]
                                  (1 half, not 2, where values are keys: `KVShape.halves`)
                                  in the pool's storage dtype (`KVShape.dtype`: float32, or
                                  opt-in bfloat16 / fp8_e4m3, packed 2 / 4 to a word), then,
                                  for fp8, one fp32 scale per row `KV_SCALE`
                                  [layers, 2, blocks, kv_heads, block_size]
                                  then the recurrent state (`StateShape`: Mamba-2's conv
                                  and SSM state, one fixed-size block per state slot)
    [kv_words, kv_words + act)    one bucket's activations, inputs, outputs and partials;
                                  every bucket's layout starts here (buckets never run at
                                  the same time, so their regions alias)

A `Layout` (per bucket, part of the plan) maps each tensor name to a `Slot` (word offset from
the activation base, shape, dtype). Every dtype is 4 bytes (float32 / int32), so a slot is a
view of the buffer reinterpreted, never a copy. Weights live outside the arena, read-only
(the bundle's memory-mapped weights file).

`Arena.words(name)` is the twin of `view(name)` holding each element's global word index; the
checking mode applies a kernel's index to it to learn exactly which words the kernel touched.

A plan compiled in memory packs its tensors one after another (`LayoutBuilder.add`); a plan
loaded from a bundle places them at the bundle's arena offsets (`LayoutBuilder.place`,
`plow/runtime/cpu/bundle.py`), so tensors the arena planner overlaps share words here too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import ml_dtypes
import numpy as np

WordDType = Literal["float32", "int32"]
KV = "kv"  # the name of the key-value pool in every layout
KV_SCALE = "kv.scale"  # fp8 pool: one fp32 power-of-two scale per (layer, K/V, block, head, slot)
KVDType = Literal["float32", "bfloat16", "fp8_e4m3"]
KV_STORAGE: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
}


@dataclass(frozen=True, slots=True)
class Slot:
    """A tensor's place in the activation region: word `offset` from the base, `shape`."""

    offset: int
    shape: tuple[int, ...]
    dtype: WordDType = "float32"

    @property
    def words(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each tensor of one bucket lives. `aliases` maps a tensor to the tensor whose
    words it shares (e.g. a decode step's sampled ids are written where the next step's
    embedding reads its ids)."""

    slots: Mapping[str, Slot]
    words: int
    aliases: Mapping[str, str]

    def slot(self, name: str) -> Slot:
        return self.slots[self.aliases.get(name, name)]


class LayoutBuilder:
    """Packs slots one after another, each aligned to 16 words (64 bytes)."""

    ALIGN = 16

    def __init__(self) -> None:
        self.slots: dict[str, Slot] = {}
        self.aliases: dict[str, str] = {}
        self.top = 0

    def add(self, name: str, shape: tuple[int, ...], dtype: WordDType = "float32") -> None:
        if name in self.slots:
            raise ValueError(f"tensor {name!r} placed twice")
        self.slots[name] = Slot(self.top, tuple(int(d) for d in shape), dtype)
        n = math.prod(shape)
        self.top += -(-max(n, 1) // self.ALIGN) * self.ALIGN

    def place(
        self, name: str, offset: int, shape: tuple[int, ...], dtype: WordDType = "float32"
    ) -> None:
        """Put `name` at word `offset` (a layout given from outside, e.g. a bundle's arena
        map, where tensors whose live ranges are disjoint share words); later `add`s go
        after everything placed."""
        if name in self.slots:
            raise ValueError(f"tensor {name!r} placed twice")
        self.slots[name] = Slot(offset, tuple(int(d) for d in shape), dtype)
        end = offset + math.prod(shape)
        self.top = max(self.top, -(-end // self.ALIGN) * self.ALIGN)

    def reserve(self, words: int) -> None:
        """Make `top` at least `words` (aligned)."""
        self.top = max(self.top, -(-words // self.ALIGN) * self.ALIGN)

    def alias(self, name: str, target: str) -> None:
        self.aliases[name] = target

    def build(self) -> Layout:
        return Layout(dict(self.slots), self.top, dict(self.aliases))


@dataclass(frozen=True, slots=True)
class KVShape:
    layers: int
    blocks: int
    kv_heads: int
    block_size: int
    head_dim: int
    dtype: KVDType = "float32"
    # 2: keys then values; 1: the values are the keys (plow.graph.mla.kv_halves), one row each
    halves: int = 2

    def __post_init__(self) -> None:
        if self.halves not in (1, 2):
            raise ValueError(f"kv halves must be 1 or 2, got {self.halves}")
        if self.dtype not in KV_STORAGE:
            raise ValueError(f"kv dtype must be one of {sorted(KV_STORAGE)}, got {self.dtype!r}")
        per_word = 4 // KV_STORAGE[self.dtype].itemsize
        if self.head_dim % per_word:
            # a row (one token of one head) must fill whole words: rows written by different
            # tasks never share a word (the checking mode tracks words)
            raise ValueError(f"{self.dtype} key-value rows need head_dim % {per_word} == 0")

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.layers, self.halves, self.blocks, self.kv_heads, self.block_size, self.head_dim
        )  # fmt: skip

    @property
    def scale_shape(self) -> tuple[int, int, int, int, int]:
        return self.shape[:-1]

    @property
    def storage(self) -> np.dtype:
        return KV_STORAGE[self.dtype]

    @property
    def data_words(self) -> int:
        return math.prod(self.shape) * self.storage.itemsize // 4

    @property
    def scale_words(self) -> int:
        return math.prod(self.scale_shape) if self.dtype == "fp8_e4m3" else 0

    @property
    def words(self) -> int:
        return self.data_words + self.scale_words

    @property
    def bytes(self) -> int:
        """Bytes of the pool (data and scales)."""
        return self.words * 4


@dataclass(frozen=True, slots=True)
class StateShape:
    """The recurrent-state region: `slots` blocks (one per live sequence, `PageTable.
    state_slot`), and each state tensor's per-slot shape in region order (float32)."""

    slots: int = 0
    tensors: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def offsets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Word offset (from the region's start) and full shape [slots, ...] per tensor."""
        out, at = {}, 0
        for name, shape in self.tensors:
            out[name] = (at, (self.slots, *shape))
            at += self.slots * math.prod(shape)
        return out

    @property
    def words(self) -> int:
        return sum(self.slots * math.prod(shape) for _, shape in self.tensors)


class Arena:
    """The buffer, the key-value pool view, and the current bucket's layout.

    `grow(words)` enlarges the activation region (a newly compiled bucket needs more); the
    key-value pool keeps its contents and its view is re-created (callers re-read `kv`).
    """

    def __init__(self, kv: KVShape, act_words: int = 0, state: StateShape | None = None) -> None:
        self.kv_shape = kv
        self.state_shape = state or StateShape()
        self._state = self.state_shape.offsets()
        self.kv_words = kv.words + self.state_shape.words  # every word that persists
        self.buf = np.zeros(self.kv_words + act_words, dtype=np.float32)
        self._ids: np.ndarray | None = None
        self.layout: Layout | None = None

    @property
    def act_words(self) -> int:
        return self.buf.shape[0] - self.kv_words

    @property
    def kv(self) -> np.ndarray:
        """The pool in its storage dtype (a view of the buffer's first words)."""
        k = self.kv_shape
        return self.buf[: k.data_words].view(k.storage).reshape(k.shape)

    @property
    def kv_scale(self) -> np.ndarray | None:
        """fp8: the per-row scales (a view); None for other dtypes."""
        k = self.kv_shape
        if not k.scale_words:
            return None
        return self.buf[k.data_words : k.words].reshape(k.scale_shape)

    def grow(self, act_words: int) -> bool:
        """Make room for `act_words` activation words; True when the buffer was replaced."""
        if act_words <= self.act_words:
            return False
        new = np.zeros(self.kv_words + act_words, dtype=np.float32)
        new[: self.buf.shape[0]] = self.buf
        self.buf = new
        self._ids = None
        return True

    def use(self, layout: Layout) -> None:
        self.grow(layout.words)
        self.layout = layout

    def _slot_range(self, name: str) -> tuple[int, tuple[int, ...], WordDType]:
        if name == KV_SCALE and self.kv_shape.scale_words:
            return self.kv_shape.data_words, self.kv_shape.scale_shape, "float32"
        if name in self._state:
            off, shape = self._state[name]
            return self.kv_shape.words + off, shape, "float32"
        assert self.layout is not None, "no layout in use"
        s = self.layout.slot(name)
        return self.kv_words + s.offset, s.shape, s.dtype

    def view(self, name: str) -> np.ndarray:
        if name == KV:
            return self.kv
        off, shape, dtype = self._slot_range(name)
        flat = self.buf[off : off + math.prod(shape)]
        if dtype == "int32":
            flat = flat.view(np.int32)
        return flat.reshape(shape)

    def words(self, name: str) -> np.ndarray:
        """Global word index of every element of `name` (same shape as `view(name)`; the
        elements of a narrow key-value pool share their word)."""
        if self._ids is None or self._ids.shape[0] != self.buf.shape[0]:
            self._ids = np.arange(self.buf.shape[0], dtype=np.int64)
        if name == KV:
            k = self.kv_shape
            per = 4 // k.storage.itemsize
            return np.repeat(self._ids[: k.data_words], per).reshape(k.shape)
        off, shape, _ = self._slot_range(name)
        return self._ids[off : off + math.prod(shape)].reshape(shape)

    def owner(self, word: int) -> str:
        """The tensor holding a global word index (for error messages)."""
        if word < self.kv_shape.words:
            return KV if word < self.kv_shape.data_words else KV_SCALE
        if word < self.kv_words:
            rel = word - self.kv_shape.words
            return next(n for n, (o, sh) in self._state.items() if o <= rel < o + math.prod(sh))
        assert self.layout is not None
        rel = word - self.kv_words
        for name, s in self.layout.slots.items():
            if s.offset <= rel < s.offset + s.words:
                return name
        return "<padding>"

    def snapshot(self) -> bytes:
        """The whole buffer's bytes (tests compare arenas bitwise)."""
        return self.buf.tobytes()
