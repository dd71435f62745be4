"""Ctrl-C and SIGTERM during training, with real signals and the real DeepSpeed launcher: every rank stops after the
same step, that step's checkpoint is written and named, the exit status is 130 (SIGINT) or 143 (SIGTERM), and
`--resume` alone (the run's own config.json) continues from it. Before, a signal exited with nothing printed and,
with checkpoint_every=0 (the tiny preset), nothing to resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import procs
import psutil
import pytest
from procs import BIN, REPO, env, free_port

LONG = ["--set", "pretrain.max_steps=100000", "--set", "engine.log_every=2"]  # runs until signalled


def started(out: Path, proc: subprocess.Popen[str], rows: int = 2, timeout: float = 300) -> None:
    """Wait until the run has logged `rows` rows (it is inside the training loop)."""
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.csv"
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) > rows:
            return
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no {rows} log rows in {metrics} after {timeout} s")


def finish(proc: subprocess.Popen[str], timeout: float = 180) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        procs.kill_group(proc)


def interrupted_at(output: str, signame: str, how: str) -> tuple[int, str]:
    """(step, checkpoint folder) of the run's `interrupted by SIGNAME after step N: checkpoint DIR; HOW` line.

    Found anywhere in a line: under the launcher, DeepSpeed's runner prints its own KeyboardInterrupt traceback in
    pieces at the same moment (`KeyboardInterrupt`, then the newline), so our line may follow one of its pieces."""
    found = re.findall(rf"interrupted by {signame} after step (\d+): checkpoint (\S+); {re.escape(how)}$", output,
                       re.MULTILINE)
    assert len(found) == 1, output[-6000:]
    return int(found[0][0]), found[0][1]


def checkpoint_named(output: str, out: Path, signame: str) -> str:
    """The tag the run said it saved: it is `latest`, complete, and every rank's files are in it."""
    from trainer.engine import checkpoint as ckpt

    step, folder = interrupted_at(output, signame, "continue with the same command and --out plus --resume")
    tag = ckpt.tag_for(step)
    assert folder == str(out / "checkpoints" / tag), folder
    assert ckpt.read_latest(out / "checkpoints") == tag and ckpt.find(out / "checkpoints") == tag
    return tag


def test_sigterm_without_a_launcher_exits_143_with_a_checkpoint(tmp_path: Path, tiny_tokenizer_dir: Path,
                                                                data_dir: Path) -> None:
    out = tmp_path / "run"
    args = ["pretrain", "--preset", "tiny", "--tokenizer", str(tiny_tokenizer_dir), "--set", f"data.root={data_dir}",
            *LONG, "--out", str(out)]
    proc = procs.popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    started(out, proc)
    proc.send_signal(signal.SIGTERM)
    output = finish(proc)
    assert proc.returncode == 143, output[-3000:]
    tag = checkpoint_named(output, out, "SIGTERM")
    assert not (out / "artifact").exists()
    # --resume alone: the run's own config (no preset, no --set), one more step then a clean stop.
    step = int(tag[4:])
    p = procs.run([sys.executable, "-m", "trainer", "pretrain", "--out", str(out), "--resume", "--stop-at",
                   str(step + 2)], 300, cwd=REPO, env=env())
    assert p.returncode == 0 and f"resumed at step {step}" in p.stderr, p.stderr[-3000:]


# One rank is slow (15 s): two ranks go through the same launcher and signal path, and more.
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_ctrl_c_under_the_deepspeed_launcher_checkpoints_every_rank(tmp_path: Path, tiny_tokenizer_dir: Path,
                                                                    data_dir: Path, ranks: int) -> None:
    """SIGINT to the whole process group, as a terminal's Ctrl-C: launcher, ranks, all of them."""
    out = tmp_path / "run"
    args = ["--preset", "tiny", "--tokenizer", str(tiny_tokenizer_dir), "--set", f"data.root={data_dir}",
            "--set", "pretrain.micro_batch=7", *LONG, "--out", str(out)]
    proc = procs.popen([str(BIN / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()),
                        "launch/pretrain.sh", *args], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    started(out, proc)
    os.killpg(proc.pid, signal.SIGINT)
    output = finish(proc)
    assert proc.returncode != 0
    tag = checkpoint_named(output, out, "SIGINT")
    marker = json.loads((out / "checkpoints" / tag / "complete.json").read_text())
    assert marker["world_size"] == ranks, marker


def test_a_signal_to_one_rank_stops_both_at_the_same_step(tmp_path: Path, tiny_tokenizer_dir: Path,
                                                          data_dir: Path) -> None:
    """SIGTERM to rank 1 only: rank 0 learns it through the per-step agreement and saves the same checkpoint."""
    out = tmp_path / "run"
    args = ["--preset", "tiny", "--tokenizer", str(tiny_tokenizer_dir), "--set", f"data.root={data_dir}",
            "--set", "pretrain.micro_batch=7", *LONG, "--out", str(out)]
    proc = procs.popen([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                        "launch/pretrain.sh", *args], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    started(out, proc)
    rank1 = [c for c in psutil.Process(proc.pid).children(recursive=True) if "--local_rank=1" in c.cmdline()]
    assert rank1, "rank 1 not found"
    rank1[0].send_signal(signal.SIGTERM)
    output = finish(proc)
    tag = checkpoint_named(output, out, "SIGTERM")  # printed by rank 0, which got no signal itself
    assert json.loads((out / "checkpoints" / tag / "complete.json").read_text())["world_size"] == 2
    assert "exits with return code = 143" in output  # the launcher reports the rank's status


@pytest.mark.slow  # in CI's slow suite: the default suite keeps to its 12 minutes on a host without AVX-512
def test_ctrl_c_while_fine_tuning_then_resume_alone(tmp_path: Path, tiny_tokenizer_dir: Path, data_dir: Path) -> None:
    out = tmp_path / "cls"
    args = ["finetune", "--preset", "tiny", "--tokenizer", str(tiny_tokenizer_dir), "--set", f"data.root={data_dir}",
            "--set", "finetune.epochs=400", "--set", "engine.log_every=1", "--out", str(out)]
    proc = procs.popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    started(out, proc, rows=3)
    proc.send_signal(signal.SIGINT)
    output = finish(proc)
    assert proc.returncode == 130, output[-3000:]
    step = int(checkpoint_named(output, out, "SIGINT")[4:])
    p = procs.run([sys.executable, "-m", "trainer", "finetune", "--out", str(out), "--resume", "--stop-at",
                   str(step + 1)], 300, cwd=REPO, env=env())
    assert p.returncode == 0 and f"resumed at step {step}" in p.stderr, p.stderr[-3000:]
    # A fresh run into the folder refuses instead of wiping its metrics.
    before = (out / "metrics.csv").read_bytes()
    p = procs.run([sys.executable, "-m", "trainer", *args], 300, cwd=REPO, env=env())
    assert p.returncode == 2 and f"{out} holds a run" in p.stderr
    assert (out / "metrics.csv").read_bytes() == before


def test_a_rerun_into_an_interrupted_folder_without_checkpoints_keeps_its_metrics(tmp_path: Path) -> None:
    """Killed before any checkpoint (tiny: checkpoint_every=0): the folder still holds its config and metrics."""
    from trainer.config.presets import tiny

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(tiny().to_json())
    (out / "metrics.csv").write_text("step,epoch,loss\n2,0,3.5\n")
    p = procs.run([sys.executable, "-m", "trainer", "pretrain", "--preset", "tiny", "--out", str(out)], 300,
                  cwd=REPO, env=env())
    assert p.returncode == 2 and "holds a run" in p.stderr and "--resume" in p.stderr, p.stderr[-2000:]
    assert (out / "metrics.csv").read_text() == "step,epoch,loss\n2,0,3.5\n"
