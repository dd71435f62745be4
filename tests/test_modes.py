"""Files the project writes atomically (artifacts, tokenizer folders, bundles, corpus caches, reports) get the modes
the umask gives any file a user writes, not the 0700 / 0600 of a temporary folder or file renamed into place: a
bundle exported by a CI job that runs as root is read by a server that runs as another user."""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from procs import REPO

from trainer import artifact
from trainer.atomic import write_text_atomic
from trainer.data.corpus import read_manifest
from trainer.data.prepare import prepare
from trainer.export import ExportOptions, export_bundle

NOBODY = 65534


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """Permission bits of `root` and everything under it, by path relative to root's parent."""
    return {str(p.relative_to(root.parent)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


def expected(root: Path, mask: int) -> dict[str, int]:
    return {str(p.relative_to(root.parent)): (0o777 if p.is_dir() else 0o666) & ~mask for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask-022", "umask-027"])
def test_artifact_tokenizer_bundle_and_files_follow_the_umask(mask: int, tiny_classifier_artifact: Path,
                                                              tiny_tokenizer, tmp_path: Path) -> None:
    src = artifact.load(tiny_classifier_artifact)
    with umask(mask):
        art = artifact.save(tmp_path / "artifact", src.model(), src.cfg, "classifier", tiny_tokenizer)
        tok = tiny_tokenizer.save(tmp_path / "tokenizer")
        bundle = export_bundle(art, tmp_path / "bundle", ExportOptions(precision="fp32"))
        write_text_atomic(tmp_path / "notes.txt", "x\n")
        (tmp_path / "docs.txt").write_text("Un livre magnifique.\nUn autre.\n", encoding="utf-8")
        prepared = tmp_path / "prepared"
        prepare([tmp_path / "docs.txt"], tiny_tokenizer, prepared, workers=1, shard_tokens=1, log=io.StringIO())
    assert len(read_manifest(prepared)["shards"]) == 2  # shards, their indexes, the manifest and the tokenizer
    for root in (art, tok, bundle, prepared):
        assert modes(root) == expected(root, mask)
    for name in ("notes.txt",):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~mask, name
    assert modes(art)["artifact/model.safetensors"] == 0o666 & ~mask  # safetensors alone would make it 0600


SERVE_AS_NOBODY = """
import sys
from serving.model.predictor import Predictor
p = Predictor(sys.argv[1], device="cpu", intra_op_threads=1)
print(p.graph, p.predict(["Un livre magnifique."])[0].label)
"""

EXPORT_CHECK_AS_NOBODY = """
import sys
from trainer.artifact import load
print(load(sys.argv[1]).task)
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv (util-linux) to run as another user")
def test_a_bundle_exported_by_root_is_served_by_another_user(tiny_classifier_artifact: Path, tiny_tokenizer) -> None:
    """Root exports with umask 022 into a folder every user can reach; user 65534 (nobody) loads the artifact the way
    `export` would and serves the bundle."""
    shared = Path(tempfile.mkdtemp(prefix="ts-modes-"))  # pytest's tmp folders are 0700: not reachable by nobody
    try:
        shared.chmod(0o755)
        src = artifact.load(tiny_classifier_artifact)
        with umask(0o022):
            art = artifact.save(shared / "artifact", src.model(), src.cfg, "classifier", tiny_tokenizer)
            bundle = export_bundle(art, shared / "bundle")
        as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
        env = {**os.environ, "HOME": "/nonexistent", "PYTHONDONTWRITEBYTECODE": "1"}
        for script, arg, want in ((SERVE_AS_NOBODY, bundle, "model.int8.onnx"),
                                  (EXPORT_CHECK_AS_NOBODY, art, "classifier")):
            run = subprocess.run([*as_nobody, sys.executable, "-c", script, str(arg)], capture_output=True,
                                 text=True, timeout=300, cwd=REPO, env=env)
            assert run.returncode == 0, run.stderr[-3000:]
            assert run.stdout.split()[0] == want, run.stdout
    finally:
        shutil.rmtree(shared, ignore_errors=True)
