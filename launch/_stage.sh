#!/usr/bin/env bash
# The bash half of launch/pretrain.sh and launch/finetune.sh (`bash launch/pretrain.sh ...`, `deepspeed --no_python
# launch/pretrain.sh ...`): one rank of `python -m trainer STAGE ...`, STAGE the first argument they pass. Environment
# defaults (the DeepSpeed JIT cache, the repo on PYTHONPATH, the venv's python), then one line. The Python half, for
# DeepSpeed's launcher (`python -u launch/pretrain.sh --local_rank=N ...`), is launch/_stage.py.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$here/.cache/torch_extensions}"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-$here/.venv/bin/python}"; [ -x "$py" ] || py=python3
exec "$py" -u -m trainer "$@"
