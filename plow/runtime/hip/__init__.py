"""The HIP executor: `kernels/device.cu`'s HIP build on an AMD GPU through the HIP runtime's
module API (ctypes on libamdhip64), the CUDA executor's machine unchanged (docs/cuda.md)."""

from plow.runtime.hip.driver import HipError, HipUnavailable, amd_gpu_present
from plow.runtime.hip.model import HipModel, check_amd_target, generate_hip, open_hip

__all__ = [
    "HipError",
    "HipModel",
    "HipUnavailable",
    "amd_gpu_present",
    "check_amd_target",
    "generate_hip",
    "open_hip",
]
