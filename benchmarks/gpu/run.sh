#!/usr/bin/env bash
# The prepared device check for the CUDA executor, for a bare H200 machine (issue 13). From the
# repository root:
#
#   benchmarks/gpu/run.sh            # build, gpu tests, decode study; results in $OUT
#   benchmarks/gpu/run.sh --dry-run  # no GPU: everything up to the first GPU call
#
# 1. Python packages: the machine's python3 must import plow's dependencies and cuda-python's
#    driver bindings; what is missing is installed from wheels in $PLOW_WHEELS
#    (default _build/gpu-wheels, filled here by benchmarks/gpu/fetch_wheels.sh and carried,
#    since that machine reaches no registry), else from the index when one is reachable.
# 2. Build: the native library (make native: the gpu tests compare against it) and the CUDA
#    module (kernels/Makefile.device, nvcc -arch=sm_90a, warnings as errors).
# 3. The gpu tests (tests/runtime/test_cuda.py -m gpu), log in $OUT/gpu_tests.log.
# 4. The decode study (benchmarks/gpu/decode.py): batch-1 µs/token for Llama-3.2-1B- and
#    Llama-3.1-8B-shaped bf16 bundles with generated weights against the HBM roofline, greedy
#    quanta of 4 steps per launch, each shape twice: tensor-core linears (the default for bf16)
#    and the scalar tiles; $OUT/gpu_decode.json and $OUT/gpu_decode.md (the summary prints it).
#
# Sized for 8 minutes with the build (about 1.5 min build, 2 min tests, 3 min study on 16
# cores); each stage is bounded by `timeout`, and a failed stage does not stop the next one:
# the script's status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-$PWD/_build/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WHEELS=${PLOW_WHEELS:-$PWD/_build/gpu-wheels}
SITE=${PLOW_SITE:-/tmp/plow-site}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
status=0
fail() { echo "run.sh: $1 failed (exit $2)" | tee -a "$OUT/summary.txt"; [ "$status" -ne 0 ] || status=$2; }
stage() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }

stage "python packages"
missing=$(PLOW_DRY=$DRY "$PY" -c '
import importlib.util as u, os
def has(m):
    try:
        return u.find_spec(m) is not None
    except ModuleNotFoundError:
        return False
need = {"numpy": "numpy", "ml_dtypes": "ml-dtypes", "safetensors": "safetensors",
        "tokenizers": "tokenizers", "pydantic": "pydantic", "typer": "typer", "rich": "rich",
        "yaml": "pyyaml", "transformers": "transformers", "torch": "torch", "pytest": "pytest",
        "pytest_timeout": "pytest-timeout", "cuda.bindings.driver": "cuda-python"}
if os.environ["PLOW_DRY"] == "1":
    del need["cuda.bindings.driver"]  # a dry run never calls the driver
print(" ".join(p for m, p in need.items() if not has(m)))
')
if [ -n "$missing" ]; then
  echo "missing: $missing"
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:$SITE" \
      || fail "wheel install" 3
  else
    # a venv with the missing packages from the index (works where a registry is reachable)
    "$PY" -m venv --system-site-packages "$SITE.venv" && PY="$SITE.venv/bin/python" \
      && "$PY" -m pip install -q $missing || fail "pip install $missing" 3
  fi
fi
"$PY" -c 'import plow.runtime.cuda, pydantic, numpy; print("plow imports")' || fail "imports" 3

if [ "$DRY" -eq 1 ]; then
  stage "dry run: compile check (no GPU needed), then the study's plan-only pass"
  if command -v nvcc >/dev/null; then
    timeout 300 make --no-print-directory -f kernels/Makefile.device cuda >"$OUT/build.log" 2>&1 \
      || fail "make cuda" 4
  else
    echo "nvcc not found: compile skipped" | tee -a "$OUT/summary.txt"
  fi
  timeout 600 "$PY" benchmarks/gpu/decode.py --dry-run --out "$OUT" || fail "decode.py --dry-run" 5
  exit $status
fi

stage "GPU"
nvidia-smi -L 2>&1 | tee -a "$OUT/summary.txt" || fail "nvidia-smi" 2

stage "build (make native, make cuda)"
# the host library and the CUDA module side by side (one compiler process each)
timeout 240 make --no-print-directory native CXX="${CXX:-g++}" >"$OUT/build_native.log" 2>&1 &
native=$!
# the cubin only (the PTX is for the host-side tests), with ptxas's resource report
timeout 240 make --no-print-directory -f kernels/Makefile.device _build/native/plow_device.cubin \
  CUDA_EXTRA=--resource-usage >"$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; fail "make cuda" 4; }
wait $native || { tail -30 "$OUT/build_native.log"; fail "make native" 4; }
grep -A3 "entry function 'plow_step'" "$OUT/build.log" | grep -E "registers|stack" \
  | tee -a "$OUT/summary.txt"

stage "gpu tests"
# the tensor-core test in its own process: a GPU fault is sticky for the CUDA context, so a
# fault there must not fail the scalar path's tests with it
timeout 180 "$PY" -m pytest -q -s -rA -m gpu -p no:cacheprovider tests/runtime/test_cuda.py \
  -k "not tensor_core" >"$OUT/gpu_tests.log" 2>&1 || fail "gpu tests" 6
timeout 90 "$PY" -m pytest -q -s -rA -m gpu -p no:cacheprovider tests/runtime/test_cuda.py \
  -k tensor_core >>"$OUT/gpu_tests.log" 2>&1 || fail "gpu tests (tensor cores)" 6
tail -15 "$OUT/gpu_tests.log" | tee -a "$OUT/summary.txt"
grep -h "bitwise equal\|tensor cores:" "$OUT/gpu_tests.log" | tee -a "$OUT/summary.txt"

stage "decode study"
timeout 270 "$PY" benchmarks/gpu/decode.py --out "$OUT" 2>&1 | tee "$OUT/decode.log" \
  || fail "decode study" 7
[ -f "$OUT/gpu_decode.md" ] && cat "$OUT/gpu_decode.md" >>"$OUT/summary.txt"

stage "done (status $status)"
exit $status
