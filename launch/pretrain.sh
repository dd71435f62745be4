#!/usr/bin/env bash
""":"
# One rank of `python -m trainer pretrain`. A bash script and a Python program at once: bash runs launch/_stage.sh at
# `exec` (the rest is a heredoc it never reaches); Python (DeepSpeed's launcher runs `python -u launch/pretrain.sh
# --local_rank=N ...` once per rank) sees these lines as a string, then runs launch/_stage.py.
# Ranks: `deepspeed --num_gpus N [--bind_cores_to_rank] launch/pretrain.sh ...` (launch/README.md).
exec bash "$(dirname "${BASH_SOURCE[0]}")/_stage.sh" pretrain "$@"
: <<'#END'
":"""
from _stage import run  # noqa: E402  (sys.path[0] is launch/)
if __name__ == "__main__":  # not when a worker process re-imports this file (multiprocessing)
    run("pretrain")
#END
