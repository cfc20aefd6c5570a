#!/usr/bin/env bash
# Download (here, where a registry is reachable) the wheels the device machine lacks, for its
# python3 (3.12, x86-64 manylinux): plow's dependencies that its image does not ship. They go
# to _build/gpu-wheels (git-ignored); name that folder in the device tool's `carry`, and
# benchmarks/gpu/run.sh installs them there with --no-index. Versions are this checkout's
# venv's, so the device runs what the tests here ran.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-_build/gpu-wheels}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$dest"
pkgs=()
for name in pydantic pydantic-core annotated-types typing-inspection; do
  v=$("$py" -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
  pkgs+=("$name${v:+==$v}")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" "${pkgs[@]}"
ls -la "$dest"
