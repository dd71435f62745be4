"""A prepared corpus: the pretraining text tokenized once into memory-mapped shards (trainer/data/prepare.py writes it).

Layout of a prepared folder (FORMAT 1):
  manifest.json      what made it (format, the tokenizer's fingerprint and files, vocab_size, dtype, shard_tokens,
                     the inputs with their sizes, the text column), then per shard: its files, documents, tokens,
                     the sha256 of both files and where its input ends ("end": [file index, line or row]).
                     "complete": false while a prepare runs or after one was killed (run it again to resume).
  tokenizer/         the tokenizer that made the ids (spm.model, vocab.txt, meta.json), checksummed too.
  shard-00000.bin    token ids, uint16 below 65,536 ids, else uint32; each document as the tokenizer contract frames
                     it, [<sos>] + piece ids + [<eos>], documents back to back, never cut to max_len.
  shard-00000.idx    int64 (documents + 1,) offsets of the shard's documents in its .bin (first 0, last its tokens).
A shard closes at the first document end at or past `shard_tokens` tokens: documents never straddle shards, and a
killed prepare resumes at a shard boundary by skipping whole input files and lines, not re-tokenizing them.

Reading (`PreparedCorpus`): the shards are one token stream, read through np.memmap. A rank holds a table of
O(shards) numbers; the token and offset pages are file-backed and shared by every rank of a node (they are not
anonymous memory), and a rank maps only the shards its windows touch. Nothing is unpickled: JSON and raw arrays.
Layers: trainer/data/readers.py reads files, trainer/data/tokenizer.py makes ids, this module keeps them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from contract.tokens import EOS, SOS, TOKENIZER_FILES
from trainer.atomic import sha256_file, write_bytes_atomic
from trainer.data.readers import DataError, Example, detokenize
from trainer.data.tokenizer import Tokenizer

FORMAT = 1
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"


class PreparedError(DataError):
    """A prepared folder is missing, incomplete, damaged, or made by another tokenizer or from other inputs."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def encode_documents(batch: list[Example], tokenizer: Tokenizer, threads: int | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Documents -> (framed ids int64 (sum(len_i + 2),), framed lengths int64 (n,)): [<sos>] + pieces + [<eos>] each,
    not cut. Texts go through one sentencepiece call; the lab's .spm pieces map directly under the lab's tokenizer
    (its own model made them) and are detokenized for any other."""
    if tokenizer.kind == "lab" and all(ex.pieces is not None for ex in batch):
        docs = [[tokenizer.piece_to_id(p) for p in ex.pieces or []] for ex in batch]
        lens = np.array([len(d) for d in docs], dtype=np.int64)
        ids = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.int64, count=int(lens.sum()))
    else:
        ids, lens = tokenizer.piece_ids([ex.text if ex.text is not None else detokenize(ex.pieces or [])
                                         for ex in batch], threads)
    framed = np.empty(len(ids) + 2 * len(lens), dtype=np.int64)
    ends = np.cumsum(lens + 2)  # (n,) end of each framed document
    body = np.ones(len(framed), dtype=bool)
    body[ends - lens - 2] = body[ends - 1] = False
    framed[ends - lens - 2], framed[ends - 1] = SOS, EOS
    framed[body] = ids
    return framed, lens + 2


# ---------------------------------------------------------------------------------------------- files


class ShardWriter:
    """The shard being written: ids stream to a hidden temp file, hashed as they go; `close` renames it into place."""

    def __init__(self, folder: Path, index: int, dtype: np.dtype) -> None:
        self.folder, self.index, self.dtype = folder, index, dtype
        self.name = f"shard-{index:05d}"
        self.tmp = folder / f".{self.name}.bin.tmp"
        self.file = open(self.tmp, "wb")
        self.hash = hashlib.sha256()
        self.lengths: list[np.ndarray] = []
        self.tokens = 0
        self.end = (0, 0)  # (file index, line) of its last document

    def add(self, ids: np.ndarray, lengths: np.ndarray, end: tuple[int, int]) -> None:
        data = ids.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.lengths.append(lengths)
        self.tokens += len(ids)
        self.end = end

    def close(self) -> dict[str, Any]:
        """fsync, write the .idx, rename the .bin into place; returns the shard's manifest entry."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        offsets = np.zeros(1 + sum(len(x) for x in self.lengths), dtype=np.int64)  # (documents + 1,)
        if self.lengths:
            np.cumsum(np.concatenate(self.lengths), out=offsets[1:])
        idx = offsets.tobytes()
        write_bytes_atomic(self.folder / f"{self.name}.idx", idx)
        os.replace(self.tmp, self.folder / f"{self.name}.bin")
        return {"bin": f"{self.name}.bin", "idx": f"{self.name}.idx", "documents": len(offsets) - 1,
                "tokens": self.tokens, "sha256_bin": self.hash.hexdigest(),
                "sha256_idx": hashlib.sha256(idx).hexdigest(), "end": list(self.end)}

    def discard(self) -> None:
        self.file.close()
        os.remove(self.tmp)


# ---------------------------------------------------------------------------------------------- manifest


def read_manifest(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise PreparedError(f"{path}: not found (a prepared folder is made by `python -m trainer prepare`)")
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PreparedError(f"{path}: not a readable manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else None
        raise PreparedError(f"{path}: format {got!r} is not supported (this code reads format {FORMAT})")
    _check_fields(m, path)
    return m


def _check_fields(m: dict[str, Any], path: Path) -> None:
    """A folder crosses nodes and people: every field the readers use, typed, and every file it names a plain name
    inside the folder, so that a tampered manifest is one line and no rank maps a file outside it."""
    def name(value: object, where: str) -> None:
        if not isinstance(value, str) or not value or value in (".", "..") or "/" in value or "\\" in value:
            raise PreparedError(f"{path}: {where} {value!r}: not a file name inside the folder")

    def count(value: object, where: str) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PreparedError(f"{path}: {where} {value!r}: not a count")

    if m.get("dtype") not in ("uint16", "uint32"):
        raise PreparedError(f"{path}: dtype {m.get('dtype')!r}: not uint16 or uint32")
    for key in ("vocab_size", "tokens", "documents"):
        count(m.get(key), key)
    tokenizer, shards = m.get("tokenizer"), m.get("shards")
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("fingerprint"), str):
        raise PreparedError(f"{path}: tokenizer: no fingerprint")
    files = tokenizer.get("files", {})
    if not isinstance(files, dict):
        raise PreparedError(f"{path}: tokenizer.files: not an object")
    for n, f in files.items():
        name(n, "tokenizer.files")
        if not isinstance(f, dict) or not isinstance(f.get("sha256"), str):
            raise PreparedError(f"{path}: tokenizer.files[{n!r}]: no sha256")
        count(f.get("bytes"), f"tokenizer.files[{n!r}].bytes")
    if not isinstance(shards, list):
        raise PreparedError(f"{path}: shards: not a list")
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict):
            raise PreparedError(f"{path}: shards[{i}]: not an object")
        for key in ("bin", "idx", "tokens", "documents", "sha256_bin", "sha256_idx"):
            if key not in shard:
                raise PreparedError(f"{path}: shards[{i}]: no {key!r}")
        name(shard["bin"], f"shards[{i}].bin")
        name(shard["idx"], f"shards[{i}].idx")
        count(shard["tokens"], f"shards[{i}].tokens")
        count(shard["documents"], f"shards[{i}].documents")


def files_of(manifest: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(relative path, bytes, sha256) of every file a complete folder holds, largest first (shares of a check)."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    out = [(f"{TOKENIZER_DIR}/{n}", f["bytes"], f["sha256"]) for n, f in manifest["tokenizer"]["files"].items()]
    for s in manifest["shards"]:
        out += [(s["bin"], s["tokens"] * itemsize, s["sha256_bin"]), (s["idx"], (s["documents"] + 1) * 8,
                                                                         s["sha256_idx"])]
    return sorted(out, key=lambda f: (-f[1], f[0]))


def verify(folder: str | Path, files: Sequence[tuple[str, int, str]], full: bool = True) -> list[str]:
    """Problems of `files` (from `files_of`) in `folder`, one line each ("FILE: what"); empty when all is well.

    full=False checks presence and sizes (instant); full=True also each file's sha256, which reads every byte (give
    each local rank a share: `files_of(m)[local_rank::local_size]`)."""
    folder = Path(folder)
    problems = []
    for name, size, digest in files:
        path = folder / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{path}: {path.stat().st_size} bytes, the manifest says {size}")
        elif full and sha256_file(path) != digest:
            problems.append(f"{path}: sha256 differs from the manifest's (a different or damaged copy)")
    return problems


def digest(manifest: dict[str, Any]) -> str:
    """sha256 of a manifest's content: two folders with equal digests hold the same ids (checked file by file)."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- reading


class PreparedCorpus:
    """A complete prepared folder as one token stream: shard after shard, through np.memmap."""

    def __init__(self, folder: str | Path, fingerprint: str | None = None) -> None:
        self.folder = Path(folder)
        self.manifest = m = read_manifest(folder)
        if not m.get("complete"):
            raise PreparedError(f"{self.folder}: its prepare did not finish (run the same prepare again to resume)")
        if fingerprint is not None and m["tokenizer"]["fingerprint"] != fingerprint:
            raise PreparedError(f"{self.folder}: made by tokenizer {m['tokenizer']['fingerprint'][:12]}, this run "
                                f"uses {fingerprint[:12]}")
        problems = verify(folder, files_of(m), full=False)
        if problems:
            raise PreparedError(problems[0])
        self.dtype = np.dtype(m["dtype"])
        self.vocab_size = int(m["vocab_size"])
        self.n_tokens, self.n_docs = int(m["tokens"]), int(m["documents"])
        # (S + 1,) where each shard starts in the stream, in tokens and in documents
        self.shard_start = np.concatenate([[0], np.cumsum([s["tokens"] for s in m["shards"]])]).astype(np.int64)
        self.shard_doc = np.concatenate([[0], np.cumsum([s["documents"] for s in m["shards"]])]).astype(np.int64)
        self._maps: dict[str, np.memmap] = {}

    def _map(self, name: str, dtype: np.dtype) -> np.memmap:
        if name not in self._maps:  # opened on first use: a rank maps only the shards its windows touch
            self._maps[name] = np.memmap(self.folder / name, dtype=dtype, mode="r")
        return self._maps[name]

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of the stream, int64 (copied out of the page cache; may span shards)."""
        if not 0 <= a <= b <= self.n_tokens:
            raise IndexError(f"token range [{a}, {b}) outside [0, {self.n_tokens})")
        s = int(np.searchsorted(self.shard_start, a, side="right")) - 1
        parts = []
        while a < b:
            lo, hi = a - self.shard_start[s], min(b, self.shard_start[s + 1]) - self.shard_start[s]
            parts.append(self._map(self.manifest["shards"][s]["bin"], self.dtype)[lo:hi])
            a = int(self.shard_start[s] + hi)
            s += 1
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def doc_start(self, d: int) -> int:
        """Where document d (0 <= d <= documents) begins in the stream (d = documents: the end)."""
        if not 0 <= d <= self.n_docs:
            raise IndexError(f"document {d} outside [0, {self.n_docs}]")
        if d == self.n_docs:
            return self.n_tokens
        s = int(np.searchsorted(self.shard_doc, d, side="right")) - 1
        idx = self._map(self.manifest["shards"][s]["idx"], np.dtype(np.int64))
        return int(self.shard_start[s] + idx[d - self.shard_doc[s]])


def tokenizer_entry(folder: Path, tok: Tokenizer) -> dict[str, Any]:
    """The manifest's "tokenizer" entry of a saved tokenizer folder: fingerprint, and each file's size and sha256."""
    return {"fingerprint": tok.fingerprint,
            "files": {n: {"bytes": (folder / n).stat().st_size, "sha256": sha256_file(folder / n)}
                      for n in TOKENIZER_FILES}}
