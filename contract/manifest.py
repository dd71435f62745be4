"""manifest.json, the description of a bundle folder, as a typed object: written by the exporter, read and checked
by the verifier (contract/bundle.py).

A bundle folder:
  model.onnx      one file (no external data), signature in contract/graph.py
  tokenizer/      spm.model, vocab.txt, tokenizer.json (contract/tokens.py)
  manifest.json   this object, with the sha256 of each file above, and its own digest: bundle_sha256, the sha256
                  of the canonical JSON of everything else in it (keys sorted, no spaces, ASCII), so of every file
                  too. The server reports it (GetModelMetadata bundle_sha256); an edited manifest no longer matches.

Two kinds of label travel from the training data to the client, and their names say which:
  label_values  the raw values of the data's label column, in logit order ("0", "1"); artifact.json calls them
                "labels", and `trainer export --check` reads labelled files with them
  label_names   what the server answers with ("negative", "positive"); manifest.json keeps them under "labels"
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from contract.errors import BundleError
from contract.graph import TensorSpec
from contract.runtime import DEFAULT_OPT_LEVEL, OPT_LEVELS
from contract.tokens import SPECIALS, TOKENIZER_FILES

FORMAT = 1
TASK = "sentiment-classification"
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.onnx"
TOKENIZER_DIR = "tokenizer"
# Every file of a bundle, in the order the manifest lists them.
BUNDLE_FILES = (MODEL_FILE, *(f"{TOKENIZER_DIR}/{name}" for name in sorted(TOKENIZER_FILES)))
PRECISIONS = ("fp32", "int8", "fp16")
DIGEST_KEY = "bundle_sha256"
MAX_JSON_DEPTH = 16  # the manifest nests 5 levels deep; more is not a manifest
_SHA256 = re.compile(r"[0-9a-f]{64}")


def manifest_digest(obj: Mapping[str, Any]) -> str:
    """sha256 (hex) of a manifest without its own digest, as canonical JSON: keys sorted, no spaces, ASCII."""
    body = {k: v for k, v in obj.items() if k != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


@dataclass(frozen=True)
class Runtime:
    """How the graph was prepared and the onnxruntime setting it was validated at."""

    graph_optimization_level: str = DEFAULT_OPT_LEVEL
    optimized_offline: bool = False  # model.onnx is the graph onnxruntime optimised at that level
    fused_attention: bool = True  # one com.microsoft.Attention node per layer
    quantization: dict[str, Any] | None = None  # int8: method, weight type, per_channel, reduce_range

    def to_dict(self) -> dict[str, Any]:
        return {"graph_optimization_level": self.graph_optimization_level,
                "optimized_offline": self.optimized_offline, "fused_attention": self.fused_attention,
                "quantization": self.quantization}


@dataclass(frozen=True)
class Manifest:
    label_names: list[str]  # "labels": what the server answers, in logit order
    label_values: list[str]  # "label_values": the training data's raw label values, in logit order
    max_len: int  # longest id sequence served, <sos> and <eos> included
    precision: str  # one of PRECISIONS
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    files: dict[str, str]  # bundle-relative path -> sha256 (hex) of its bytes
    runtime: Runtime = field(default_factory=Runtime)
    special_ids: dict[str, int] = field(default_factory=lambda: dict(SPECIALS))
    opset: int | None = None  # default-domain opset of model.onnx
    opset_imports: dict[str, int] = field(default_factory=dict)
    source_artifact: dict[str, Any] = field(default_factory=dict)  # where the weights came from
    versions: dict[str, str] = field(default_factory=dict)  # of the exporter's libraries
    validation: dict[str, Any] = field(default_factory=dict)  # the exporter's report, tolerances included
    created: str = ""
    export_seconds: float = 0.0
    bundle_sha256: str = ""  # as read; `to_dict` computes it afresh

    def to_dict(self) -> dict[str, Any]:
        """The manifest as written, its digest last."""
        body = {
            "format": FORMAT,
            "task": TASK,
            "labels": self.label_names,
            "label_values": self.label_values,
            "max_len": self.max_len,
            "special_ids": self.special_ids,
            "opset": self.opset,
            "opset_imports": self.opset_imports,
            "precision": self.precision,
            "inputs": [s.to_dict() for s in self.inputs],
            "outputs": [s.to_dict() for s in self.outputs],
            "runtime": self.runtime.to_dict(),
            "files": self.files,
            "source_artifact": self.source_artifact,
            "versions": self.versions,
            "validation": self.validation,
            "created": self.created,
            "export_seconds": self.export_seconds,
        }
        return {**body, DIGEST_KEY: manifest_digest(body)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, m: Any, path: Path) -> Manifest:
        """Check every field a reader relies on; BundleError names `path` and the field."""
        if not isinstance(m, dict):
            raise BundleError(f"{path}: expected a JSON object")
        if m.get("format") != FORMAT:
            raise BundleError(f"{path}: field 'format' must be {FORMAT}, got {m.get('format')!r}")
        if m.get("task") != TASK:
            raise BundleError(f"{path}: field 'task' must be {TASK!r}, got {m.get('task')!r}")
        names = m.get("labels")
        if (not isinstance(names, list) or len(names) < 2 or not all(isinstance(x, str) and x for x in names)
                or len(set(names)) != len(names)):
            raise BundleError(f"{path}: field 'labels' must list at least 2 distinct non-empty names, got {names!r}")
        values = m.get("label_values", [str(i) for i in range(len(names))])
        if not isinstance(values, list) or len(values) != len(names) or not all(isinstance(x, str) for x in values) \
                or len(set(values)) != len(values):
            raise BundleError(f"{path}: field 'label_values' must list {len(names)} distinct strings (the data's "
                              f"label value of each name in 'labels'), got {values!r}")
        max_len = m.get("max_len")
        if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 3:
            raise BundleError(f"{path}: field 'max_len' must be an int >= 3, got {max_len!r}")
        if m.get("special_ids") != SPECIALS:
            raise BundleError(f"{path}: field 'special_ids' must be {SPECIALS}, got {m.get('special_ids')!r}")
        if m.get("precision") not in PRECISIONS:
            raise BundleError(f"{path}: field 'precision' must be one of {PRECISIONS}, got {m.get('precision')!r}")
        digest = m.get(DIGEST_KEY)
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise BundleError(f"{path}: field {DIGEST_KEY!r} must be the manifest's own sha256 (64 hex digits), got "
                              f"{digest!r} (a bundle exported before manifests carried it: export it again)")
        if manifest_digest(m) != digest:
            raise BundleError(f"{path}: {DIGEST_KEY} does not match the manifest's content: manifest.json was edited "
                              "after export (export the bundle again)")
        return cls(
            label_names=list(names),
            label_values=list(values),
            max_len=max_len,
            precision=m["precision"],
            inputs=_specs(m.get("inputs"), "inputs", path),
            outputs=_specs(m.get("outputs"), "outputs", path),
            files=_files(m.get("files"), path),
            runtime=_runtime(m.get("runtime", {}), path),
            special_ids=dict(SPECIALS),
            opset=m.get("opset"),
            opset_imports=m.get("opset_imports") or {},
            source_artifact=m.get("source_artifact") or {},
            versions=m.get("versions") or {},
            validation=m.get("validation") or {},
            created=str(m.get("created", "")),
            export_seconds=m.get("export_seconds", 0.0),
            bundle_sha256=digest,
        )


def _specs(value: Any, key: str, path: Path) -> list[TensorSpec]:
    ok = isinstance(value, list) and all(
        isinstance(v, dict) and set(v) == {"name", "dtype", "shape"} and isinstance(v["name"], str)
        and isinstance(v["dtype"], str) and isinstance(v["shape"], list)
        and all(isinstance(d, (str, int)) and not isinstance(d, bool) for d in v["shape"]) for v in value)
    if not ok:
        raise BundleError(f"{path}: field {key!r} must list {{name, dtype, shape}} objects, got {value!r}")
    return [TensorSpec(v["name"], v["dtype"], tuple(v["shape"])) for v in value]


def _files(files: Any, path: Path) -> dict[str, str]:
    """Exactly the bundle's files, each a relative path inside the folder with a sha256."""
    if not isinstance(files, dict):
        raise BundleError(f"{path}: field 'files' must map file names to sha256 checksums, got {files!r}")
    for rel, digest in files.items():
        p = PurePosixPath(rel)
        if p.is_absolute() or ".." in p.parts or "\\" in rel or not rel:
            raise BundleError(f"{path}: files entry {rel!r} must be a relative path inside the bundle")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest.lower()):
            raise BundleError(f"{path}: files[{rel!r}] must be a 64-digit sha256, got {digest!r}")
    for rel in BUNDLE_FILES:
        if rel not in files:
            raise BundleError(f"{path}: field 'files' lacks {rel!r}: every bundle file must have a checksum")
    extra = sorted(set(files) - set(BUNDLE_FILES))
    if extra:
        raise BundleError(f"{path}: files entry {extra[0]!r} is not a bundle file (a bundle holds exactly "
                          f"{', '.join(BUNDLE_FILES)})")
    return {rel: files[rel].lower() for rel in files}


def _runtime(value: Any, path: Path) -> Runtime:
    if not isinstance(value, dict):
        raise BundleError(f"{path}: field 'runtime' must be an object, got {value!r}")
    level = value.get("graph_optimization_level", DEFAULT_OPT_LEVEL)
    if level not in OPT_LEVELS:
        raise BundleError(f"{path}: runtime.graph_optimization_level must be one of {sorted(OPT_LEVELS)}, "
                          f"got {level!r}")
    return Runtime(level, bool(value.get("optimized_offline", False)), bool(value.get("fused_attention", True)),
                   value.get("quantization"))


def read_manifest(raw: bytes, path: Path) -> Manifest:
    """Parse manifest.json's bytes strictly (UTF-8, no key twice in an object, no NaN or Infinity, at most
    MAX_JSON_DEPTH levels), then check it."""
    return Manifest.from_dict(strict_json(raw, path), path)


def strict_json(raw: bytes, path: Path) -> Any:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in items:
            if key in obj:
                raise BundleError(f"{path}: key {key!r} appears twice in one object")
            obj[key] = value
        return obj

    def constant(name: str) -> Any:
        raise BundleError(f"{path}: {name} is not a JSON number")

    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except RecursionError:
        raise BundleError(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path}: not valid JSON ({e})") from None
    stack = [(obj, 1)]
    while stack:  # iterative: the depth is what is being checked
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise BundleError(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return obj
