"""Training runs write to the trackers of DeepSpeed's own monitor, turned on by the config's monitor section: a tiny
real run, then the files it wrote are read back: DeepSpeed's CSV files, TensorBoard's events, W&B's offline run
folder (WANDB_MODE=offline: no network); and the run's config, data digests and commit, logged once at the start."""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest
from procs import REPO, env
from procs import run as run_process
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.config.schema import ConfigError
from trainer.engine import trackers
from trainer.engine.trackers import git_commit

pytest.importorskip("wandb", reason="the `trackers` extra (make setup installs it)")

TINY = ["--preset", "tiny", "--set", "pretrain.max_steps=5", "--set", "engine.log_every=2"]


def trainer(args: list[str], extra_env: dict[str, str]) -> str:
    p = run_process([sys.executable, "-m", "trainer", *args], 600, cwd=REPO, env={**env(), **extra_env})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    return out


def _wandb_records(path: Path) -> list:
    """The records of a W&B run's transaction log (run-ID.wandb): a 7-byte header (":W&B", magic, version), then
    LevelDB's log format (32 KiB blocks of records: crc32c, length, type FULL/FIRST/MIDDLE/LAST), each record a
    wandb_internal.proto Record. wandb 0.31 writes the log from its Go core and ships no Python reader of it."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, i, out, pending = path.read_bytes(), 32768, 7, [], b""
    assert data[:4] == b":W&B"
    while i + 7 <= len(data):
        if block - i % block < 7:  # a block's tail too short for a header is zero padding
            i += block - i % block
            continue
        _, length, kind = struct.unpack_from("<IHB", data, i)
        chunk, i = data[i + 7:i + 7 + length], i + 7 + length
        if kind in (1, 2):  # FULL, FIRST
            pending = chunk
        elif kind in (3, 4):  # MIDDLE, LAST
            pending += chunk
        if kind in (1, 4):
            out.append(Record.FromString(pending))
    return out


def _csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_pretraining_writes_csv_tensorboard_and_wandb_offline(tiny_tokenizer_dir: Path, data_dir: Path,
                                                                tmp_path: Path) -> None:
    out = tmp_path / "run"
    wandb_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    trainer(["pretrain", *TINY, "--tokenizer", str(tiny_tokenizer_dir), "--set", f"data.root={data_dir}",
             "--set", "monitor.csv=true", "--set", "monitor.wandb=true", "--set", "monitor.wandb_group=tests",
             "--out", str(out)], wandb_env)
    global_batch = json.loads((out / "env.json").read_text())["global_batch"]
    rows = _csv(out / "metrics.csv")
    logged = {int(r[0]): r for r in rows[1:]}  # step -> row: steps 2, 4 and the last
    loss_column = rows[0].index("loss")

    # DeepSpeed's CSV monitor: one file per series, the loop's rows and DeepSpeed's own lr, against samples seen.
    loss = _csv(out / "csv" / "Train_Samples_loss.csv")
    assert loss[0] == ["step", "loss"]
    assert [int(r[0]) for r in loss[1:]] == [s * global_batch for s in sorted(logged)]
    for (_, value), step in zip(loss[1:], sorted(logged), strict=True):
        assert float(value) == pytest.approx(float(logged[step][loss_column]), rel=1e-5)
    lr = _csv(out / "csv" / "Train_Samples_lr.csv")
    assert [int(r[0]) for r in lr[1:]] == [s * global_batch for s in range(1, 6)]  # DeepSpeed's: every step

    # TensorBoard, through the same monitor: the same series, and the run's facts as text.
    events = EventAccumulator(str(out / "tb")).Reload()
    assert {"Train/Samples/loss", "Train/Samples/lr", "Train/Samples/eval_loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("Train/Samples/loss")] == [s * global_batch for s in sorted(logged)]
    facts = json.loads(events.Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode().strip("`\n"))
    assert facts["config"]["monitor"]["wandb"] is True and facts["git_commit"] == git_commit()

    # W&B's offline run, under the run folder and finished: its log holds the loop's rows and the run's facts.
    (run,) = (out / "wandb").glob("offline-run-*")
    records = _wandb_records(next(run.glob("run-*.wandb")))
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "exit" in kinds  # finished (a rank ends with os._exit: nothing would finish it at exit)
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.HasField("history")]
    losses = [(h["_step"], h["Train/Samples/loss"]) for h in history if "Train/Samples/loss" in h]
    assert [x for x, _ in losses] == [s * global_batch for s in sorted(logged)]
    assert losses[-1][1] == pytest.approx(float(logged[max(logged)][loss_column]), rel=1e-5)
    config = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
              for r in records if r.HasField("config") for i in r.config.update}
    assert config["config"]["pretrain"]["max_steps"] == 5 and config["git_commit"] == git_commit()
    (manifest,) = config["data_sha256"]
    assert manifest.endswith("manifest.json")
    digest = hashlib.sha256(Path(manifest).read_bytes()).hexdigest()
    assert config["data_sha256"][manifest] == digest

    # env.json: the same facts in the run folder.
    info = json.loads((out / "env.json").read_text())
    assert info["git_commit"] == git_commit() and info["data_sha256"] == {manifest: digest}


def test_finetuning_writes_its_trackers_and_digests_its_files(
        tiny_classifier_artifact: Path, data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ft"
    files = ["--set", "data.train=cls-books-fr/train.review.txt", "--set", "data.max_train_examples=60",
             "--set", "data.valid=cls-books-fr/valid.review.txt", "--set", "data.max_valid_examples=20",
             "--set", "data.test=cls-books-fr/test.review.txt", "--set", "data.max_test_examples=20"]
    trainer(["finetune", "--preset", "tiny", "--set", f"data.root={data_dir}", *files, "--set",
             "finetune.epochs=1", "--set", "monitor.csv=true", "--set", "monitor.tensorboard=false",
             "--tokenizer", str(tiny_classifier_artifact / "tokenizer"), "--out", str(out)], {})
    series = {p.name for p in (out / "csv").glob("*.csv")}
    assert {"Train_Samples_loss.csv", "Train_Samples_valid_accuracy.csv", "Train_Samples_lr.csv"} <= series
    assert not (out / "tb").exists()  # turned off
    info = json.loads((out / "env.json").read_text())
    train = str(data_dir / "cls-books-fr" / "train.review.txt")
    assert info["data_sha256"][train] == hashlib.sha256(Path(train).read_bytes()).hexdigest()
    assert len(info["data_sha256"]) == 3


def test_wandb_asked_for_without_the_package_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the engine starts (DeepSpeed would fail in its monitor with a traceback)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^monitor.wandb=true needs the wandb package: pip install "
                                          r"'transfer-sentiment\[trackers\]'$"):
        trackers.prepare({"wandb": {"enabled": True}}, tmp_path)
    trackers.prepare({"wandb": {"enabled": False}}, tmp_path)  # not asked for: nothing needed


def test_a_users_deepspeed_json_wins_over_the_derived_trackers(tmp_path: Path) -> None:
    from trainer.config.schema import MonitorConfig

    ds = trackers.with_monitor({"tensorboard": {"job_name": "mine"}, "comet": {"enabled": True}},
                               MonitorConfig(csv=True), tmp_path)
    assert ds["tensorboard"] == {"enabled": True, "output_path": str(tmp_path), "job_name": "mine"}
    assert ds["csv_monitor"]["enabled"] is True and ds["comet"] == {"enabled": True}
    assert trackers.sections(MonitorConfig(), None) == {}  # no run folder (a benchmark's engine): no trackers
