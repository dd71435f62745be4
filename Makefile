# Every target creates and reuses the local virtualenv .venv; nothing needs installing by hand.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# DeepSpeed JIT-compiles its shared-memory comm op on first use; keep the cache in the project.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export DS_ACCELERATOR ?= cpu

.PHONY: help setup system-deps test test-slow lint demo proto lock clean triton-venv gpu-carry

help:
	@echo "make demo      set up, then pretrain -> fine-tune -> export -> serve on the default data"
	@echo "make test      set up, then run the test suite (what CI runs)"
	@echo "make test-slow the long suites (soak, large fuzz)"
	@echo "make lint      ruff"
	@echo "make proto     regenerate the gRPC code from proto/"
	@echo "make gpu-carry wheels + data for bench/gpu_check.sh on a bare GPU image"

setup: $(STAMP)

# numactl: DeepSpeed's --bind_cores_to_rank; g++: DeepSpeed's JIT-compiled ops.
system-deps:
	@if ! command -v numactl >/dev/null || ! command -v g++ >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq numactl g++ >/dev/null; \
	  else echo "warning: numactl/g++ missing and not root: install them for core binding and DeepSpeed ops"; fi; fi

$(STAMP): pyproject.toml requirements.lock | system-deps
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, from the same constraints: never a CUDA build by accident.
	$(BIN)/pip install -q -c requirements.lock torch
	$(BIN)/pip install -q -c requirements.lock -e '.[train,serve,dev]'
	touch $(STAMP)

# tritonclient pins protobuf < 7 and our generated code needs >= 7.35.1: the KServe conformance test runs it
# from its own venv, pinned by requirements-triton.lock.
triton-venv: .venv-triton/.installed

.venv-triton/.installed: requirements-triton.lock
	test -x .venv-triton/bin/python || $(PY) -m venv .venv-triton
	.venv-triton/bin/pip install -q -r requirements-triton.lock
	touch $@

test: setup triton-venv
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
# machines): the wheels it lacks in .whl/ and the data bench/gpu_check.sh reads in .data/; carry both there.
GPU_PY ?= 3.12
gpu-carry: setup
	rm -rf .whl .data && mkdir -p .whl .data
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w .whl -c requirements.lock deepspeed
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl -c requirements.lock \
	  hjson pydantic pydantic-core annotated-types typing-inspection grpcio-health-checking grpcio-reflection
	cp -r ../shared/data/cls-books-fr ../shared/data/eltec-fr .data/
	du -sh .whl .data

lock:
	rm -rf /tmp/ts-lock-venv && $(PY) -m venv /tmp/ts-lock-venv
	/tmp/ts-lock-venv/bin/pip install -q torch==2.13.0
	/tmp/ts-lock-venv/bin/pip install -q '.[train,serve,dev]'
	/tmp/ts-lock-venv/bin/pip freeze --exclude transfer-sentiment

clean:
	rm -rf $(VENV) .cache runs .pytest_cache
