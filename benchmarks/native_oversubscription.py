"""ms per generated token of the native executor at batch 1 on one bundle, for one thread count.

Usage: ``python benchmarks/native_oversubscription.py BUNDLE THREADS`` (``PLOW_NATIVE_LIB`` picks
the library, e.g. an older build for a before/after). Run it interleaved with another library and
with CPU hogs beside it (``python3 -c 'while 1: pass'``) to see how the workers behave when the
cores are oversubscribed; results/benchmarks/native_oversubscription.md is one such run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from plow.runtime.cpu import Request, generate
from plow.runtime.native import open_native


def main() -> None:
    bundle, threads = sys.argv[1], int(sys.argv[2])
    m = open_native(bundle, max_batch=1, threads=threads)
    generate(m, [Request((5, 17, 93, 2), 4)])  # warm-up
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        generate(m, [Request((5, 17, 93, 2), 16)])
        ts.append((time.perf_counter() - t) / 16)
    lib = os.environ.get("PLOW_NATIVE_LIB") or "default"
    print(f"{lib} threads={threads} ms/token={1e3 * statistics.median(ts):.1f}")


if __name__ == "__main__":
    main()
