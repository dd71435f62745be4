"""Editing a bundle the way someone with write access to it would: change manifest.json, then (sealed=True) make
every graph's metadata_props, every file's sha256 and the manifest's own digest match again, so that the check under
test is not the digest's."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import onnx

from contract.manifest import (
    CARD_FILE,
    DIGEST_KEY,
    FORMAT,
    TOKENIZER_BUNDLE_FILES,
    graph_metadata,
    manifest_digest,
    names_key,
)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def reseal(bundle: Path, graphs: bool = True) -> None:
    """graphs=False: leave the graphs' metadata_props as they are (only their checksums follow)."""
    m = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    for rel in TOKENIZER_BUNDLE_FILES:
        if rel in m["files"] and (bundle / rel).is_file():
            m["files"][rel] = _sha256(bundle / rel)
    tokenizer = {rel: m["files"].get(rel, "") for rel in TOKENIZER_BUNDLE_FILES}
    if CARD_FILE in m["files"] and (bundle / CARD_FILE).is_file():
        m["files"][CARD_FILE] = _sha256(bundle / CARD_FILE)
    for name, graph in m.get("graphs", {}).items():
        path = bundle / name
        if not path.is_file() or path.is_symlink():
            continue
        if name not in m["files"]:
            continue
        if graphs:
            model = onnx.load(str(path))
            del model.metadata_props[:]
            fmt = m.get("format", FORMAT)
            temperature = (m.get("calibration") or {}).get("temperature", 1.0)
            for key, value in graph_metadata(m[names_key(fmt)], m["label_values"], m["max_len"], m["special_ids"],
                                             tokenizer, graph["precision"], fmt, temperature).items():
                model.metadata_props.add(key=key, value=value)
            onnx.save(model, str(path))
        m["files"][name] = _sha256(path)
    m[DIGEST_KEY] = manifest_digest(m)
    (bundle / "manifest.json").write_text(json.dumps(m, indent=2), encoding="utf-8")


def as_format_3(bundle: Path) -> None:
    """A bundle as the exporter before model cards wrote it: no MODEL_CARD.md, no calibration or evaluation, format 3
    (its graphs' metadata_props without calibration_temperature); sealed. Its graphs still divide by the temperature:
    only what the files say changes."""
    def older(m: dict) -> None:
        m["format"] = 3
        for key in ("calibration", "evaluation"):
            m.pop(key, None)
        m["files"].pop(CARD_FILE, None)

    edit_manifest(bundle, older, sealed=True)
    (bundle / CARD_FILE).unlink(missing_ok=True)


def as_format_2(bundle: Path) -> None:
    """A bundle as the exporter before that wrote it: label names under "labels" (manifest.json and every graph's
    metadata_props), no data_fields, format 2; sealed."""
    as_format_3(bundle)

    def older(m: dict) -> None:
        m.update(format=2, labels=m.pop("label_names"))
        del m["data_fields"]

    edit_manifest(bundle, older, sealed=True)


def edit_manifest(bundle: Path, change: Callable[[dict], None], sealed: bool = True) -> None:
    m = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    change(m)
    (bundle / "manifest.json").write_text(json.dumps(m, indent=2), encoding="utf-8")
    if sealed:
        reseal(bundle)
