#!/usr/bin/env bash
# The GPU checks in one command, for a CUDA node or a lent GPU machine:
#   1. the GPU tests (`pytest -m gpu`: bf16 + NCCL training, CUDA execution provider, fp16 bundle on CUDA),
#   2. the training benchmark in bf16 (plain PyTorch vs our DeepSpeed engine, MFU against a timed bf16 matmul),
#   3. the lab preset's pretraining through the launcher for a few hundred steps (tokens/s, bf16, NCCL),
#   4. which attention kernels the encoder reaches (bench/sdpa_check.py).
# Under 9 minutes in all (each step has its own timeout), so that a 15-minute device lease can rerun it.
# Everything it prints goes to files under $OUT (default runs/gpu-check), for docs/BENCHMARKS.md.
#
#   bash bench/gpu_check.sh                  # in a checkout with `make setup` done on the GPU node
#
# A bare image with python3 + CUDA torch (the device tool's): `make gpu-carry` here writes .whl/ (the Python
# packages such an image lacks) and .data/ (cls-books-fr); carry both, and the script installs and uses them.
# Steps are independent: one that fails is recorded in its log and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/gpu-check}
mkdir -p "$out"
py=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if compgen -G ".whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ts-site .whl/*.whl \
    || echo "wheel install failed" | tee "$out/setup.txt"
  export PYTHONPATH=/tmp/ts-site PATH="/tmp/ts-site/bin:$PATH"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TS_TRACEBACK=1
[ -d .data/cls-books-fr ] && export TS_DATA=${TS_DATA:-$PWD/.data}
data=${TS_DATA:-$PWD/../shared/data}
ds="$py -m deepspeed.launcher.runner"  # the `deepspeed` command, without relying on its script being on PATH
# DeepSpeed 0.19.8 JIT-builds FusedAdam for TORCH_CUDA_ARCH_LIST and cannot parse an arch such as "9.0a" (the
# device image sets that): name the GPU's own arch, plain.
export TORCH_CUDA_ARCH_LIST=$($py -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)
# The tests launch `deepspeed` from beside the interpreter; wheels installed with --target put it in /tmp/ts-site/bin.
bindir=$($py -c 'import sys, os; print(os.path.dirname(sys.executable))')
[ -x /tmp/ts-site/bin/deepspeed ] && [ ! -e "$bindir/deepspeed" ] && ln -s /tmp/ts-site/bin/deepspeed "$bindir/deepspeed"

{ nvidia-smi; $py -c "import torch, sys; print(sys.version); print('torch', torch.__version__, torch.cuda.get_device_name(0))"
  $py -m pip list 2>/dev/null | grep -i -E "^(torch|deepspeed|onnxruntime|onnx) "; } >"$out/machine.txt" 2>&1

# 1. GPU tests (each skips itself where what it needs is missing, e.g. onnxruntime-gpu on a bare image).
timeout 120 $py -m pytest -q -m gpu -p no:cacheprovider $(grep -l "mark.gpu" tests/test_*.py) >"$out/gpu-tests.txt" 2>&1

# 2. Training benchmark: 1 process, bf16 (the script picks bf16 on CUDA), both tasks.
timeout 150 $py bench/train_throughput.py --task both --set "data.root=$data" \
  --json "$out/train_throughput.json" >"$out/train_throughput.txt" 2>&1

rm -rf /tmp/ts-gpu-lab  # a warm machine keeps the last run, which a fresh run refuses to overwrite
# 3. The lab preset through the launcher: lab tokenizer and model, bf16, 300 steps, no checkpoint but the last.
timeout 150 $ds --num_gpus "$($py -c 'import torch; print(torch.cuda.device_count())')" launch/pretrain.sh \
  --preset lab --set "data.root=$data" --set engine.precision=bf16 --set pretrain.max_steps=300 \
  --set engine.log_every=50 --out /tmp/ts-gpu-lab >"$out/lab-pretrain.txt" 2>&1
cp /tmp/ts-gpu-lab/metrics.csv "$out/lab-metrics.csv" 2>/dev/null

# 4. Which SDPA kernels the encoder's attention paths reach (flash / memory-efficient / cuDNN / math), and the
#    outputs of each against the math kernel and against fp32 on the CPU.
timeout 60 $py bench/sdpa_check.py --json "$out/sdpa.json" >"$out/sdpa.txt" 2>&1
echo "gpu_check: logs in $out"; tail -n 3 "$out"/*.txt
