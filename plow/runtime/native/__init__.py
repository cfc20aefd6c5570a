"""The native executor: the persistent kernel of `kernels/` (C++, one source for the host and
device builds) running certified bundles on CPU threads (docs/runtime.md, "Native executor")."""

from plow.runtime.native.library import NativeUnavailable, available, build_info
from plow.runtime.native.model import NativeMachine, NativeModel, NativeStepError, open_native

__all__ = [
    "NativeMachine",
    "NativeModel",
    "NativeStepError",
    "NativeUnavailable",
    "available",
    "build_info",
    "open_native",
]
