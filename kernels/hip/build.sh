#!/usr/bin/env bash
# Compile kernels/device.cu with hipcc for each AMD architecture given (code objects for
# hipModuleLoadData), warnings as errors. An architecture the installed compiler does not know
# (Debian's hipcc 5.2 sits on clang 15, which predates gfx942) is skipped with a message, not an
# error; any other failure is an error. Usage: build.sh OUT_DIR ARCH...
set -euo pipefail
out=$1
shift
hipcc=${HIPCC:-hipcc}
if ! command -v "$hipcc" >/dev/null 2>&1; then
  echo "hip: skipped ($hipcc not found; Debian: apt-get install hipcc)"
  exit 0
fi
mkdir -p "$out"
src=$(dirname "$0")/../device.cu
built=0
for arch in "$@"; do
  dest=$out/plow_device_$arch.hsaco
  log=$(mktemp)
  # HIP_PLATFORM=amd: with nvcc on the PATH, hipcc would otherwise pick the NVIDIA platform
  if HIP_PLATFORM=amd "$hipcc" -x hip -std=c++20 --genco --offload-arch="$arch" \
      -ffp-contract=off -O3 -Wall -Wextra -Werror "$src" -o "$dest.tmp" >"$log" 2>&1; then
    mv "$dest.tmp" "$dest"
    echo "hip: $dest"
    built=$((built + 1))
  elif grep -q "invalid target ID '$arch'\|unsupported CUDA gpu architecture\|Unknown target CPU\|not a recognized processor" "$log"; then
    echo "hip: skipped $arch (this hipcc's compiler does not know it: $(grep -m1 -o "invalid target ID '$arch'\|not a recognized processor[^;]*" "$log"))"
    rm -f "$dest.tmp"
  else
    cat "$log" >&2
    rm -f "$log" "$dest.tmp"
    exit 1
  fi
  rm -f "$log"
done
[ "$built" -gt 0 ] || echo "hip: no architecture compiled"
