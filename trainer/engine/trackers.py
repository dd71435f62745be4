"""The trackers a training run writes to besides metrics.csv, all through DeepSpeed's own monitor: its TensorBoard,
CSV and Weights & Biases writers, turned on by sections of the DeepSpeed JSON that `sections` derives from the config's
`monitor` section (a user's JSON may change them, or add DeepSpeed's `comet` section). DeepSpeed writes its own
series there (the learning rate at every step, `Train/Samples/lr`); the loop's rows go through the same monitor
(`write`), on the same x axis: samples seen (`engine.global_samples`), as DeepSpeed's own series are, since W&B
keeps one step counter per run and drops values logged at a smaller step.

Once at the start, `log_run` gives the trackers the run's config, the sha256 of its data and the git commit of the
code (TensorBoard: a text summary `run`; W&B: the run's config); env.json in the run folder holds the same.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.artifact import sha256_file
from trainer.config.schema import ConfigError, MonitorConfig

SERIES = "Train/Samples/"  # DeepSpeed's prefix for a series against samples seen


def sections(m: MonitorConfig, run_dir: Path | None) -> dict[str, Any]:
    """DeepSpeed's monitor sections for a run writing into `run_dir` (None: no trackers, e.g. a benchmark's
    engine): RUN/tb/ for TensorBoard, RUN/csv/ for the CSV files, W&B's project, team and group."""
    if run_dir is None:
        return {}
    return {
        "tensorboard": {"enabled": m.tensorboard, "output_path": str(run_dir), "job_name": "tb"},
        "csv_monitor": {"enabled": m.csv, "output_path": str(run_dir), "job_name": "csv"},
        "wandb": {"enabled": m.wandb, "project": m.wandb_project, "team": m.wandb_team or None,
                  "group": m.wandb_group or None},
    }


def with_monitor(ds: Mapping[str, Any], m: MonitorConfig, run_dir: Path) -> dict[str, Any]:
    """`ds` with the monitor sections for `run_dir`, a key the JSON already has (a user's) winning over ours."""
    ours = sections(m, run_dir)
    return {**ds, **{k: {**v, **(ds.get(k) or {})} for k, v in ours.items()}}


def prepare(ds: Mapping[str, Any], run_dir: Path) -> None:
    """Before the engine starts its monitor: a tracker it will need must be installed (one line naming the extra,
    not DeepSpeed's traceback), and W&B writes under the run folder (DeepSpeed's wandb.init names no folder; a
    WANDB_DIR already set wins)."""
    wandb = ds.get("wandb") or {}
    if wandb.get("enabled"):
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("monitor.wandb=true needs the wandb package: pip install 'transfer-sentiment[trackers]'")
        os.environ.setdefault("WANDB_DIR", str(run_dir))
        os.environ.setdefault("WANDB_NAME", run_dir.name)


def write(engine: Any, values: Mapping[str, Any]) -> None:
    """One log row's numbers to every enabled tracker, at the engine's samples seen (rank 0 writes; a no-op
    elsewhere and without trackers). The learning rate is left out: DeepSpeed writes it at every step."""
    monitor = getattr(engine, "monitor", None)
    if monitor is None or not monitor.enabled:
        return
    x = int(engine.global_samples)
    events = [(SERIES + k, float(v), x) for k, v in values.items()
              if k != "lr" and isinstance(v, (int, float)) and not isinstance(v, bool)]
    if events:
        monitor.write_events(events)


def log_run(engine: Any, facts: Mapping[str, Any]) -> None:
    """The run's config, data digests and commit, once, to the trackers that hold such things."""
    monitor = getattr(engine, "monitor", None)
    if monitor is None or not monitor.enabled:
        return
    text = json.dumps(facts, indent=2, default=str)
    tb = getattr(monitor, "tb_monitor", None)
    if tb is not None and tb.summary_writer is not None:
        tb.summary_writer.add_text("run", f"```\n{text}\n```", 0)  # markdown: kept as written
        tb.summary_writer.flush()
    if getattr(monitor, "wandb_monitor", None) is not None:
        import wandb

        if wandb.run is not None:
            wandb.run.config.update(json.loads(text), allow_val_change=True)


CODE = Path(__file__).resolve().parents[2]  # the checkout trainer/ is in


def run_facts(data_files: list[Path]) -> dict[str, Any]:
    """What `log_run` and env.json record of a run besides its config: the code's git commit and the sha256 of
    each data file it reads (a prepared folder: its manifest, which holds every shard's)."""
    return {"git_commit": git_commit(), "data_sha256": {str(p): sha256_file(p) for p in data_files}}


def close(engine: Any) -> None:
    """Flush and close the trackers at the end of a stage: a rank ends with os._exit (trainer/engine), so nothing
    would run at exit (W&B's run would stay unfinished)."""
    monitor = getattr(engine, "monitor", None)
    if monitor is None or not monitor.enabled:
        return
    tb = getattr(monitor, "tb_monitor", None)
    if tb is not None and tb.summary_writer is not None:
        tb.summary_writer.close()
    if getattr(monitor, "wandb_monitor", None) is not None:
        import wandb

        wandb.finish()


def git_commit(where: Path = CODE) -> str | None:
    """`git describe --always --dirty --abbrev=40` of the code's checkout (None outside one, or without git): which
    code trained, and whether it was changed from that commit."""
    try:
        done = subprocess.run(["git", "-C", str(where), "describe", "--always", "--dirty", "--abbrev=40"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None
