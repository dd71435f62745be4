"""bench/gpu_check.sh without a GPU (shellcheck: test_shell_scripts.py): its arguments, the plan it prints
(--dry-run: every part in a time box, the boxes within the budget, the budget within 9 minutes), its refusal to
measure without a GPU, the summary of an empty output folder, and (slow) --smoke: every part's commands and the
summary run on the CPU at tiny sizes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import procs
import pytest
import torch
from procs import REPO, env

SCRIPT = REPO / "bench" / "gpu_check.sh"
PARTS = ["tests", "ratio", "mfu", "lab", "sdpa"]  # as the summary lists them
LIMIT_S = 540  # the script's promise: all of it in under 9 minutes
SETUP_S = 30  # before the first part: the machine's lines, installing the prepared wheels (~20 s on the H200)


def check(*args: str, out: Path | None = None, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    e = env()
    if out is not None:
        e["OUT"] = str(out)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=e, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--parts", "tests,bogus"], "unknown part 'bogus' in --parts"),
    (["--parts", ""], "--parts is empty"),
    (["--parts"], "--parts needs a list"),
    (["--budget", "5"], "--budget must be whole seconds from 60 to 3600, got '5'"),
    (["--budget", "9m"], "got '9m'"),
    (["--fast"], "unknown argument '--fast'"),
])
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    p = check("--dry-run", *args)
    assert p.returncode == 2 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_the_dry_run_prints_the_machine_first_then_a_plan_that_fits(tmp_path: Path) -> None:
    p = check("--dry-run", out=tmp_path / "out")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("gpu_check ") and f"{os.cpu_count()} cores" in lines[0]  # what the machine is, first
    assert lines[1].startswith("gpu ") and lines[2].startswith("python ")
    boxes = {m[0]: int(m[1]) for m in re.findall(r"^part (\w+) \(time box (\d+) s\):$", p.stdout, re.M)}
    assert list(boxes) == ["tests", "lab", "ratio", "mfu", "sdpa"]  # the order they run in
    assert "side by side: tests lab" in p.stdout  # untimed, sharing the GPU; the timed parts run alone
    total = int(re.search(r"time boxes add up to (\d+) s", p.stdout)[1])
    assert total == max(boxes["tests"], boxes["lab"]) + boxes["ratio"] + boxes["mfu"] + boxes["sdpa"]
    budget = int(re.search(r"within (\d+) s", p.stdout)[1])
    assert total + SETUP_S <= budget <= LIMIT_S - 15
    assert "--task both --preset lab" in p.stdout and "--preset gpu --micro-batch 32 --seq-len 1024" in p.stdout
    assert "deepspeed-compiled" in p.stdout and "finetune.sh" in p.stdout and "--compare" in p.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    only = check("--dry-run", "--parts", "mfu,tests")
    assert re.findall(r"^part (\w+) ", only.stdout, re.M) == ["tests", "mfu"] and "side by side" not in only.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_refuses_to_measure(tmp_path: Path) -> None:
    p = check(out=tmp_path / "out")
    assert p.returncode == 2 and "no usable CUDA GPU here" in p.stderr


def test_the_summary_of_a_run_that_left_nothing(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_summary.py"), str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("| ") and "not run" in ln]
    assert [r.split("|")[1].strip() for r in rows] == PARTS
    p = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_summary.py"), str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "usage" in p.stderr


@pytest.mark.slow
def test_smoke_runs_every_part_on_the_cpu(tmp_path: Path, data_dir: Path) -> None:
    """--smoke: the same parts at tiny sizes (tiny and shrunk gpu presets, 3 pretraining steps, one fine-tuning
    epoch), then the summary from what they wrote."""
    out = tmp_path / "out"
    e = {**env(), "OUT": str(out), "TS_DATA": str(data_dir)}
    p = procs.run(["bash", str(SCRIPT), "--smoke"], 3000, cwd=REPO, env=e)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    status = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in summary.splitlines()
              if r.startswith("| ") and r.split("|")[1].strip() in PARTS}
    assert status == dict.fromkeys(PARTS, "ok"), summary
    assert "lm: deepspeed" in summary and "classifier: deepspeed" in summary  # ratio rows
    assert re.search(r"plain [\d.]+%, deepspeed [\d.]+% of the matmul peak", summary), summary
    assert re.search(r"test accuracy: scratch [\d.]+, pretrained [\d.]+", summary), summary
