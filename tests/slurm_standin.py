#!/usr/bin/env python3
"""`srun` and `scontrol` for running launch/train.sbatch on a machine without Slurm (tests/test_clusters.py).

Linked under those two names into a folder put first on PATH, it does what a one-node job's step does that the
batch script relies on:

- `srun [OPTIONS] CMD ARGS...`: SLURM_NTASKS copies of CMD, task i with the variables srun gives a task
  (SLURM_PROCID=i, SLURM_LOCALID=i, SLURM_NODEID=0, the step's SLURM_STEP_*), the job's other SLURM_* inherited.
  SIGTERM and SIGINT to srun are forwarded to every task; with --kill-on-bad-exit=1 a task that exits non-zero
  ends the others (SIGTERM, then SIGKILL after KillWait, 30 s). Exits with the highest exit code of its tasks.
- `scontrol requeue JOBID`: appends "requeue JOBID" to $SLURM_STANDIN_LOG. `scontrol show hostnames LIST`: the
  single host of a one-node list.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

KILL_WAIT_S = 30.0  # slurm.conf's KillWait default


def srun(argv: list[str]) -> int:
    kill_on_bad_exit = False
    while argv and argv[0].startswith("-"):  # srun's own options (every one this project uses has `=`)
        kill_on_bad_exit |= argv[0] in ("--kill-on-bad-exit=1", "-K1", "--kill-on-bad-exit")
        argv = argv[1:]
    n = int(os.environ["SLURM_NTASKS"])
    step = {"SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NUM_TASKS": str(n), "SLURM_STEP_NUM_NODES": "1",
            "SLURM_STEP_NODELIST": os.environ["SLURM_JOB_NODELIST"], "SLURM_STEP_TASKS_PER_NODE": str(n),
            "SLURM_GTIDS": ",".join(map(str, range(n)))}
    tasks = [subprocess.Popen(argv, env={**os.environ, **step, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i),
                                         "SLURM_NODEID": "0"}) for i in range(n)]

    def forward(signum: int, frame: object) -> None:
        for t in tasks:
            if t.poll() is None:
                t.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    ended_at = None
    while any(t.poll() is None for t in tasks):
        if kill_on_bad_exit and ended_at is None and any(t.poll() not in (None, 0) for t in tasks):
            ended_at = time.monotonic()
            forward(signal.SIGTERM, None)
        if ended_at is not None and time.monotonic() - ended_at > KILL_WAIT_S:
            forward(signal.SIGKILL, None)
        time.sleep(0.05)
    return max(t.returncode if t.returncode >= 0 else 128 - t.returncode for t in tasks)


def scontrol(argv: list[str]) -> int:
    if argv[:1] == ["requeue"]:
        with open(os.environ["SLURM_STANDIN_LOG"], "a", encoding="utf-8") as log:
            log.write(f"requeue {argv[1]}\n")
        return 0
    if argv[:2] == ["show", "hostnames"]:
        print(argv[2])
        return 0
    print(f"scontrol stand-in: {' '.join(argv)} is not supported", file=sys.stderr)
    return 1


if __name__ == "__main__":
    name = Path(sys.argv[0]).name
    sys.exit(srun(sys.argv[1:]) if name == "srun" else scontrol(sys.argv[1:]))
