"""A model bundle loaded into onnxruntime: texts -> labels, probabilities, token counts. No gRPC, no torch.

Bundle layout (COMMON.md "ONNX bundle folder"): model.onnx, tokenizer/, manifest.json. Every file listed in the
manifest is read once, its sha256 checked against the manifest, and those same bytes are what gets loaded (no
window between check and load). A missing, corrupt or tampered file is a `BundleError` naming it.

Shapes: n texts, T = the longest sequence of a batch (<= max_len), C classes.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from serving.errors import BundleError, ConfigError
from serving.tokenizer import PAD, SPECIALS, Encoded, Tokenizer

log = logging.getLogger(__name__)

Device = Literal["auto", "cpu", "cuda"]
Optimization = Literal["disable", "basic", "extended", "all"]
REQUIRED_FILES = ("model.onnx", "tokenizer/spm.model", "tokenizer/vocab.txt", "tokenizer/tokenizer.json")
CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
_OPT_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


@dataclass(frozen=True)
class Prediction:
    """The answer for one text."""

    label: str  # labels[label_index]
    label_index: int  # argmax of probabilities
    probabilities: np.ndarray  # (C,) float32, in the manifest's label order, sums to 1
    token_count: int  # ids the model read, <sos> and <eos> included
    truncated: bool  # pieces were cut to fit max_len


@dataclass(frozen=True)
class Bundle:
    """A verified bundle's contents, as bytes that matched the manifest."""

    folder: Path
    manifest: dict[str, Any]
    manifest_sha256: str  # sha256 of manifest.json: one checksum for the whole bundle
    files: dict[str, bytes]  # relative path -> contents


def read_bundle(folder: str | Path) -> Bundle:
    """Read manifest.json and every file it lists; refuse anything missing or not matching its checksum."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BundleError(f"{folder}: bundle folder not found")
    manifest_path = folder / "manifest.json"
    try:
        raw = manifest_path.read_bytes()
    except OSError as e:
        raise BundleError(f"{manifest_path}: cannot read the bundle manifest ({e.strerror})") from None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{manifest_path}: not valid JSON ({e})") from None
    _check_manifest(manifest, manifest_path)
    files = {}
    for rel, expected in manifest["files"].items():
        path = folder / rel
        try:
            data = path.read_bytes()
        except OSError as e:
            raise BundleError(f"{path}: listed in {manifest_path.name} but cannot be read ({e.strerror})") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected.lower():
            raise BundleError(f"{path}: checksum mismatch: manifest says sha256 {expected}, file has {actual} "
                              "(corrupt or modified bundle; re-export it)")
        files[rel] = data
    return Bundle(folder, manifest, hashlib.sha256(raw).hexdigest(), files)


def _check_manifest(m: Any, path: Path) -> None:
    if not isinstance(m, dict):
        raise BundleError(f"{path}: expected a JSON object")
    if m.get("format") != 1:
        raise BundleError(f"{path}: field 'format' must be 1, got {m.get('format')!r}")
    if m.get("task") != "sentiment-classification":
        raise BundleError(f"{path}: field 'task' must be 'sentiment-classification', got {m.get('task')!r}")
    labels = m.get("labels")
    if (not isinstance(labels, list) or len(labels) < 2 or len(set(labels)) != len(labels)
            or not all(isinstance(x, str) and x for x in labels)):
        raise BundleError(f"{path}: field 'labels' must list at least 2 distinct non-empty names, got {labels!r}")
    max_len = m.get("max_len")
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 3:
        raise BundleError(f"{path}: field 'max_len' must be an int >= 3, got {max_len!r}")
    if m.get("special_ids", SPECIALS) != SPECIALS:
        raise BundleError(f"{path}: field 'special_ids' must be {SPECIALS}, got {m.get('special_ids')!r}")
    files = m.get("files")
    if not isinstance(files, dict):
        raise BundleError(f"{path}: field 'files' must map file names to sha256 checksums, got {files!r}")
    for rel in REQUIRED_FILES:
        if rel not in files:
            raise BundleError(f"{path}: field 'files' lacks {rel!r}: every bundle file must have a checksum")
    for rel, digest in files.items():
        p = PurePosixPath(rel)
        if p.is_absolute() or ".." in p.parts or "\\" in rel:
            raise BundleError(f"{path}: files entry {rel!r} must be a relative path inside the bundle")
        if not isinstance(digest, str) or len(digest) != 64:
            raise BundleError(f"{path}: files[{rel!r}] must be a 64-digit sha256, got {digest!r}")


def _cuda_driver_present() -> bool:
    """True when the CUDA driver library loads. onnxruntime-gpu lists CUDAExecutionProvider as available even on
    machines without a GPU (and logs an error when asked for it), so 'auto' asks only where a driver exists."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _providers(device: Device) -> list[str]:
    if device == "cpu":
        return [CPU]
    if device == "cuda":
        return [CUDA, CPU]
    if device == "auto":
        return [CUDA, CPU] if CUDA in ort.get_available_providers() and _cuda_driver_present() else [CPU]
    raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")


class Predictor:
    """Tokenizer + onnxruntime session for one bundle. Thread-safe: `infer` may be called concurrently."""

    def __init__(
        self,
        bundle: str | Path,
        *,
        device: Device = "auto",
        intra_op_threads: int = 0,
        inter_op_threads: int = 0,
        optimization: Optimization | None = None,
        spinning: bool = False,
    ) -> None:
        """device: 'auto' (CUDA when usable, else CPU), 'cpu', or 'cuda' (an error if CUDA cannot load).
        intra_op_threads / inter_op_threads: onnxruntime thread pools (0 = its default: one per core).
        optimization: graph optimization level; None = the level the bundle was validated at (manifest
        runtime.graph_optimization_level), else 'basic' ('all' measured slower on this CPU, STACK.md).
        spinning: let idle onnxruntime threads spin between runs; off by default because a server's cores are
        shared with its gRPC threads (and here with the client): spinning threads take their time."""
        if optimization is not None and optimization not in _OPT_LEVELS:
            raise ConfigError(f"optimization must be one of {list(_OPT_LEVELS)}, got {optimization!r}")
        if intra_op_threads < 0 or inter_op_threads < 0:
            raise ConfigError(f"thread counts must be >= 0, got intra {intra_op_threads}, inter {inter_op_threads}")
        b = read_bundle(bundle)
        self.bundle_dir = b.folder
        self.manifest = b.manifest
        self.bundle_sha256 = b.manifest_sha256
        self.labels: list[str] = list(b.manifest["labels"])
        self.max_len: int = b.manifest["max_len"]
        self.precision: str = str(b.manifest.get("precision", "fp32"))
        tok_files = {name: b.files[f"tokenizer/{name}"] for name in ("spm.model", "vocab.txt", "tokenizer.json")}
        self.tokenizer = Tokenizer.from_bytes(tok_files, b.folder / "tokenizer", max_len=self.max_len)

        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = inter_op_threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        if optimization is None:
            runtime = b.manifest.get("runtime")
            level = runtime.get("graph_optimization_level") if isinstance(runtime, dict) else None
            optimization = level if level in _OPT_LEVELS else "basic"
        self.optimization: str = optimization
        options.graph_optimization_level = _OPT_LEVELS[optimization]
        try:
            # From the verified bytes: the file on disk could change after the checksum check.
            self.session = ort.InferenceSession(b.files["model.onnx"], options, providers=_providers(device))
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph/... types
            raise BundleError(f"{b.folder / 'model.onnx'}: onnxruntime cannot load it ({e})") from None
        # The provider actually in use: get_available_providers() and a silent CPU fallback both lie.
        self.provider: str = self.session.get_providers()[0]
        if device == "cuda" and self.provider != CUDA:
            raise ConfigError(f"device='cuda' but onnxruntime runs on {self.provider}: CUDA cannot load here "
                              "(see the onnxruntime log above)")
        self._check_graph(b.folder / "model.onnx")
        self._lock = threading.Lock()
        self._runs = 0
        log.info("loaded bundle %s (sha256 %s, %s, max_len %d, labels %s, graph optimization %s) on %s",
                 b.folder, self.bundle_sha256[:12], self.precision, self.max_len, self.labels, optimization,
                 self.provider)

    def _check_graph(self, path: Path) -> None:
        """The graph takes input_ids/attention_mask and gives logits (B, C) with C = len(labels)."""
        inputs = {i.name for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        if inputs != {"input_ids", "attention_mask"} or "logits" not in outputs:
            raise BundleError(f"{path}: expected inputs input_ids, attention_mask and output logits; "
                              f"got inputs {sorted(inputs)}, outputs {outputs}")
        # A warm-up run that also proves the output width matches the labels.
        ids = np.array([[0, 4, 2]], dtype=np.int64)  # (1, 3)
        (logits,) = self.session.run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        if logits.shape != (1, len(self.labels)):
            raise BundleError(f"{path}: logits shape {logits.shape} for 1 text, expected (1, {len(self.labels)}) "
                              f"for labels {self.labels}")

    @property
    def runs(self) -> int:
        """onnxruntime runs made by `infer` so far (tests use it to prove batching)."""
        return self._runs

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        return [self.tokenizer.encode(t) for t in texts]

    def infer(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        """One onnxruntime run over right-padded rows of ids -> (n, C) float32 probabilities."""
        n, T = len(rows), max(r.shape[0] for r in rows)
        ids = np.full((n, T), PAD, dtype=np.int64)  # (n, T)
        mask = np.zeros((n, T), dtype=np.int64)  # (n, T), 1 = real token
        for i, r in enumerate(rows):
            ids[i, : r.shape[0]] = r
            mask[i, : r.shape[0]] = 1
        (logits,) = self.session.run(["logits"], {"input_ids": ids, "attention_mask": mask})  # (n, C)
        with self._lock:
            self._runs += 1
        return softmax(logits)

    def predictions(self, encoded: Sequence[Encoded], probabilities: np.ndarray) -> list[Prediction]:
        """Pair each encoded text with its (C,) probability row."""
        out = []
        for e, p in zip(encoded, probabilities, strict=True):
            k = int(np.argmax(p))
            out.append(Prediction(self.labels[k], k, p, e.token_count, e.truncated))
        return out

    def predict(self, texts: Sequence[str]) -> list[Prediction]:
        """Texts -> predictions in one onnxruntime run (the in-process reference the server must equal)."""
        encoded = self.encode(texts)
        return self.predictions(encoded, self.infer([e.ids for e in encoded]))


def softmax(logits: np.ndarray) -> np.ndarray:
    """(n, C) -> (n, C) float32; the row max is subtracted first so exp never overflows."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
