"""The one bundle verifier: `trainer export --check` and the server's Predictor both call `verify_bundle`.

It reads manifest.json and every file it lists once, checks each file's sha256, the tokenizer files against each
other, and model.onnx's signature against the declared one (contract/graph.py) and the manifest. What it returns
are those verified bytes, so nothing can change between the check and the load. Every problem is a BundleError
naming the file. `check_session` then runs the graph once, as onnxruntime will serve it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from contract.errors import BundleError, TokenizerError
from contract.graph import ATTENTION_MASK, INPUT_IDS, LOGITS, as_dicts, expected_io, io_spec
from contract.manifest import MANIFEST_FILE, MODEL_FILE, TOKENIZER_DIR, Manifest, read_manifest
from contract.tokens import EOS, N_SPECIALS, SOS, TOKENIZER_FILES, TokenizerFiles, read_tokenizer_files


@dataclass(frozen=True)
class Bundle:
    """A verified bundle: its manifest and the bytes of every file, as they matched it."""

    folder: Path
    manifest: Manifest
    manifest_sha256: str  # sha256 of manifest.json's bytes, which hold every file's sha256
    files: dict[str, bytes]  # bundle-relative path -> contents
    tokenizer: TokenizerFiles

    @property
    def model_bytes(self) -> bytes:
        return self.files[MODEL_FILE]


def verify_bundle(folder: str | Path) -> Bundle:
    """Read and check a bundle folder; BundleError names the first problem's file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BundleError(f"{folder}: bundle folder not found")
    manifest_path = folder / MANIFEST_FILE
    try:
        raw = manifest_path.read_bytes()
    except OSError as e:
        raise BundleError(f"{manifest_path}: cannot read the bundle manifest ({e.strerror}; not a bundle, or an "
                          "interrupted export)") from None
    manifest = read_manifest(raw, manifest_path)
    files = {}
    for rel, expected in manifest.files.items():
        path = folder / rel
        try:
            data = path.read_bytes()
        except OSError as e:
            raise BundleError(f"{path}: listed in {MANIFEST_FILE} but cannot be read ({e.strerror})") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise BundleError(f"{path}: checksum mismatch: {MANIFEST_FILE} says sha256 {expected}, the file has "
                              f"{actual} (corrupt or modified bundle; export it again)")
        files[rel] = data
    tokenizer_dir = folder / TOKENIZER_DIR
    try:
        tokenizer = read_tokenizer_files({n: files[f"{TOKENIZER_DIR}/{n}"] for n in TOKENIZER_FILES}, tokenizer_dir)
    except TokenizerError as e:
        raise BundleError(str(e)) from None
    _check_graph(files[MODEL_FILE], manifest, folder / MODEL_FILE, manifest_path)
    return Bundle(folder, manifest, hashlib.sha256(raw).hexdigest(), files, tokenizer)


def _check_graph(model: bytes, manifest: Manifest, model_path: Path, manifest_path: Path) -> None:
    """model.onnx has the declared signature for len(labels) classes, and the manifest describes it as it is."""
    try:
        graph = onnx.load_model_from_string(model)
        got_in, got_out = io_spec(graph.graph.input), io_spec(graph.graph.output)
    except Exception as e:  # protobuf's DecodeError, onnx's errors on unknown types
        raise BundleError(f"{model_path}: not a readable ONNX model ({type(e).__name__}: {e})") from None
    if manifest.inputs != got_in or manifest.outputs != got_out:
        raise BundleError(f"{manifest_path}: inputs {as_dicts(manifest.inputs)} / outputs "
                          f"{as_dicts(manifest.outputs)} do not match {MODEL_FILE}'s {as_dicts(got_in)} / "
                          f"{as_dicts(got_out)}")
    classes = got_out[0].shape[-1] if len(got_out) == 1 and got_out[0].shape else None
    want_in, want_out = expected_io(classes if isinstance(classes, int) else 0)
    if got_in != want_in or got_out != want_out:
        raise BundleError(f"{model_path}: inputs {as_dicts(got_in)} / outputs {as_dicts(got_out)} differ from the "
                          f"declared {as_dicts(want_in)} / {as_dicts(want_out)}")
    if classes != len(manifest.label_names):
        raise BundleError(f"{model_path}: logits has {classes} classes but {MANIFEST_FILE} lists "
                          f"{len(manifest.label_names)} labels {manifest.label_names}")


def check_session(session: ort.InferenceSession, bundle: Bundle) -> None:
    """One run of the graph as it will be served: (1, 3) ids -> (1, classes) logits."""
    ids = np.array([[SOS, N_SPECIALS, EOS]], dtype=np.int64)  # (1, 3)
    path = bundle.folder / MODEL_FILE
    try:
        (logits,) = session.run([LOGITS], {INPUT_IDS: ids, ATTENTION_MASK: np.ones_like(ids)})
    except Exception as e:  # onnxruntime's Fail, InvalidArgument, ...
        raise BundleError(f"{path}: onnxruntime cannot run it on a (1, 3) batch ({e})") from None
    n = len(bundle.manifest.label_names)
    if logits.shape != (1, n):
        raise BundleError(f"{path}: logits shape {logits.shape} for 1 text, expected (1, {n}) for labels "
                          f"{bundle.manifest.label_names}")
