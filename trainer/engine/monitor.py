"""What a training run leaves in its folder besides checkpoints, and what it shows a person while it runs.

Only rank 0 writes (every function here is a no-op elsewhere): `config.json`, `env.json` (versions, world size,
hostname, command line, git commit, data digests), `metrics.csv` (one row per log interval), and the same rows to the
trackers of DeepSpeed's monitor (trainer/engine/trackers.py: TensorBoard under `tb/` by default). Progress:
a tqdm bar with its ETA when stderr is a terminal; otherwise (a log file, a cluster job) one plain line per logged
row, with the share done, the time spent and an estimate of the time left. The interval, unless engine.log_every
sets it, gives about 50 rows a run (`log_interval`).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainer.artifact import write_text_atomic
from trainer.config import schema as config_mod
from trainer.config.schema import ConfigError, RunConfig
from trainer.engine import deepspeed_engine as eng
from trainer.engine import trackers


def check_resume_config(run_dir: Path, cfg: RunConfig) -> None:
    """A resumed run must use the config it started with: any differing key is an error that names it."""
    saved = config_mod.flatten(config_mod.load(run_dir / "config.json").to_dict())
    now = config_mod.flatten(cfg.to_dict())
    # The trackers (monitor.*) may change: where a run's numbers go is not how it trains.
    diff = [k for k in now if now.get(k) != saved.get(k) and not k.startswith("monitor.")]
    if diff:
        shown = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diff[:8])
        raise ConfigError(f"{run_dir / 'config.json'}: --resume with a different config ({shown}); "
                          "pass the same --preset/--config/--set as the first run")


def write_run_info(run_dir: Path, cfg: RunConfig, ds: dict[str, Any] | None, extra: dict[str, Any]) -> None:
    if not eng.is_main():
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.json", cfg.to_json())
    if ds is not None:
        write_text_atomic(run_dir / "deepspeed_config.json", json.dumps(ds, indent=2) + "\n")
    env = {
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "world_size": eng.world_size(),
        "backend": eng.dist_info().backend,
        "device": str(eng.dist_info().device),
        "threads_per_rank": torch.get_num_threads(),
        "argv": sys.argv,
        "versions": eng.package_versions(),
        **extra,
    }
    write_text_atomic(run_dir / "env.json", json.dumps(env, indent=2) + "\n")


ROWS_PER_RUN = 50  # log rows a run gets when engine.log_every is 0


def log_interval(configured: int, total: int) -> int:
    """Steps between log rows: `configured` (engine.log_every) when set, else a round number (1, 2 or 5 x 10^k) that
    gives about ROWS_PER_RUN rows: 1,500 steps -> every 50, 120 -> every 2. A short run logs every step."""
    if configured > 0:
        return configured
    target = max(1.0, total / ROWS_PER_RUN)
    scale = 10 ** math.floor(math.log10(target))
    return int(min((m * scale for m in (1, 2, 5, 10)), key=lambda v: abs(math.log(v / target))))


def clock(seconds: float) -> str:
    """1:02:03, 4:05: what a person reads."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def note(text: str) -> None:
    """A line on stderr from rank 0."""
    if eng.is_main():
        print(text, file=sys.stderr)


class RunLog:
    """metrics.csv + the trackers of `engine`'s monitor + a tqdm bar, on rank 0. `log(step, **values)` appends one
    row."""

    def __init__(self, run_dir: Path, total: int, initial: int, desc: str, columns: list[str],
                 engine: Any = None) -> None:
        self.main = eng.is_main()
        self.columns = ["step", *columns]
        self.engine = engine
        self.bar = None
        if not self.main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.csv"
        rows: list[list[str]] = []
        if self.path.exists() and initial > 0:  # a resume: drop the rows logged after the checkpoint
            with open(self.path, newline="", encoding="utf-8") as f:
                rows = [r for r in list(csv.reader(f))[1:] if r and r[0].isdigit() and int(r[0]) <= initial]
        buf = io.StringIO()
        csv.writer(buf).writerows([self.columns, *rows])
        write_text_atomic(self.path, buf.getvalue())
        self._bar_args = {"total": total, "initial": initial, "desc": desc}
        # A bar redraws with \r many times a second: in a log file (cluster jobs, `make demo > log`) that is one
        # endless line, so without a terminal each logged row is printed as a plain line instead.
        self.tty = sys.stderr.isatty()
        self.started, self.initial = time.monotonic(), initial  # this process's start: the ETA's rate

    def advance(self, n: int = 1) -> None:
        if not self.main or not self.tty:
            return
        if self.bar is None:  # created on the first step, so the lines printed before it stay above it
            from tqdm import tqdm

            self.bar = tqdm(**self._bar_args, unit="step", dynamic_ncols=True, file=sys.stderr)
        self.bar.update(n)

    def log(self, step: int, **values: float | int | str | None) -> None:
        if not self.main:
            return
        row = [step, *(values.get(c) for c in self.columns[1:])]
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            csv.writer(f).writerow(["" if v is None else (f"{v:.6g}" if isinstance(v, float) else v) for v in row])
        trackers.write(self.engine, values)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in values.items() if v is not None}
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
        elif not self.tty:
            sys.stderr.write(f"{self.progress(step)} " + " ".join(f"{k}={v}" for k, v in shown.items()) + "\n")
            sys.stderr.flush()

    def progress(self, step: int) -> str:
        """"finetune scratch: step 300/1,500 (20%, 0:12, about 0:48 left)": the ETA from this process's mean step
        time (evaluations and checkpoints included, as they will be in the rest)."""
        total, spent = self._bar_args["total"], time.monotonic() - self.started
        done = step - self.initial
        left = f", about {clock(spent / done * (total - step))} left" if done > 0 and step < total else ""
        return (f"{self._bar_args['desc']}: step {step:,}/{total:,} ({100 * step / max(1, total):.0f}%, "
                f"{clock(spent)}{left})")

    def print(self, text: str) -> None:
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            # One write, newline included: under the launcher (python -u) print's two writes let another process's
            # output land between a line and its newline.
            sys.stderr.write(text + "\n")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.main:
            trackers.close(self.engine)
