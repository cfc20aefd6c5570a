"""The `Target` model: the hardware numbers the tiler, the bounds and the schedule read.

A target is data (a JSON file validated by pydantic). Shipped specs live in
`plow/target/specs/<name>.json`; `plow calibrate target cpu` writes one for this machine.
Field meanings and sources: docs/targets.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["bf16", "fp8", "fp32"]
Scope = Literal["cta", "device", "system"]

# Storage dtype names (config / graph spelling) → the peak-rate class that computes them.
_RATE_CLASS: dict[str, DType] = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "bf16",  # fp16 tensor-core rate equals bf16 on every shipped target
    "fp16": "bf16",
    "float32": "fp32",
    "fp32": "fp32",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "fp8": "fp8",
}

# Bytes per element of the storage dtypes a plan can hold.
DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "float32": 4,
    "fp32": 4,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a storage dtype; `ValueError` names an unknown one."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r} (known: {', '.join(sorted(DTYPE_BYTES))})"
        ) from None


def rate_class(dtype: str) -> DType:
    """The peak-rate class (`bf16`, `fp8`, `fp32`) that computes a storage dtype."""
    try:
        return _RATE_CLASS[dtype]
    except KeyError:
        raise ValueError(
            f"no peak rate for dtype {dtype!r} (known: {', '.join(sorted(_RATE_CLASS))})"
        ) from None


class MinTile(BaseModel):
    """Smallest tile the target's matrix units compute: `rows` (tokens, M) x `cols` (N, K)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rows: int = Field(ge=1)
    cols: int = Field(ge=1)


class Target(BaseModel):
    """One accelerator (or this CPU): the numbers the cost model and the bounds use.

    Rates are integers (bytes/s, flop/s) so the checkpoint B payload can carry them exactly.
    `peak_flops_per_s` is dense (no structured sparsity), aggregate over all workers of one
    device, per compute dtype. `gpus` is the device count of a tensor-parallel group; the
    tiler plans one device and the schedule splits across `gpus`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    vendor: str = ""
    workers: int = Field(ge=1, description="SMs (NVIDIA), CUs (AMD) or cores (CPU)")
    l2_partitions: int = Field(ge=1, description="L2 slices that own disjoint addresses (dies)")
    l2_bytes: int = Field(ge=0, description="total L2 (last-level on-device cache) bytes")
    onchip_bytes_per_worker: int = Field(ge=1, description="shared memory / LDS per worker")
    page_bytes: int = Field(ge=1, description="on-chip page size the schedule allocates in")
    memory_bytes: int = Field(ge=0, default=0, description="device memory capacity")
    bandwidth_bytes_per_s: int = Field(ge=1, description="device-memory bandwidth")
    peak_flops_per_s: dict[DType, int] = Field(description="dense peak per compute dtype")
    min_tile: MinTile
    atomic_latency_ns: dict[Scope, int] = Field(description="counter round trip per scope")
    launch_overhead_ns: int = Field(ge=0, description="one dispatch of the persistent kernel")
    tile_overhead_ns: int = Field(
        ge=0, description="fixed cost of one tile (packet decode, wait, signal)"
    )
    gpus: int = Field(ge=1, default=1, description="devices in the tensor-parallel group")
    comment: str = Field(default="", description="sources of the figures")

    @model_validator(mode="after")
    def _complete(self) -> Target:
        missing = [d for d in ("bf16", "fp8", "fp32") if d not in self.peak_flops_per_s]
        if missing:
            raise ValueError(f"peak_flops_per_s lacks {', '.join(missing)}")
        if any(v <= 0 for v in self.peak_flops_per_s.values()):
            raise ValueError("peak_flops_per_s values must be positive")
        scopes = [s for s in ("cta", "device", "system") if s not in self.atomic_latency_ns]
        if scopes:
            raise ValueError(f"atomic_latency_ns lacks {', '.join(scopes)}")
        if self.page_bytes > self.onchip_bytes_per_worker:
            raise ValueError(
                f"page_bytes {self.page_bytes} exceeds onchip_bytes_per_worker "
                f"{self.onchip_bytes_per_worker}"
            )
        return self

    def peak(self, dtype: str) -> int:
        """Dense peak flop/s of the whole device for ops computing in storage dtype `dtype`."""
        return self.peak_flops_per_s[rate_class(dtype)]

    @property
    def min_tile_any_axis(self) -> int:
        """The smallest tile allowed on any axis (checkpoint B's single `min_tile`)."""
        return min(self.min_tile.rows, self.min_tile.cols)
