#!/usr/bin/env bash
""":"
# One rank of `python -m trainer finetune`. `deepspeed launch/finetune.sh ...` runs this file with Python
# (`python -u launch/finetune.sh --local_rank=N ...`, once per rank), while `bash launch/finetune.sh ...` and
# `deepspeed --no_python launch/finetune.sh ...` run it with bash: so it is both. Bash runs the lines down to `exec`
# (the rest is a heredoc it never reaches); Python sees them as a string and runs the code after it.
# Ranks: `deepspeed --num_gpus N [--bind_cores_to_rank] launch/finetune.sh ...` (launch/README.md).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$here/.cache/torch_extensions}"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-$here/.venv/bin/python}"; [ -x "$py" ] || py=python3
exec "$py" -u -m trainer finetune "$@"
: <<'#END'
":"""
import os, sys  # noqa: E401,E402  (sys.path[0] is launch/: the package lives one folder up)
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(root, ".cache", "torch_extensions"))
sys.path.insert(0, root)
from trainer.__main__ import main  # noqa: E402
if __name__ == "__main__":  # not when a worker process re-imports this file (multiprocessing)
    sys.exit(main(["finetune", *sys.argv[1:]]))
#END
