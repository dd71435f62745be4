"""The Makefile's system-package targets on a machine that lacks a tool: they install it (as root) or say what is
missing (otherwise), and never stop make without a word. The check runs here as a user who is not root (a fake `id`
first on PATH), so that nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from procs import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _as_a_user(tmp_path: Path) -> dict[str, str]:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "id").write_text("#!/bin/sh\necho 1000\n")
    (fake / "id").chmod(0o755)
    return {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}


def test_a_missing_container_tool_is_named_not_a_silent_failure(tmp_path: Path) -> None:
    # before: `for ... || exit 1` inside the `if` ended the recipe's shell: make stopped with Error 1 and nothing said
    p = subprocess.run(["make", "-s", "container-deps", "CONTAINER_TOOLS=sh no-such-tool-xyz"], cwd=REPO,
                       env=_as_a_user(tmp_path), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "warning: sh no-such-tool-xyz not all installed and not root" in p.stdout + p.stderr


def test_tools_that_are_all_there_are_not_installed_again(tmp_path: Path) -> None:
    p = subprocess.run(["make", "-s", "container-deps", "CONTAINER_TOOLS=sh ls"], cwd=REPO,
                       env=_as_a_user(tmp_path), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout + p.stderr == "", p.stdout + p.stderr
