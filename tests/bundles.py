"""Editing a bundle the way someone with write access to it would: change manifest.json, then (sealed=True) make
every file's sha256 and the manifest's own digest match again, so that the check under test is not the digest's."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from contract.manifest import DIGEST_KEY, manifest_digest


def reseal(bundle: Path) -> None:
    m = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    for rel in m["files"]:
        if (bundle / rel).is_file():
            m["files"][rel] = hashlib.sha256((bundle / rel).read_bytes()).hexdigest()
    m[DIGEST_KEY] = manifest_digest(m)
    (bundle / "manifest.json").write_text(json.dumps(m, indent=2), encoding="utf-8")


def edit_manifest(bundle: Path, change: Callable[[dict], None], sealed: bool = True) -> None:
    m = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    change(m)
    (bundle / "manifest.json").write_text(json.dumps(m, indent=2), encoding="utf-8")
    if sealed:
        reseal(bundle)
