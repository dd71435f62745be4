#!/usr/bin/env bash
# The GPU serving checks in one command, for a CUDA node or a GPU node without internet:
#   setup      install the prepared wheels (.gpu-serve/, `make gpu-serve-offline`) and point onnxruntime at the CUDA 13
#              libraries that torch brought (LD_LIBRARY_PATH)
#   machine    record the machine, the versions, and whether onnxruntime's CUDA provider and its libraries load
#   tests      the CUDA tests (pytest -m gpu: the predictor on the CUDA provider, the CUDA graph and the fp16 bundle
#              against PyTorch)
#   bundles    the lab-size classifier with random weights, exported twice: fp32 for CUDA + int8 for the CPU, and fp16
#   serve      bench/serve_bench.py --device cuda: texts/s and p50/p99 at concurrency 1 8 64 256, 1 and 64 texts per
#              call, the fp32 graph (batching on and off) then, after `workers`, the fp16 one; the server against the
#              in-process predictor and PyTorch eager on the same GPU
#   workers    bench/workers_bench.py --workers 1 2 4 8 --floor: the request path on many cores (CPU provider, lab
#              size, int8), the servers on all cores but the last two, h2load on those two
#   iobinding  bench/ort_batch_efficiency.py --io-binding --cuda-graph: plain runs against IO binding per batch size,
#              and a CUDA-graph replay (or onnxruntime's refusal of it)
#   rss        deploy/measure_rss.py: the server's memory on CUDA (deploy/gpu/'s memory request)
#   summary    bench/gpu_serve_summary.py: one table of all of it, also in $out/summary.md
# Under 9 minutes in all: each step has a budget, cut to what is left before --deadline (540 s); a step with less
# than 10 s left is skipped. Steps are independent: a failure is recorded in steps.tsv and the next one runs.
# Without a GPU (or with --device cpu) the same steps run on the CPU provider: no tests, no IO binding, no fp16.
#
#   bash bench/gpu_serve_check.sh                       # in a checkout with `make setup` done, or see below
#   bash bench/gpu_serve_check.sh --quick --out /tmp/q  # the tests' tiny model and short points: the path, not figures
#   bash bench/gpu_serve_check.sh --pack                # $OUT keeps summary.md and logs.tar.gz only
#
# A GPU node without internet, with python3.12, a CUDA 13 torch, numpy, sentencepiece and onnx (no onnxruntime-gpu, no
# grpcio): `make gpu-serve-offline`, on a machine with a network, writes .gpu-serve/: ort/ (onnxruntime-gpu in 61 MiB
# parts, for a transfer that limits the size of a file, and SHA256SUMS), whl/ (the other wheels the node lacks), data/
# (cls-books-fr) and h2load/ (h2load and its libraries from Debian's packages). Copied to the node with this checkout,
# the script joins the parts, checks every sha256, and installs the wheels with `pip install --no-deps --target`.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  echo "options: --out DIR (default \$OUT, else runs/gpu-serve-check)  --quick  --device auto|cuda|cpu"
  echo "         --only STEP,STEP (of: $STEPS)  --deadline SECONDS"
  echo "         --carry DIR (the prepared folder, default .gpu-serve)  --seconds S (per benchmark point)"
  echo "         --pack (leave in DIR only summary.md and logs.tar.gz: an output that is quick to copy off the node)"
}
die() { echo "gpu_serve_check: $*" >&2; exit 2; }

STEPS="setup machine tests bundles serve workers iobinding rss summary"
out=${OUT:-runs/gpu-serve-check}
quick=0 pack=0 device=auto only="" deadline=540 carry=.gpu-serve seconds=""
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --quick) quick=1 ;;
    --pack) pack=1 ;;
    --out|--device|--only|--deadline|--carry|--seconds)
      [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"
      case $1 in
        --out) out=$2 ;; --device) device=$2 ;; --only) only=$2 ;; --deadline) deadline=$2 ;;
        --carry) carry=$2 ;; --seconds) seconds=$2 ;;
      esac
      shift ;;
    *) die "unknown option $1 (--help lists them)" ;;
  esac
  shift
done
case $device in auto|cuda|cpu) ;; *) die "--device $device: choose auto, cuda or cpu" ;; esac
[[ $deadline =~ ^[0-9]+$ ]] && [ "$deadline" -ge 10 ] || die "--deadline $deadline: a number of seconds >= 10"
[ -z "$seconds" ] || [[ $seconds =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--seconds $seconds: a number of seconds"
for s in ${only//,/ }; do
  [[ " $STEPS " == *" $s "* ]] || die "--only: unknown step $s (steps: $STEPS)"
done
wanted() { [ -z "$only" ] || [[ ",$only," == *",$1,"* ]]; }

case $carry in /*) ;; *) carry=$PWD/$carry ;; esac
mkdir -p "$out" || die "cannot create $out"
out=$(cd "$out" && pwd)
work=${TMPDIR:-/tmp}/ts-gpu-serve
mkdir -p "$work"
py=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TS_TRACEBACK=1
[ -d "$carry/data/cls-books-fr" ] && export TS_DATA=${TS_DATA:-$carry/data}
data=${TS_DATA:-$($py -c 'from trainer.config.presets import data_sets; print(data_sets())')}  # data fetch's folder
printf 'step\tstatus\tseconds\n' >"$out/steps.tsv"

# step NAME BUDGET COMMAND...: run COMMAND with its output in $out/NAME.txt, for at most BUDGET seconds and never past
# the deadline (a shell function of this script runs in this shell, untimed: setup and machine, which are short);
# records ok / failed (exit code) / timed out / skipped in steps.tsv.
step() {
  local name=$1 budget=$2
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 10 ]; then
    printf '%s\tskipped: %ss left of the %ss deadline\t0\n' "$name" "$left" "$deadline" >>"$out/steps.tsv"
    return 0
  fi
  [ "$budget" -gt "$left" ] && budget=$left
  local start=$SECONDS rc=0
  echo "gpu_serve_check: $name (at most ${budget}s)"
  if declare -F "$1" >/dev/null; then
    "$@" >>"$out/$name.txt" 2>&1 || rc=$?
  else
    timeout --kill-after=10 "$budget" "$@" >>"$out/$name.txt" 2>&1 || rc=$?
  fi
  local status=ok
  [ "$rc" -ne 0 ] && status="failed (exit $rc)"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="timed out after ${budget}s"
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" >>"$out/steps.tsv"
  return 0
}
skip() { printf '%s\tskipped: %s\t0\n' "$1" "$2" >>"$out/steps.tsv"; }

# ------------------------------------------------------------------------------------------------------ setup
# Joins .gpu-serve/ort's parts into the wheel, each part and the whole checked against SHA256SUMS; a part missing or
# altered is named. Then every prepared wheel goes into $work/site, ahead of the machine's own packages.
join_wheel() {
  local sums=$carry/ort/SHA256SUMS wheel="" sum name
  [ -f "$sums" ] || { echo "$sums missing: copy it with the parts (make gpu-serve-offline writes both)"; return 2; }
  while read -r sum name; do
    case $name in
      *.whl) wheel=$name ;;
      *)
        [ -f "$carry/ort/$name" ] || { echo "$carry/ort/$name missing: copy every part SHA256SUMS lists"; return 2; }
        echo "$sum  $carry/ort/$name" | sha256sum --quiet -c - \
          || { echo "$carry/ort/$name: sha256 differs from SHA256SUMS (a partial or altered copy)"; return 2; } ;;
    esac
  done <"$sums"
  [ -n "$wheel" ] || { echo "$sums names no .whl"; return 2; }
  local parts
  parts=$(awk '$2 !~ /\.whl$/ {print $2}' "$sums")
  # shellcheck disable=SC2086  # the part names, one word each, in SHA256SUMS's order
  (cd "$carry/ort" && cat $parts) >"$work/$wheel"
  echo "$(awk -v w="$wheel" '$2 == w {print $1}' "$sums")  $work/$wheel" | sha256sum --quiet -c - \
    || { echo "$wheel: the joined parts' sha256 differs from SHA256SUMS"; return 2; }
  echo "$work/$wheel"
}

setup() {
  local wheels=()
  if [ -d "$carry/ort" ]; then
    local joined
    joined=$(join_wheel) || { echo "$joined"; return 2; }
    wheels+=("$joined")
  fi
  if compgen -G "$carry/whl/*.whl" >/dev/null; then wheels+=("$carry"/whl/*.whl); fi
  if [ ${#wheels[@]} -gt 0 ]; then
    rm -rf "$work/site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" "${wheels[@]}" \
      || { echo "pip could not install the prepared wheels"; return 2; }
    echo "installed: ${wheels[*]##*/}"
  fi
  echo "python: $("$py" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
  nvidia-smi 2>&1 | head -15 || true
}

# torch's CUDA libraries (site-packages/nvidia/*/lib) on the loader's path, for onnxruntime's CUDA provider.
cuda_library_dirs() {
  "$py" - <<'EOF'
import glob, os, sys
dirs = {os.path.dirname(p) for d in sys.path if d and os.path.isdir(d)
        for p in glob.glob(os.path.join(d, "nvidia", "*", "lib", "lib*.so*"))}
print(":".join(sorted(dirs)))
EOF
}

machine() {
  "$py" - <<'EOF'
import json, os, platform
import onnxruntime as o
from contract import runtime
facts = {"machine": platform.machine(), "cores": os.cpu_count(), "onnxruntime": o.__version__,
         "onnxruntime_file": o.__file__, "onnxruntime_cuda": getattr(o, "cuda_version", ""),
         "providers": o.get_available_providers(), "cuda_library_problem": runtime.cuda_library_problem(),
         "driver": runtime.cuda_driver_present()}
try:
    import torch
    facts.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                 gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
except ImportError:
    facts["torch"] = None
print(json.dumps(facts, indent=1))
EOF
}

wanted setup && step setup 60 setup
# What setup installed (now or on an earlier run) comes first; then torch's CUDA libraries for onnxruntime.
[ -d "$work/site" ] && export PYTHONPATH="$work/site:$PYTHONPATH" PATH="$work/site/bin:$PATH"
libs=$(cuda_library_dirs 2>/dev/null)
[ -n "$libs" ] && export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# h2load from Debian's packages, its libraries beside it: a wrapper gives them to it alone.
if [ -x "$carry/h2load/usr/bin/h2load" ] && ! command -v h2load >/dev/null; then
  mkdir -p "$work/bin"
  # shellcheck disable=SC2016  # $LD_LIBRARY_PATH and $@ are the wrapper's, expanded when it runs
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
    "$carry/h2load/usr/lib/x86_64-linux-gnu" "$carry/h2load/usr/bin/h2load" >"$work/bin/h2load"
  chmod +x "$work/bin/h2load"
  export PATH="$work/bin:$PATH"
fi
wanted machine && step machine 30 machine

# The device the benchmarks use: cuda where onnxruntime's CUDA provider loads (or --device cuda: then a failure to
# load is each step's error), else the CPU.
gpu=0
{ [ -e /dev/nvidiactl ] || nvidia-smi -L >/dev/null 2>&1; } && gpu=1
if [ "$device" = auto ]; then
  device=cpu
  "$py" -c 'from contract import runtime as r; import sys; sys.exit(0 if r.cuda_driver_present() and
r.cuda_library_problem() is None else 1)' 2>/dev/null && device=cuda
  if [ "$gpu" = 1 ] && [ "$device" = cpu ]; then
    why=$("$py" -c 'from contract import runtime as r; print(r.cuda_unavailable_reason())' 2>&1 | tail -1)
    echo "gpu_serve_check: WARNING: a GPU is here but onnxruntime's CUDA provider does not load, so the" \
      "benchmarks run on the CPU: $why"
  fi
fi
echo "gpu_serve_check: device $device, output in $out"
echo "$device" >"$out/device.txt"

if [ "$quick" = 1 ]; then
  size=tiny secs=${seconds:-0.3} conc="1 4" percall="1 4" workers="1 2" wsecs=1 rss_secs=1
else
  size=lab secs=${seconds:-1.5} conc="1 8 64 256" percall="1 64" workers="1 2 4 8" wsecs=4 rss_secs=10
fi
cores=$(nproc)
# The GPU server's flags: deploy/gpu/'s batch (64 lab-size texts, any padding), and room for 256 callers of 64
# texts each (queue, handler threads, calls at once).
server_args=""
[ "$device" = cuda ] && server_args="--max-batch-tokens 32768 --max-padding 1000 --max-queue 20000 \
--max-workers 300 --max-concurrent-rpcs 512"

# ------------------------------------------------------------------------------------------------------ tests
if wanted tests; then
  if [ "$device" = cuda ] || [ "$gpu" = 1 ]; then  # on a GPU whose provider fails, the tests say how
    step tests 120 "$py" -m pytest -q -rs -m gpu -p no:cacheprovider -o addopts="" --timeout 120 \
      tests/test_serving_predictor.py tests/test_bundle_format.py tests/test_export.py
  else
    skip tests "no CUDA here: the CUDA tests skip themselves"
  fi
fi

# ---------------------------------------------------------------------------------------------------- bundles
if wanted bundles; then
  rm -rf "$work/bundle" "$work/bundle-fp16"
  step bundles 90 "$py" bench/serve_bench.py --data "$data" --size "$size" --make-bundle "$work/bundle"
  if [ "$device" = cuda ]; then
    step bundles-fp16 60 "$py" bench/serve_bench.py --data "$data" --size "$size" --precision fp16 \
      --make-bundle "$work/bundle-fp16"
  else
    skip bundles-fp16 "fp16 is the CUDA graph"
  fi
fi

# ------------------------------------------------------------------------------------------------------ serve
if wanted serve; then
  # shellcheck disable=SC2086  # lists of numbers, one word each
  step serve-fp32 150 "$py" bench/serve_bench.py --data "$data" --bundle "$work/bundle" --device "$device" \
    --concurrency $conc --per-call $percall --seconds "$secs" --modes on off --eager "$size" --eager-dtype fp32 \
    --sweep --server-args "$server_args" --json "$out/serve-fp32.json"
fi

# ---------------------------------------------------------------------------------------------------- workers
if wanted workers; then
  if ! command -v h2load >/dev/null; then
    skip workers "h2load not found (Debian: nghttp2-client; or .gpu-serve/h2load from make gpu-serve-offline)"
  else
    pin=()
    if [ "$cores" -ge 4 ]; then
      pin=(--server-cpus "0-$((cores - 3))" --client-cpus "$((cores - 2))-$((cores - 1))" --client-threads 2)
    fi
    # shellcheck disable=SC2086
    step workers 120 "$py" bench/workers_bench.py --data "$data" --bundle "$work/bundle" --workers $workers --floor \
      --seconds "$wsecs" --connections 64 "${pin[@]}" --json "$out/workers.json"
  fi
fi

if wanted serve; then
  if [ "$device" = cuda ] && [ -d "$work/bundle-fp16" ]; then
    # shellcheck disable=SC2086
    step serve-fp16 100 "$py" bench/serve_bench.py --data "$data" --bundle "$work/bundle-fp16" --device cuda \
      --concurrency $conc --per-call $percall --seconds "$secs" --modes on --eager "$size" --eager-dtype fp16 \
      --sweep --server-args "$server_args" --json "$out/serve-fp16.json"
  else
    skip serve-fp16 "no fp16 bundle (CUDA only)"
  fi
fi

# -------------------------------------------------------------------------------------------------- iobinding
if wanted iobinding; then
  if [ "$device" = cuda ]; then
    step iobinding 45 "$py" bench/ort_batch_efficiency.py --bundle "$work/bundle" --device cuda --io-binding \
      --cuda-graph --lengths 128 512 --batches 1 8 64 --min-seconds 0.3 --peak-n 4096 --json "$out/iobinding.json"
  else
    skip iobinding "IO binding copies between the host and a GPU"
  fi
fi

# -------------------------------------------------------------------------------------------------------- rss
if wanted rss; then
  # shellcheck disable=SC2086  # the server's flags, one word each
  step rss 45 "$py" deploy/measure_rss.py --seconds "$rss_secs" "$work/bundle" -- --device "$device" $server_args
fi

# ---------------------------------------------------------------------------------------------------- summary
if wanted summary; then
  step summary 20 "$py" bench/gpu_serve_summary.py "$out"
  cat "$out/summary.txt" 2>/dev/null
fi
echo "gpu_serve_check: $((SECONDS))s; logs in $out"
column -t -s $'\t' "$out/steps.tsv" 2>/dev/null || cat "$out/steps.tsv"

# --pack: the files this script wrote (each step's log, the JSON results, steps.tsv, device.txt) into one archive,
# summary.md beside it; nothing else in $out is touched.
if [ "$pack" = 1 ]; then
  written=(steps.tsv device.txt)
  for name in $(awk -F'\t' 'NR > 1 {print $1}' "$out/steps.tsv") serve-fp32 serve-fp16 iobinding workers; do
    for f in "$name.txt" "$name.json"; do [ -f "$out/$f" ] && written+=("$f"); done
  done
  tar -czf "$work/logs.tar.gz" -C "$out" "${written[@]}" && mv "$work/logs.tar.gz" "$out/logs.tar.gz" \
    && (cd "$out" && rm -f "${written[@]}") && echo "gpu_serve_check: packed ${#written[@]} files into $out/logs.tar.gz"
fi
