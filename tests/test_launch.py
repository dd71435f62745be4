"""The launch scripts are bash and Python at once (DeepSpeed's launcher runs them with `python -u`), and each route
reaches the same subcommand. Full launcher runs (ranks, nodes, --no_python, bash) are in test_training.py."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import REPO

SCRIPTS = {"pretrain": REPO / "launch" / "pretrain.sh", "finetune": REPO / "launch" / "finetune.sh"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_is_valid_bash_and_python(name: str) -> None:
    path = SCRIPTS[name]
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and os.access(path, os.X_OK)  # --no_python executes it
    ast.parse(text, filename=str(path))
    subprocess.run(["bash", "-n", str(path)], check=True)


# Each script by one route in the default suite (8 s a case): both routes and both scripts are covered; the other
# two pairings are slow.
@pytest.mark.parametrize(("name", "route"), [("pretrain", "bash"), ("finetune", "python"),
                                            pytest.param("pretrain", "python", marks=pytest.mark.slow),
                                            pytest.param("finetune", "bash", marks=pytest.mark.slow)])
def test_each_route_reaches_its_own_subcommand(name: str, route: str, tmp_path: Path) -> None:
    # Run from another folder, as a launcher on a cluster node may: the scripts find the repo themselves. The
    # subcommand's own help proves which one ran (finetune's has --pretrained, pretrain's does not).
    cmd = [sys.executable, "-u"] if route == "python" else ["bash"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([*cmd, str(SCRIPTS[name]), "--local_rank=0", "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith(f"usage: python -m trainer {name} ") and "--resume [TAG]" in p.stdout
    assert ("--pretrained ARTIFACT" in p.stdout) == (name == "finetune")
    # Arguments after the script reach the subcommand unchanged: a bad one is refused by trainer's own parser.
    p = subprocess.run([*cmd, str(SCRIPTS[name]), "--local_rank=0", "--out", "run", "--no-such-option"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"python -m trainer {name}: error: unrecognized arguments: --no-such-option" \
        in p.stderr, p.stderr[-2000:]


def test_hostfile_example_is_what_deepspeed_reads() -> None:
    from deepspeed.launcher.runner import fetch_hostfile

    pool = fetch_hostfile(str(REPO / "launch" / "hostfile.example"))
    assert pool == {"node-01": 8, "node-02": 8}
