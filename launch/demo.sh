#!/usr/bin/env bash
# `make demo`: the whole pipeline on the default data, on this machine, end to end:
#   data (fetched when missing) -> tokenizer + pretrain (DeepSpeed launcher) -> fine-tune pretrained vs scratch -> ONNX export (validated)
#   -> bundle check on the test split -> gRPC server -> client sends real test reviews -> clean stop.
# PRESET (default demo) and RUN (default runs/demo-<time>, never an existing folder) can be set.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
PRESET="${PRESET:-demo}"
RUN="${RUN:-runs/$PRESET-$(date +%Y%m%d-%H%M%S)}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"
[ -e "$RUN" ] && { echo "error: $RUN exists; set RUN to a new folder" >&2; exit 2; }
step() { printf '\n=== %s  [%s]\n' "$1" "$(date +%T)"; }
# A free port for each launcher's rendezvous and for the server: DeepSpeed's default (29500) is taken while another
# run trains on this machine.
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# The data sets the preset reads: $TS_DATA, else the user's cache; fetched from their public sources when missing.
DATA="$("$PY" -c 'from trainer.config.presets import data_sets; print(data_sets())')"
step "0/5 data for the $PRESET preset -> $DATA"
"$PY" -m trainer data fetch --preset "$PRESET"

step "1/5 pretrain ($PRESET) -> $RUN/pretrain"
"$ROOT/.venv/bin/deepspeed" --master_port "$(free_port)" launch/pretrain.sh --preset "$PRESET" \
  --out "$RUN/pretrain" "$@"

step "2/5 fine-tune: pretrained vs from scratch -> $RUN/finetune"
"$ROOT/.venv/bin/deepspeed" --master_port "$(free_port)" launch/finetune.sh --preset "$PRESET" \
  --pretrained "$RUN/pretrain/artifact" --compare --out "$RUN/finetune" "$@"
cat "$RUN/finetune/compare.md"

step "3/5 export the pretrained classifier to ONNX -> $RUN/bundle"
"$PY" -m trainer export "$RUN/finetune/artifact" --out "$RUN/bundle"
"$PY" -m trainer export --check "$RUN/bundle" --data "$DATA/cls-books-fr/test.review.spm" \
  --artifact "$RUN/finetune/artifact"

step "4/5 serve the bundle over gRPC on 127.0.0.1"
PORT="$(free_port)"
launch/serve.sh "$RUN/bundle" --port "$PORT" --no-metrics > "$RUN/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true' EXIT
"$PY" -m serving.client --target "127.0.0.1:$PORT" --timeout 60 --retries 30 --metadata

step "5/5 classify real reviews from the test split through the client"
paste -d'\t' <(head -n 8 "$DATA/cls-books-fr/test.label") <(head -n 8 "$DATA/cls-books-fr/test.review.txt" | cut -c1-110)
head -n 8 "$DATA/cls-books-fr/test.review.txt" | "$PY" -m serving.client --target "127.0.0.1:$PORT" --file -
kill -TERM "$SERVER"
wait "$SERVER" && echo "server stopped cleanly (exit 0); log: $RUN/server.log"
trap - EXIT
echo "run folder: $RUN"
