"""The one bundle verifier: `trainer export --check` and the server's Predictor both call `verify_bundle`.

A bundle comes from outside, so nothing in it is trusted until checked, cheapest first:
  - manifest.json and every file it lists are regular files inside the folder, read without following a link
    (contract/files.py), each under its size cap (MAX_BYTES);
  - manifest.json is strict JSON, describes a bundle (contract/manifest.py) and matches its own digest;
  - each file matches its sha256 in the manifest, and the tokenizer files agree with each other;
  - each graph file has the declared signature (contract/graph.py), one logit per label, a token embedding with one
    row per id of the tokenizer, a positional table of at least max_len rows, and the metadata_props the manifest
    implies (contract/manifest.py: a graph of another bundle, or with other labels, is refused).
What it returns are the verified bytes, so nothing changes between the check and the load. Every problem is a
BundleError naming the file and the reason, on one line. `check_session` then runs the graph once at its limits.
`bundle_manifest` reads and checks the manifest alone, for a process that sizes itself before its workers load and
verify the bundle (serving/process/workers.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from contract.errors import BundleError, TokenizerError, one_line
from contract.files import Folder
from contract.graph import ATTENTION_MASK, INPUT_IDS, LOGITS, as_dicts, expected_io, io_spec, tables
from contract.manifest import (
    CARD_FILE,
    GRAPH_FILES,
    MANIFEST_FILE,
    MODEL_FILE,
    TOKENIZER_BUNDLE_FILES,
    TOKENIZER_DIR,
    Manifest,
    read_manifest,
)
from contract.tokens import EOS, PAD, SOS, TOKENIZER_FILES, TOKENIZER_META, TokenizerFiles, read_tokenizer_files

# Size caps: far above what this project writes (the lab-size model is 48 MB, its vocabulary 0.5 MB), far below
# what would exhaust a server. Graphs: protobuf cannot parse a message of 2 GiB or more anyway.
MAX_BYTES = {
    MANIFEST_FILE: 1 << 20,
    **dict.fromkeys(GRAPH_FILES, (2 << 30) - 1),
    f"{TOKENIZER_DIR}/spm.model": 64 << 20,
    f"{TOKENIZER_DIR}/{TOKENIZER_META}": 64 << 10,
    f"{TOKENIZER_DIR}/vocab.txt": 64 << 20,
    CARD_FILE: 1 << 20,
}
assert set(MAX_BYTES) == {MANIFEST_FILE, *GRAPH_FILES, *TOKENIZER_BUNDLE_FILES, CARD_FILE}


@dataclass(frozen=True)
class Bundle:
    """A verified bundle: its manifest and the bytes of every file, as they matched it."""

    folder: Path
    manifest: Manifest
    files: dict[str, bytes]  # bundle-relative path -> contents
    tokenizer: TokenizerFiles

    def graph_bytes(self, graph_file: str) -> bytes:
        return self.files[graph_file]

    @property
    def model_card(self) -> str:
        """MODEL_CARD.md as verified ("" in a bundle before format 4, which has none)."""
        return self.files.get(CARD_FILE, b"").decode("utf-8", errors="replace")

    @property
    def bundle_sha256(self) -> str:
        """The manifest's own digest, which covers every file: the bundle's identity."""
        return self.manifest.bundle_sha256


def bundle_manifest(folder: str | Path) -> Manifest:
    """A bundle's manifest alone, checked (what a process reads to size itself before its workers load the bundle);
    BundleError naming the file."""
    folder = Path(folder)
    _refuse_artifact(folder)
    with Folder(folder) as f:
        return read_manifest(f.read(MANIFEST_FILE, MAX_BYTES[MANIFEST_FILE]), folder / MANIFEST_FILE)


def verify_bundle(folder: str | Path) -> Bundle:
    """Read and check a bundle folder; BundleError names the first problem's file."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST_FILE
    _refuse_artifact(folder)
    with Folder(folder) as f:
        manifest = read_manifest(f.read(MANIFEST_FILE, MAX_BYTES[MANIFEST_FILE]), manifest_path)
        files = {}
        for rel, expected in manifest.files.items():
            data = f.read(rel, MAX_BYTES[rel], listed_in=MANIFEST_FILE)
            actual = hashlib.sha256(data).hexdigest()
            if actual != expected:
                raise BundleError(f"{folder / rel}: checksum mismatch: {MANIFEST_FILE} says sha256 {expected}, the "
                                  f"file has {actual} (corrupt or modified bundle; export it again)")
            files[rel] = data
    tokenizer_dir = folder / TOKENIZER_DIR
    try:
        tokenizer = read_tokenizer_files({n: files[f"{TOKENIZER_DIR}/{n}"] for n in TOKENIZER_FILES}, tokenizer_dir)
    except TokenizerError as e:
        raise BundleError(str(e)) from None
    for name in manifest.graphs:
        _check_graph(files[name], name, manifest, tokenizer, folder / name, manifest_path)
    return Bundle(folder, manifest, files, tokenizer)


def _refuse_artifact(folder: Path) -> None:
    """A training artifact where a bundle was expected: the step before a bundle. An unreadable folder is not one:
    Folder names it."""
    try:
        artifact = not (folder / MANIFEST_FILE).exists() and (folder / "artifact.json").is_file()
    except OSError:
        artifact = False
    if artifact:
        raise BundleError(f"{folder} is a training artifact (artifact.json, model.safetensors), not a bundle: export "
                          f"it first: python -m trainer export {folder} --out BUNDLE, then serve BUNDLE")


def _check_graph(model: bytes, name: str, manifest: Manifest, tokenizer: TokenizerFiles, model_path: Path,
                 manifest_path: Path) -> None:
    """A graph file has the declared signature, one logit per label, an embedding row per id, a position per
    token up to max_len, and the metadata the manifest implies; the manifest describes it as it is."""
    try:
        graph = onnx.load_model_from_string(model)
        got_in, got_out = io_spec(graph.graph.input), io_spec(graph.graph.output)
    except Exception as e:  # protobuf's DecodeError, onnx's errors on unknown types
        raise BundleError(f"{model_path}: not a readable ONNX model ({type(e).__name__}: {one_line(e)})") from None
    if manifest.inputs != got_in or manifest.outputs != got_out:
        raise BundleError(f"{manifest_path}: inputs {as_dicts(manifest.inputs)} / outputs "
                          f"{as_dicts(manifest.outputs)} do not match {name}'s {as_dicts(got_in)} / "
                          f"{as_dicts(got_out)}")
    classes = got_out[0].shape[-1] if len(got_out) == 1 and got_out[0].shape else None
    want_in, want_out = expected_io(classes if isinstance(classes, int) else 0)
    if got_in != want_in or got_out != want_out:
        raise BundleError(f"{model_path}: inputs {as_dicts(got_in)} / outputs {as_dicts(got_out)} differ from the "
                          f"declared {as_dicts(want_in)} / {as_dicts(want_out)}")
    if classes != len(manifest.label_names):
        raise BundleError(f"{model_path}: logits has {classes} classes but {MANIFEST_FILE} lists "
                          f"{len(manifest.label_names)} labels {manifest.label_names}")
    t = tables(graph)
    vocab = tokenizer.meta.vocab_size
    if t.embedding_rows is None or t.position_rows is None:
        raise BundleError(f"{model_path}: no token embedding (a Gather of input_ids from a 2-D initializer) or no "
                          "positional table (a Slice of one as wide): not a graph this project exports")
    if t.embedding_rows != vocab:
        raise BundleError(f"{model_path}: its token embedding has {t.embedding_rows} rows but "
                          f"{TOKENIZER_DIR}/{TOKENIZER_META} gives {vocab} ids (a tokenizer of another model)")
    if manifest.max_len > t.position_rows:
        raise BundleError(f"{manifest_path}: max_len {manifest.max_len} exceeds the {t.position_rows} positions "
                          f"of {name}'s positional table")
    got = {p.key: p.value for p in graph.metadata_props}
    want = manifest.graph_metadata(name)
    if got != want or len(graph.metadata_props) != len(got):
        diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k)) or ["a key given twice"]
        raise BundleError(f"{model_path}: its metadata_props differ from {MANIFEST_FILE} on {', '.join(diff)} "
                          f"({diff[0]}: {got.get(diff[0])!r}, expected {want.get(diff[0])!r}): a graph of another "
                          "bundle, or an edited one")


def check_session(session: ort.InferenceSession, bundle: Bundle, graph_file: str = MODEL_FILE) -> None:
    """The warm-up, before a server says SERVING: one run at the bundle's limits, as it will be served. Rows:
    max_len ids with the highest id of the vocabulary, and a short one padded to that width; C logits each, finite.
    The static checks above make this pass; a graph that still fails here fails before any client sees it."""
    m = bundle.manifest
    top = bundle.tokenizer.meta.vocab_size - 1
    ids = np.full((2, m.max_len), PAD, dtype=np.int64)  # (2, max_len)
    ids[0, :] = top
    ids[0, 0], ids[0, -1] = SOS, EOS
    ids[1, :3] = [SOS, top, EOS]
    mask = (np.arange(m.max_len)[None, :] < np.array([[m.max_len], [3]])).astype(np.int64)  # (2, max_len)
    path = bundle.folder / graph_file
    where = f"the warm-up at max_len {m.max_len} with id {top}"
    try:
        (logits,) = session.run([LOGITS], {INPUT_IDS: ids, ATTENTION_MASK: mask})
    except Exception as e:  # onnxruntime's Fail, InvalidArgument, RuntimeException...
        raise BundleError(f"{path}: onnxruntime failed {where} ({one_line(e)})") from None
    n = len(m.label_names)
    if logits.shape != (2, n) or not np.isfinite(logits).all():
        raise BundleError(f"{path}: {where} gave logits of shape {logits.shape} (finite: "
                          f"{bool(np.isfinite(logits).all())}), expected (2, {n}) finite, for labels "
                          f"{m.label_names}")
