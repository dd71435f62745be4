#!/usr/bin/env bash
# The GPU training checks in under 9 minutes, for a CUDA node or a GPU node without internet. Parts, each in its
# own time box, all within --budget seconds (a part that no longer fits is skipped, and says so); tests and lab run
# side by side on the GPU first (neither is timed, and neither fills the GPU), then the timed parts one at a time:
#   tests  the GPU tests, 3 at a time: bf16 ZeRO 1, 2 and 3 on NCCL, checkpoint, resume == uninterrupted, compiled
#          training against eager (pytest -m gpu -n 3), and the device decision (DS_ACCELERATOR=cpu on a GPU
#          machine: one line, exit 2)
#   ratio  our DeepSpeed engine (torch.autocast over fp32 weights) against the plain PyTorch loop, lab size, bf16, LM
#          and classifier; DeepSpeed's own bf16 mode beside them; two steps of each counted (--profile)
#   mfu    the gpu preset's LM (110 M parameters, windows of 1,024): MFU against the timed bf16 matmul peak, engine
#          and plain loop side by side, each eager and compiled (torch.compile on/off)
#   lab    the lab end to end: lab-preset pretraining for a fixed token budget (LAB_STEPS steps of 16 x 512 tokens),
#          then finetune --compare (pretrained vs from scratch) with the lab's fine-tuning recipe (15 epochs)
#   sdpa   which attention kernels the gpu preset's model reaches (head dimension 64: flash, memory-efficient, cuDNN)
# then a summary table. Everything else it prints goes to files under $OUT (default runs/gpu-check).
#
#   bash bench/gpu_check.sh                       # all parts
#   bash bench/gpu_check.sh --parts ratio,mfu     # some parts (a rerun on the same machine)
#   bash bench/gpu_check.sh --box lab=400         # a part's time box in seconds (repeatable)
#   bash bench/gpu_check.sh --dry-run             # the plan: parts, time boxes, commands; runs nothing (any machine)
#   bash bench/gpu_check.sh --smoke               # every part's plumbing on a CPU at tiny sizes (minutes)
#
# A GPU node without internet, with python3, a CUDA torch, numpy, sentencepiece and onnx: `make gpu-offline`, on a
# machine with a network, writes .whl/ (the packages such a node lacks: deepspeed, pydantic, grpcio...) and .data/
# (cls-books-fr, the lab's corpus prepared with the lab tokenizer, the gpu preset's tokenizer); copied to the node
# with this checkout, this script installs and uses them.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

parts_all="tests,ratio,mfu,lab,sdpa"
parts=$parts_all budget=525 dry=0 smoke=0 box_set=()
while [ $# -gt 0 ]; do
  case $1 in
    --parts) [ $# -ge 2 ] || { echo "error: --parts needs a list (of $parts_all)" >&2; exit 2; }; parts=$2; shift ;;
    --parts=*) parts=${1#*=} ;;
    --budget) [ $# -ge 2 ] || { echo "error: --budget needs seconds" >&2; exit 2; }; budget=$2; shift ;;
    --budget=*) budget=${1#*=} ;;
    --box) [ $# -ge 2 ] || { echo "error: --box needs PART=SECONDS" >&2; exit 2; }; box_set+=("$2"); shift ;;
    --box=*) box_set+=("${1#*=}") ;;
    --dry-run) dry=1 ;;
    --smoke) smoke=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ $budget =~ ^[0-9]+$ ]] && [ "$budget" -ge 60 ] && [ "$budget" -le 3600 ] \
  || { echo "error: --budget must be whole seconds from 60 to 3600, got '$budget'" >&2; exit 2; }
IFS=, read -r -a chosen <<<"$parts"
[ ${#chosen[@]} -gt 0 ] || { echo "error: --parts is empty (choose among $parts_all)" >&2; exit 2; }
for p in "${chosen[@]}"; do
  [[ ,$parts_all, == *,"$p",* ]] || { echo "error: unknown part '$p' in --parts (choose among $parts_all)" >&2; exit 2; }
done

out=${OUT:-runs/gpu-check}
py=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
start=$SECONDS

# What the machine is, first (nothing here needs our packages).
machine() {
  echo "gpu_check $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname): $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo \
    | cut -d: -f2- | sed 's/^ *//'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | sed 's/^/gpu /'
  else
    echo "gpu none (no nvidia-smi)"
  fi
  $py -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda",
          torch.version.cuda, "| gpus", torch.cuda.device_count())' 2>&1 | tail -n 1
}

# The sizes of each part: the real ones, or (--smoke) tiny ones that run on a CPU in minutes.
if [ "$smoke" = 1 ]; then
  lab_steps=${LAB_STEPS:-3}
  ratio_args=(--preset tiny --micro-batch 13 --seq-len 40 --warmup 1 --windows 2 --steps 2)
  mfu_args=(--preset gpu --micro-batch 2 --seq-len 32 --warmup 1 --windows 2 --steps 2 --loops "plain,deepspeed"
            --set model.d_model=64 --set model.n_heads=8 --set model.n_layers=2 --set model.d_ff=96
            --set model.max_positions=64 --set model.vocab_size=260 --set tokenizer.vocab_size=256)
  lab_set=(--preset tiny --set finetune.epochs=1)
  boxes=(tests=900 lab=900 ratio=600 mfu=600 sdpa=60)
else
  lab_steps=${LAB_STEPS:-1200}  # 9.8 M tokens: about 3/4 of a pass over the lab corpus's 12.67 M ids
  ratio_args=(--preset lab --micro-batch 8 --seq-len 128)
  mfu_args=(--preset gpu --micro-batch 32 --seq-len 1024 --warmup 2 --windows 4 --steps 3 --profile
            --loops "plain,deepspeed,plain-compiled,deepspeed-compiled")
  lab_set=(--preset lab --set engine.precision=bf16)
  # Seen on one H200 (2026-11-27, docs/BENCHMARKS.md "GPU"): setup ~20 s, tests 281 s and the lab 316 s side by
  # side (both wait ~50 s for FusedAdam's build first), ratio 31 s, mfu 91 s, sdpa 16 s.
  boxes=(tests=290 lab=330 ratio=40 mfu=100 sdpa=25)
fi
for kv in "${box_set[@]}"; do
  [[ $kv =~ ^([a-z]+)=([0-9]+)$ ]] && [[ ,$parts_all, == *,"${BASH_REMATCH[1]}",* ]] \
    || { echo "error: --box takes PART=SECONDS with PART among $parts_all, got '$kv'" >&2; exit 2; }
  boxes+=("$kv")  # later entries win: box() prints the last match
done
box() { local kv b=; for kv in "${boxes[@]}"; do [ "${kv%%=*}" = "$1" ] && b=${kv#*=}; done; echo "$b"; }
stages=("tests lab" ratio mfu sdpa)  # run in this order; the parts of a stage side by side
stage_parts() { local p; for p in $1; do [[ ,$parts, == *,"$p",* ]] && echo "$p"; done; }
stage_box() { local p b=0; for p in "$@"; do [ "$(box "$p")" -gt "$b" ] && b=$(box "$p"); done; echo "$b"; }
ds=("$py" -m deepspeed.launcher.runner)  # the `deepspeed` command, without relying on its script being on PATH
gpus=1
lab_data=.data/lab-prepared
gpu_tok=.data/gpu-tokenizer

plan() {  # part -> the commands it runs (printed by --dry-run, run by run_part)
  case $1 in
    tests) echo "$py -m pytest -v -n 3 --durations=5 -p no:cacheprovider -m gpu tests/test_training.py tests/test_export.py" \
                "tests/test_bundle_format.py tests/test_serving_predictor.py"
           echo "$py -m pytest -q -p no:cacheprovider" \
                "'tests/test_engine.py::test_a_ds_accelerator_naming_another_device_stops_with_one_line'" ;;
    ratio) echo "$py bench/train_throughput.py --task both ${ratio_args[*]} --loops plain,deepspeed,deepspeed-bf16" \
                "--profile --json $out/ratio.json" ;;
    mfu) echo "$py bench/train_throughput.py --task lm ${mfu_args[*]} --tokenizer $gpu_tok --json $out/mfu.json" ;;
    lab) echo "${ds[*]} --num_gpus $gpus launch/pretrain.sh ${lab_set[*]} --set data.prepared=$lab_data" \
              "--set pretrain.max_steps=$lab_steps --set engine.compile=off --out $out/lab/pretrain"
         echo "${ds[*]} --num_gpus $gpus launch/finetune.sh ${lab_set[*]} --set engine.compile=off" \
              "--pretrained $out/lab/pretrain/artifact --compare --out $out/lab/finetune" ;;
    sdpa) echo "$py bench/sdpa_check.py --preset gpu --json $out/sdpa.json" ;;
  esac
}

if [ "$dry" = 1 ]; then
  machine
  echo "plan: parts ${chosen[*]} within $budget s; logs and JSON under $out"
  total=0
  for st in "${stages[@]}"; do
    mapfile -t ps < <(stage_parts "$st")
    [ ${#ps[@]} -gt 0 ] || continue
    total=$((total + $(stage_box "${ps[@]}")))
    [ ${#ps[@]} -gt 1 ] && echo "side by side: ${ps[*]}"
    for p in "${ps[@]}"; do echo "part $p (time box $(box "$p") s):"; plan "$p" | sed 's/^/  /'; done
  done
  echo "the stages' time boxes add up to $total s (budget $budget s: a part that no longer fits is skipped)"
  for f in .whl .data/cls-books-fr "$lab_data" "$gpu_tok"; do
    [ -e "$f" ] && echo "found $f" || echo "missing $f (make gpu-offline)"
  done
  exit 0
fi

mkdir -p "$out"
machine | tee "$out/machine.txt"
if [ "$smoke" = 0 ] && ! $py -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "error: no usable CUDA GPU here: run with --dry-run (the plan) or --smoke (a CPU run at tiny sizes)" >&2
  exit 2
fi

# Setup: the prepared wheels (where DeepSpeed is missing) and data, the environment every part shares.
if compgen -G ".whl/*.whl" >/dev/null && ! $py -c 'import deepspeed, pydantic, grpc' >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ts-site .whl/*.whl \
    >"$out/setup.txt" 2>&1 || echo "wheel install failed: $out/setup.txt"
  export PYTHONPATH=/tmp/ts-site PATH="/tmp/ts-site/bin:$PATH"
  # The tests launch `deepspeed` from beside the interpreter; wheels installed with --target put it in /tmp/ts-site/bin.
  bindir=$($py -c 'import sys, os; print(os.path.dirname(sys.executable))')
  [ -x /tmp/ts-site/bin/deepspeed ] && [ ! -e "$bindir/deepspeed" ] && ln -s /tmp/ts-site/bin/deepspeed "$bindir/deepspeed"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TS_TRACEBACK=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
[ -d .data/cls-books-fr ] && export TS_DATA=${TS_DATA:-$PWD/.data}
data=${TS_DATA:-$($py -c 'from trainer.config.presets import data_sets; print(data_sets())')}  # data fetch's folder
if [ "$smoke" = 0 ]; then
  gpus=$($py -c 'import torch; print(torch.cuda.device_count())')
  # DeepSpeed 0.19.8 JIT-builds FusedAdam for TORCH_CUDA_ARCH_LIST and cannot parse an arch such as "9.0a", which
  # an image's environment may set: name the GPU's own arch, plain.
  TORCH_CUDA_ARCH_LIST=$($py -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
  export TORCH_CUDA_ARCH_LIST
  # FusedAdam's JIT build (about a minute, once per machine) starts now, beside the first part's imports.
  $py -c 'from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()' \
    >"$out/fused_adam_build.txt" 2>&1 &
  fused_adam=$!
else
  lab_data=$out/smoke-prepared gpu_tok=$out/smoke-gpu-tokenizer
  $py -m trainer prepare --preset tiny --set "data.root=$data" --out "$lab_data" >"$out/smoke-setup.txt" 2>&1
  $py -m trainer tokenizer --preset gpu --set "data.root=$data" --set tokenizer.vocab_size=256 \
    --set model.vocab_size=260 --set tokenizer.train_lines=3000 --set data.pretrain=cls-books-fr/train.review.txt \
    --out "$gpu_tok" >>"$out/smoke-setup.txt" 2>&1
fi
[ -d "$lab_data" ] || echo "note: $lab_data not found: the lab part prepares the corpus itself (make gpu-offline)"
[ -d "$gpu_tok" ] || echo "note: $gpu_tok not found: the mfu part trains the gpu tokenizer itself (make gpu-offline)"
printf 'part\tstatus\tseconds\n' >"$out/parts.tsv"

# run_part NAME LEFT: the part's commands in its time box, cut to LEFT seconds; its status into parts.tsv.
run_part() {
  local name=$1 left=$2 b t0 rc=0 status
  b=$(box "$name")
  [ "$left" -lt "$b" ] && b=$left
  # Skipped when cut below its own box and below 30 s (a short box, such as sdpa's, still runs in full).
  if [ "$b" -lt "$(box "$name")" ] && [ "$b" -lt 30 ]; then
    printf '%s\tskipped (budget)\t0\n' "$name" >>"$out/parts.tsv"; echo "== $name: skipped, ${left}s left"; return
  fi
  echo "== $name (up to ${b}s) $(date -u +%T)"
  t0=$SECONDS
  timeout --kill-after=10 "$b" bash -c "$(declare -f "part_$name"); part_$name" >"$out/$name.txt" 2>&1 || rc=$?
  case $rc in 0) status=ok ;; 124|137) status="timeout (${b}s)" ;; *) status="failed (rc $rc)" ;; esac
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" >>"$out/parts.tsv"
  echo "   $status in $((SECONDS - t0))s; log $out/$name.txt"
}
fused_adam=${fused_adam:-0}
export py out data gpus lab_steps lab_data gpu_tok smoke fused_adam
export ratio_args_s="${ratio_args[*]}" mfu_args_s="${mfu_args[*]}" lab_set_s="${lab_set[*]}"

part_tests() {
  # Each test skips itself where what it needs is missing (onnxruntime-gpu on a bare image, a GPU on --smoke). The
  # device decision's test is not marked gpu (it runs on every machine): its own pytest call.
  local rc=0
  wait_fused_adam
  $py -m pytest -v -n 3 --durations=5 -p no:cacheprovider -m gpu tests/test_training.py tests/test_export.py tests/test_bundle_format.py \
    tests/test_serving_predictor.py || rc=$?
  $py -m pytest -q -p no:cacheprovider \
    'tests/test_engine.py::test_a_ds_accelerator_naming_another_device_stops_with_one_line' || rc=$?
  return "$rc"
}
part_ratio() {
  # shellcheck disable=SC2086  # word splitting of the exported argument list is intended
  # (deepspeed-bf16 runs in bf16 only: not on a CPU's fp32)
  $py bench/train_throughput.py --task both $ratio_args_s --set "data.root=$data" \
    --loops plain,deepspeed,deepspeed-bf16 --profile --json "$out/ratio.json"
}
part_mfu() {
  local tok=()
  [ -d "$gpu_tok" ] && tok=(--tokenizer "$gpu_tok")
  # shellcheck disable=SC2086
  $py bench/train_throughput.py --task lm $mfu_args_s --set "data.root=$data" "${tok[@]}" --json "$out/mfu.json"
}
part_lab() {
  local prepared=()
  wait_fused_adam
  [ -d "$lab_data" ] && prepared=(--set "data.prepared=$lab_data")
  rm -rf "$out/lab"  # a fresh run refuses a folder that holds one
  port() { $py -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
  # shellcheck disable=SC2086
  $py -m deepspeed.launcher.runner --num_gpus "$gpus" --master_port "$(port)" launch/pretrain.sh $lab_set_s \
    --set "data.root=$data" "${prepared[@]}" --set "pretrain.max_steps=$lab_steps" --set engine.compile=off \
    --set engine.log_every=100 --out "$out/lab/pretrain" || return
  # shellcheck disable=SC2086
  $py -m deepspeed.launcher.runner --num_gpus "$gpus" --master_port "$(port)" launch/finetune.sh $lab_set_s \
    --set "data.root=$data" --set engine.compile=off --pretrained "$out/lab/pretrain/artifact" --compare \
    --out "$out/lab/finetune"
}
part_sdpa() {
  [ "$smoke" = 1 ] && { echo "sdpa: needs a CUDA GPU (skipped on --smoke)"; return; }
  $py bench/sdpa_check.py --preset gpu --json "$out/sdpa.json"
}
wait_fused_adam() {  # the build started at setup: the GPU tests wait for it rather than build it again
  while [ "$fused_adam" != 0 ] && kill -0 "$fused_adam" 2>/dev/null; do sleep 1; done
}
export -f wait_fused_adam

for st in "${stages[@]}"; do
  mapfile -t ps < <(stage_parts "$st")
  left=$((budget - (SECONDS - start) - 15))  # 15 s kept for the summary
  pids=()
  for p in "${ps[@]}"; do run_part "$p" "$left" & pids+=($!); done
  [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
done
wait  # the FusedAdam build, if no part waited for it
$py bench/gpu_summary.py "$out" | tee "$out/summary.md"
echo "gpu_check: $((SECONDS - start)) s in all; logs in $out"
