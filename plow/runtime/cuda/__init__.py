"""The CUDA executor: the persistent kernel of `kernels/device.cu` (the same interpreter and
tile sources as the host build) on an NVIDIA GPU through the driver API (cuda-python, imported
lazily), one launch per decode step (docs/cuda.md)."""

from plow.runtime.cuda.driver import CudaError, CudaUnavailable, gpu_present
from plow.runtime.cuda.model import (
    CudaMachine,
    CudaModel,
    CudaStepError,
    check_gpu_target,
    generate_cuda,
    open_cuda,
)

__all__ = [
    "CudaError",
    "CudaMachine",
    "CudaModel",
    "CudaStepError",
    "CudaUnavailable",
    "check_gpu_target",
    "generate_cuda",
    "gpu_present",
    "open_cuda",
]
