"""manifest.json, the description of a bundle folder, as a typed object: written by the exporter, read and checked
by the verifier (contract/bundle.py).

A bundle folder:
  model.onnx        one file (no external data), signature in contract/graph.py: the graph any ONNX tool reads
  model.int8.onnx   optional: the same model with dynamic int8 weights, the graph a CPU server runs
  model.fp16.onnx   optional: fp16 weights and activations, for CUDA (`export --gpu-precision fp16`)
  tokenizer/        spm.model, vocab.txt, meta.json (contract/tokens.py; no max_len: this manifest holds it)
  MODEL_CARD.md     the model card (trainer/export/card.py): data and its hashes, recipe, seeds, scores beside the
                    baseline, calibration, labels, limits, the commands that reproduce it; rendered from this
                    manifest's own fields, so its figures are the manifest's
  manifest.json     this object: which graph a server runs on which device ("serve"), how each graph was validated
                    ("graphs"), the sha256 of each file above ("files"), and its own digest: bundle_sha256, the
                    sha256 of the canonical JSON of everything else in it (keys sorted, no spaces, ASCII), so of every
                    file too. The server reports it (GetModelMetadata bundle_sha256); an edited manifest no longer
                    matches.

Each graph file carries what it is in its model-level metadata_props (`graph_metadata`), for any ONNX tool
(onnx.load(...).metadata_props, onnxruntime's `get_modelmeta().custom_metadata_map`): task, label_names,
label_values, max_len, special_ids, its precision, and the sha256 of the tokenizer files it must be run with. Not the
bundle's digest: that covers the graph files' checksums (and the export's time and measurements), so a graph holding
it would be circular, and would change with every export of the same artifact. The order is: graph files with their
metadata -> their checksums in "files" -> bundle_sha256 over all of it; the verifier holds each graph's metadata to
this manifest.

Two kinds of label travel from the training data to the client, each under one key everywhere (artifact.json,
manifest.json, the graphs' metadata_props): no key is called "labels" alone.
  label_values  the raw values of the data's label column, in logit order ("0", "1"); `trainer export --check` and
                `predict` read labelled files with them
  label_names   what the server answers with ("negative", "positive")
data_fields holds the data's text and label fields the model was trained with ({"text_field", "label_field"}):
`predict BUNDLE` and `export --check BUNDLE` read files with them unless told otherwise.

calibration holds the temperature T fitted on the validation split at fine-tuning (trainer/calibration.py) and the
expected calibration error before and after: every graph divides its logits by T (the served probabilities, a
softmax of the graph's output, are the calibrated ones), and says T in its metadata_props. evaluation holds the
source artifact's scores (validation, test, the TF-IDF baseline's, the seeds' summary) that the model card shows.

Format 4 (this one) added MODEL_CARD.md, calibration and evaluation. Format 3 named the label names "label_names" and
added data_fields; a format-3 bundle (no card, logits not calibrated) is still read, and so is a format-2 one (label
names under "labels", in manifest.json and in each graph's metadata_props), its fields taken as "text" and "label".
Format 1 (one graph, tokenizer/tokenizer.json) is refused with the command that exports it again.
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
from contract.tokens import SPECIALS, TOKENIZER_FILES, check_max_len

FORMAT = 4
READABLE_FORMATS = (2, 3, 4)  # format 2: label names under "labels"; before 4: no card, no calibration (docstring)
TASK = "sentiment-classification"
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.onnx"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_BUNDLE_FILES = tuple(f"{TOKENIZER_DIR}/{name}" for name in sorted(TOKENIZER_FILES))
CARD_FILE = "MODEL_CARD.md"
PRECISIONS = ("fp32", "int8", "fp16")
DEVICES = ("cpu", "cuda")  # what "serve" maps to a graph file
# model.onnx may hold any precision (a one-graph bundle: `export --precision`); the others are named by theirs.
EXTRA_GRAPH_FILES = {"int8": "model.int8.onnx", "fp16": "model.fp16.onnx"}
GRAPH_FILES = (MODEL_FILE, *EXTRA_GRAPH_FILES.values())
DIGEST_KEY = "bundle_sha256"
MAX_JSON_DEPTH = 16  # the manifest nests 7 levels deep; more is not a manifest
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REEXPORT = "export it again: python -m trainer export ARTIFACT --out BUNDLE"


def manifest_digest(obj: Mapping[str, Any]) -> str:
    """sha256 (hex) of a manifest without its own digest, as canonical JSON: keys sorted, no spaces, ASCII."""
    body = {k: v for k, v in obj.items() if k != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


@dataclass(frozen=True)
class Runtime:
    """How the graphs were prepared and the onnxruntime setting they were validated at."""

    graph_optimization_level: str = DEFAULT_OPT_LEVEL
    optimized_offline: bool = False  # the graph files are the graphs onnxruntime optimised at that level
    fused_attention: bool = True  # one com.microsoft.Attention node per layer

    def to_dict(self) -> dict[str, Any]:
        return {"graph_optimization_level": self.graph_optimization_level,
                "optimized_offline": self.optimized_offline, "fused_attention": self.fused_attention}


@dataclass(frozen=True)
class Graph:
    """One graph file of the bundle."""

    precision: str  # one of PRECISIONS
    quantization: dict[str, Any] | None = None  # int8: method, weight type, per_channel, reduce_range
    validation: dict[str, Any] = field(default_factory=dict)  # the exporter's report against PyTorch, tolerances
    # included; with --data, its accuracy on that file

    @property
    def per_row(self) -> bool:
        """Run it one text per onnxruntime run. A dynamically quantized graph (int8) quantizes each activation tensor
        with one scale computed at run time: in a batch, every text's answer would move with the other texts and
        with the padding (docs/BENCHMARKS.md, "Answers independent of the batch"). Alone, a text gets its own."""
        return self.quantization is not None and self.quantization.get("method") == "dynamic"

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "quantization": self.quantization, "validation": self.validation}


def names_key(fmt: int) -> str:
    """The key of the label names in a manifest and its graphs' metadata_props of format `fmt`."""
    return "labels" if fmt == 2 else "label_names"


def graph_metadata(label_names: list[str], label_values: list[str], max_len: int, special_ids: Mapping[str, int],
                   tokenizer_sha256: Mapping[str, str], precision: str, fmt: int = FORMAT,
                   temperature: float = 1.0) -> dict[str, str]:
    """The model-level metadata_props of a graph file (ONNX keeps strings: lists and objects as JSON); `fmt`: the
    bundle format they belong to; `temperature` (format 4): what the graph divides its logits by."""
    def js(value: object) -> str:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)

    meta = {"task": TASK, "bundle_format": str(fmt), names_key(fmt): js(label_names),
            "label_values": js(label_values), "max_len": str(max_len), "special_ids": js(dict(special_ids)),
            "precision": precision, "tokenizer_sha256": js(dict(tokenizer_sha256))}
    if fmt >= 4:
        meta["calibration_temperature"] = repr(float(temperature))
    return meta


def bundle_files(graphs: Mapping[str, Any], fmt: int = FORMAT) -> tuple[str, ...]:
    """Every file a bundle of format `fmt` with these graph files holds, manifest.json aside."""
    return (*sorted(graphs), *TOKENIZER_BUNDLE_FILES, *((CARD_FILE,) if fmt >= 4 else ()))


@dataclass(frozen=True)
class Manifest:
    label_names: list[str]  # what the server answers, in logit order
    label_values: list[str]  # the training data's raw label values, in logit order
    max_len: int  # longest id sequence served, <sos> and <eos> included: the bundle's copy (contract/tokens.py)
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    files: dict[str, str]  # bundle-relative path -> sha256 (hex) of its bytes
    graphs: dict[str, Graph]  # graph file -> what it is
    serve: dict[str, str]  # device ("cpu", "cuda") -> the graph file a server runs there
    runtime: Runtime = field(default_factory=Runtime)
    special_ids: dict[str, int] = field(default_factory=lambda: dict(SPECIALS))
    opset: int | None = None  # default-domain opset of the graphs
    opset_imports: dict[str, int] = field(default_factory=dict)
    cpu_int8: dict[str, Any] | None = None  # `export`'s default: the bound int8 was held to for CPU, and the outcome
    source_artifact: dict[str, Any] = field(default_factory=dict)  # where the weights came from
    # the data's fields the model was trained with; a format-2 bundle: the readers' defaults
    data_fields: dict[str, str] = field(default_factory=lambda: {"text_field": "text", "label_field": "label"})
    # the temperature every graph divides its logits by, where it was fitted, ECE before and after (module
    # docstring); None: a bundle before format 4, uncalibrated
    calibration: dict[str, Any] | None = None
    evaluation: dict[str, Any] = field(default_factory=dict)  # the source artifact's scores (module docstring)
    format: int = FORMAT  # as read (READABLE_FORMATS); `to_dict` writes FORMAT
    versions: dict[str, str] = field(default_factory=dict)  # of the exporter's libraries
    created: str = ""
    export_seconds: float = 0.0
    bundle_sha256: str = ""  # as read; `to_dict` computes it afresh

    @property
    def calibrated(self) -> bool:
        """The graphs' probabilities are calibrated: a temperature was fitted and every graph applies it."""
        return bool(self.calibration and self.calibration.get("method") == "temperature scaling")

    @property
    def temperature(self) -> float:
        """What every graph divides its logits by (1: not calibrated, a bundle before format 4)."""
        return float(self.calibration["temperature"]) if self.calibration else 1.0

    def graph_for(self, device: str) -> str:
        """The graph file a server runs on `device` ("cpu" or "cuda")."""
        return self.serve[device]

    def graph_metadata(self, graph_file: str) -> dict[str, str]:
        """The metadata_props `graph_file` carries (module docstring)."""
        return graph_metadata(self.label_names, self.label_values, self.max_len, self.special_ids,
                              {rel: self.files[rel] for rel in TOKENIZER_BUNDLE_FILES},
                              self.graphs[graph_file].precision, self.format, self.temperature)

    def to_dict(self) -> dict[str, Any]:
        """The manifest as written (format FORMAT), its digest last."""
        if self.format != FORMAT:
            raise BundleError(f"a format-{self.format} manifest is read, never written: {_REEXPORT}")
        body = {
            "format": FORMAT,
            "task": TASK,
            "label_names": self.label_names,
            "label_values": self.label_values,
            "data_fields": self.data_fields,
            "max_len": self.max_len,
            "special_ids": self.special_ids,
            "opset": self.opset,
            "opset_imports": self.opset_imports,
            "inputs": [s.to_dict() for s in self.inputs],
            "outputs": [s.to_dict() for s in self.outputs],
            "graphs": {name: g.to_dict() for name, g in self.graphs.items()},
            "serve": self.serve,
            "cpu_int8": self.cpu_int8,
            "runtime": self.runtime.to_dict(),
            "files": self.files,
            "source_artifact": self.source_artifact,
            "calibration": self.calibration,
            "evaluation": self.evaluation,
            "versions": self.versions,
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
        if m.get("format") == 1:
            readable = ", ".join(map(str, READABLE_FORMATS[:-1])) + f" and {READABLE_FORMATS[-1]}"
            raise BundleError(f"{path}: format 1, a bundle from an earlier exporter (one graph, "
                              f"tokenizer/tokenizer.json); this version reads formats {readable}: {_REEXPORT}")
        fmt = m.get("format")
        if fmt not in READABLE_FORMATS:
            raise BundleError(f"{path}: field 'format' must be one of {list(READABLE_FORMATS)}, got {fmt!r}")
        if m.get("task") != TASK:
            raise BundleError(f"{path}: field 'task' must be {TASK!r}, got {m.get('task')!r}")
        key = names_key(fmt)
        if fmt >= 3 and "labels" in m:
            raise BundleError(f"{path}: field 'labels' is not one of format {fmt}: it says 'label_names' (what "
                              "the server answers) and 'label_values' (the data's values)")
        names = m.get(key)
        if (not isinstance(names, list) or len(names) < 2 or not all(isinstance(x, str) and x for x in names)
                or len(set(names)) != len(names)):
            raise BundleError(f"{path}: field {key!r} must list at least 2 distinct non-empty names, got {names!r}")
        values = m.get("label_values")
        if not isinstance(values, list) or len(values) != len(names) or not all(isinstance(x, str) for x in values) \
                or len(set(values)) != len(values):
            raise BundleError(f"{path}: field 'label_values' must list {len(names)} distinct strings (the data's "
                              f"label value of each name in {key!r}), got {values!r}")
        fields = m.get("data_fields", {"text_field": "text", "label_field": "label"} if fmt == 2 else None)
        if not (isinstance(fields, dict) and set(fields) == {"text_field", "label_field"}
                and all(isinstance(v, str) and v for v in fields.values())):
            raise BundleError(f"{path}: field 'data_fields' must name the data's text_field and label_field, got "
                              f"{fields!r}")
        max_len = check_max_len(m.get("max_len"), f"{path}: field 'max_len'", BundleError)
        if m.get("special_ids") != SPECIALS:
            raise BundleError(f"{path}: field 'special_ids' must be {SPECIALS}, got {m.get('special_ids')!r}")
        digest = m.get(DIGEST_KEY)
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise BundleError(f"{path}: field {DIGEST_KEY!r} must be the manifest's own sha256 (64 hex digits), got "
                              f"{digest!r} (a bundle exported before manifests carried it: {_REEXPORT})")
        if manifest_digest(m) != digest:
            raise BundleError(f"{path}: {DIGEST_KEY} does not match the manifest's content: manifest.json was edited "
                              "after export (export the bundle again)")
        graphs = _graphs(m.get("graphs"), path)
        cpu_int8 = m.get("cpu_int8")
        if not (cpu_int8 is None or isinstance(cpu_int8, dict)):
            raise BundleError(f"{path}: field 'cpu_int8' must be an object or null, got {cpu_int8!r}")
        calibration, evaluation = _calibration(m.get("calibration"), fmt, path), m.get("evaluation") or {}
        if not isinstance(evaluation, dict):
            raise BundleError(f"{path}: field 'evaluation' must be an object, got {evaluation!r}")
        return cls(
            label_names=list(names),
            label_values=list(values),
            max_len=max_len,
            inputs=_specs(m.get("inputs"), "inputs", path),
            outputs=_specs(m.get("outputs"), "outputs", path),
            files=_files(m.get("files"), graphs, path, fmt),
            graphs=graphs,
            serve=_serve(m.get("serve"), graphs, path),
            runtime=_runtime(m.get("runtime", {}), path),
            special_ids=dict(SPECIALS),
            opset=m.get("opset"),
            opset_imports=m.get("opset_imports") or {},
            cpu_int8=cpu_int8,
            source_artifact=m.get("source_artifact") or {},
            data_fields=dict(fields),
            calibration=calibration,
            evaluation=evaluation,
            format=fmt,
            versions=m.get("versions") or {},
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


def _graphs(value: Any, path: Path) -> dict[str, Graph]:
    """model.onnx and optionally model.int8.onnx / model.fp16.onnx, each with its precision."""
    if not isinstance(value, dict) or MODEL_FILE not in value:
        raise BundleError(f"{path}: field 'graphs' must map graph files ({MODEL_FILE} at least) to their "
                          f"description, got {value!r}")
    graphs = {}
    for name, g in value.items():
        if name not in GRAPH_FILES:
            raise BundleError(f"{path}: graphs entry {name!r} is not a graph file of a bundle "
                              f"({', '.join(GRAPH_FILES)})")
        precision = g.get("precision") if isinstance(g, dict) else None
        if precision not in PRECISIONS:
            raise BundleError(f"{path}: graphs[{name!r}].precision must be one of {PRECISIONS}, got {precision!r}")
        if name != MODEL_FILE and EXTRA_GRAPH_FILES.get(precision) != name:
            raise BundleError(f"{path}: graphs[{name!r}] holds precision {precision!r}; that file holds "
                              f"{next(p for p, f in EXTRA_GRAPH_FILES.items() if f == name)}")
        quantization, validation = g.get("quantization"), g.get("validation") or {}
        if not (quantization is None or isinstance(quantization, dict)) or not isinstance(validation, dict):
            raise BundleError(f"{path}: graphs[{name!r}]: quantization and validation must be objects")
        graphs[name] = Graph(precision, quantization, validation)
    return graphs


def _serve(value: Any, graphs: Mapping[str, Graph], path: Path) -> dict[str, str]:
    """Every device names one of the bundle's graphs."""
    if not isinstance(value, dict) or set(value) != set(DEVICES):
        raise BundleError(f"{path}: field 'serve' must name the graph of each device {list(DEVICES)}, got {value!r}")
    for device, name in value.items():
        if name not in graphs:
            raise BundleError(f"{path}: serve[{device!r}] is {name!r}, not one of the bundle's graphs {sorted(graphs)}")
    return {d: value[d] for d in DEVICES}


def _calibration(value: Any, fmt: int, path: Path) -> dict[str, Any] | None:
    """Format 4: an object whose temperature is a finite number > 0 (what every graph divides its logits by)."""
    if fmt < 4:
        return None
    t = value.get("temperature") if isinstance(value, dict) else None
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t < float("inf"):
        raise BundleError(f"{path}: field 'calibration' must be an object whose temperature is a number > 0 (what "
                          f"every graph divides its logits by), got {value!r}")
    return dict(value)


def _files(files: Any, graphs: Mapping[str, Graph], path: Path, fmt: int = FORMAT) -> dict[str, str]:
    """Exactly the bundle's files (the tokenizer's, the graphs', the model card from format 4), each a relative path
    inside the folder with a sha256."""
    if not isinstance(files, dict):
        raise BundleError(f"{path}: field 'files' must map file names to sha256 checksums, got {files!r}")
    for rel, digest in files.items():
        p = PurePosixPath(rel)
        if p.is_absolute() or ".." in p.parts or "\\" in rel or not rel:
            raise BundleError(f"{path}: files entry {rel!r} must be a relative path inside the bundle")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest.lower()):
            raise BundleError(f"{path}: files[{rel!r}] must be a 64-digit sha256, got {digest!r}")
    expected = bundle_files(graphs, fmt)
    for rel in expected:
        if rel not in files:
            raise BundleError(f"{path}: field 'files' lacks {rel!r}: every bundle file must have a checksum")
    extra = sorted(set(files) - set(expected))
    if extra:
        raise BundleError(f"{path}: files entry {extra[0]!r} is not a file of this bundle (it holds exactly "
                          f"{', '.join(expected)})")
    return {rel: files[rel].lower() for rel in files}


def _runtime(value: Any, path: Path) -> Runtime:
    if not isinstance(value, dict):
        raise BundleError(f"{path}: field 'runtime' must be an object, got {value!r}")
    level = value.get("graph_optimization_level", DEFAULT_OPT_LEVEL)
    if level not in OPT_LEVELS:
        raise BundleError(f"{path}: runtime.graph_optimization_level must be one of {sorted(OPT_LEVELS)}, "
                          f"got {level!r}")
    return Runtime(level, bool(value.get("optimized_offline", False)), bool(value.get("fused_attention", True)))


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
