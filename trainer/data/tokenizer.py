"""Sentencepiece pieces -> the project's token ids, for the lab's model and for models trained on a user's corpus.

The ids, the sequence layout and the tokenizer folder are the contract's (contract/tokens.py, which the server
runs too): <sos>=0 <pad>=1 <eos>=2 <oov>=3, the piece on line i (0-based) of vocab.txt has id i + 4, a sequence is
[<sos>] + piece ids + [<eos>] cut to max_len ids. This module adds where a vocabulary comes from, decoding, and the
lab's pre-tokenized pieces.

Two sources, one encode API:
- `Tokenizer.from_lab(model, dict.txt, max_len)`: the lab's sentencepiece.french.model and its fairseq dict.txt
  ("piece count" lines; line i is id i + 4), so the lab's ids are reproduced exactly (cls-books-fr in the data
  sets holds both files and the lab's pre-tokenized .spm reviews).
- `Tokenizer.train(corpus, vocab_size, ...)`: a new BPE sentencepiece model learned in-process (nothing written to
  the working directory) on a user's raw text; vocab.txt holds exactly `vocab_size` pieces, so the model needs
  `vocab_size + 4` ids.

Saved as the `tokenizer/` folder (spm.model, vocab.txt, meta.json) that travels with every artifact and bundle. The
folder holds no cut: `load` takes it (an artifact's is its config's tokenizer.max_len, `Artifact.tokenizer`).
This module needs sentencepiece and numpy only (no torch).
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
import random
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from contract.errors import TokenizerError
from contract.tokens import (
    EOS,
    N_SPECIALS,
    OOV,
    PAD,
    SOS,
    SPECIAL_PIECES,
    TOKENIZER_FILES,
    TOKENIZER_META,
    Kind,
    TokenEncoder,
    TokenizerMeta,
    meta_path,
    read_tokenizer_files,
    text_lines,
)
from trainer.atomic import temp_dir
from trainer.config.schema import RunConfig, check_tokenizer
from trainer.data.readers import Example, detokenize, expand_inputs, iter_texts

__all__ = ["Tokenizer", "TokenizerError", "build_tokenizer", "detokenize"]

# Sentencepiece training. BPE like the lab's own model (its trainer_spec says model_type BPE); its result does not
# depend on the thread count, and a fixed count keeps the model bytes (which record it) identical across machines.
TRAIN_THREADS = 2
CHARACTER_COVERAGE = 0.9995  # rarer characters become <oov> instead of taking vocabulary rows
MAX_SENTENCE_BYTES = 1 << 16  # spm silently skips longer lines; the longest IMDB review is ~14k bytes


class Tokenizer:
    """Text or pre-tokenized pieces -> [<sos>] + ids + [<eos>], cut to `max_len`."""

    SOS = SOS
    PAD = PAD
    EOS = EOS
    OOV = OOV

    def __init__(self, model_proto: bytes, pieces: list[str], kind: Kind, max_len: int) -> None:
        """`pieces[i]` gets id i + 4. Prefer `from_lab`, `train` or `load`."""
        if kind not in ("lab", "train"):
            raise TokenizerError(f"tokenizer kind must be 'lab' or 'train', got {kind!r}")
        self._encoder = TokenEncoder(model_proto, pieces, max_len)  # checks max_len, the proto and the pieces
        self._sp = self._encoder.processor
        self._model_proto = bytes(model_proto)
        self.pieces = self._encoder.pieces
        self.kind: Kind = kind
        self.vocab_size = self._encoder.vocab_size
        self._piece_to_id = self._encoder.piece_to_id
        # Decoding: our id -> spm id (specials and pieces the model lacks -> spm's <unk>, printed " ⁇ ").
        unk = self._sp.unk_id()
        self._id_to_spm = np.full(self.vocab_size, unk, dtype=np.int64)
        for i, p in enumerate(self.pieces):
            s = self._sp.piece_to_id(p)
            if s != unk:
                self._id_to_spm[i + N_SPECIALS] = s

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, max_len={self.max_len})"

    @property
    def max_len(self) -> int:
        """The longest sequence it returns, <sos> and <eos> included: set when it is built (`from_lab`, `train`,
        `load`), changed only by `with_max_len`."""
        return self._encoder.max_len

    def with_max_len(self, max_len: int) -> Tokenizer:
        """This tokenizer cutting at `max_len` instead (an export's --max-len; no cut: a max_len beyond any text)."""
        other = copy.copy(self)
        other._encoder = self._encoder.with_max_len(max_len)
        return other

    # ------------------------------------------------------------------------------------------ encoding
    # The cut is contract.tokens.TokenEncoder's (`wrap`), the server's own: these only feed it.

    def piece_ids(self, texts: Sequence[str], threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Piece ids of many texts, no specials and no cut: (flat ids int64 (N,), lengths int64 (len(texts),)).
        The building block of trainer/data/corpus.py (one sentencepiece call on `threads` threads; default: the
        cores, at most 8; a pool of worker processes passes 1, being the parallelism itself)."""
        return self._encoder.piece_ids(texts, threads)

    def encode(self, text: str) -> list[int]:
        """Raw text -> [<sos>] + ids + [<eos>], at most `max_len` ids."""
        return self._encoder.encode(text).ids.tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts at once (threaded): each [<sos>] + ids + [<eos>], at most `max_len` ids."""
        return [e.ids.tolist() for e in self._encoder.encode_many(texts, threads=None)]

    def encode_pieces(self, pieces: Sequence[str]) -> list[int]:
        """Pre-tokenized pieces (a line of the lab's .spm files) -> [<sos>] + ids + [<eos>]; unknown -> <oov>."""
        get, oov = self._piece_to_id.get, self.OOV
        ids = np.fromiter((get(p, oov) for p in pieces), dtype=np.int64, count=len(pieces))
        return self._encoder.wrap(ids).ids.tolist()

    def encode_example(self, ex: Example) -> list[int]:
        """An `Example` from trainer.data.readers: its text, or its pieces.

        Pieces come from the lab's sentencepiece model, so only a `lab` tokenizer maps them directly; a trained
        tokenizer re-encodes their detokenized text (for the lab's files that equals the .txt sibling exactly)."""
        if ex.text is not None:
            return self.encode(ex.text)
        if ex.pieces is None:
            raise ValueError(f"{ex.source}: example has neither text nor pieces")
        if self.kind == "lab":
            return self.encode_pieces(ex.pieces)
        return self.encode(detokenize(ex.pieces))

    # ------------------------------------------------------------------------------------------ decoding

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; <sos>/<pad>/<eos> are skipped, <oov> prints as sentencepiece's " ⁇ "."""
        keep = [int(i) for i in ids if int(i) not in (self.SOS, self.PAD, self.EOS)]
        bad = [i for i in keep if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._sp.decode(self._id_to_spm[np.asarray(keep, dtype=np.int64)].tolist())

    def id_to_piece(self, i: int) -> str:
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"id {i} is outside the vocabulary [0, {self.vocab_size})")
        return SPECIAL_PIECES[i] if i < N_SPECIALS else self.pieces[i - N_SPECIALS]

    def piece_to_id(self, piece: str) -> int:
        """A vocabulary piece's id; anything else (special names included) is <oov>."""
        return self._piece_to_id.get(piece, self.OOV)

    @property
    def case_fold(self) -> bool:
        """Whether its model folds case before cutting pieces (its normalizer is one of sentencepiece's *_cf rules)."""
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self._model_proto)
        return proto.normalizer_spec.name.endswith("_cf")

    @property
    def fingerprint(self) -> str:
        """sha256 of the model bytes and the vocabulary: equal fingerprints give equal piece ids."""
        h = hashlib.sha256(self._model_proto)
        h.update("\n".join(self.pieces).encode("utf-8"))
        return h.hexdigest()

    # ------------------------------------------------------------------------------------------ constructors

    @classmethod
    def from_lab(cls, model_path: str | Path, dict_path: str | Path, max_len: int = 512) -> Tokenizer:
        """The lab's sentencepiece model + fairseq dict.txt ("piece count" per line; line i -> id i + 4)."""
        model_path, dict_path = Path(model_path), Path(dict_path)
        proto = _read_bytes(model_path, "sentencepiece model")
        pieces = []
        for lineno, line in text_lines(_read_bytes(dict_path, "fairseq dictionary"), dict_path):
            if line.endswith(" #fairseq:overwrite"):  # fairseq's only flag; the lab's dict has none
                line = line[: -len(" #fairseq:overwrite")]
            piece, sep, count = line.rpartition(" ")
            if not sep or not piece or not count.isdigit():
                raise TokenizerError(f"{dict_path}:{lineno}: expected 'piece count', got {line[:80]!r}")
            pieces.append(piece)
        if not pieces:
            raise TokenizerError(f"{dict_path}: file is empty")
        try:
            return cls(proto, pieces, "lab", max_len)
        except TokenizerError as e:
            raise TokenizerError(f"{model_path} + {dict_path}: {e}") from None

    @classmethod
    def train(
        cls,
        source: Iterable[str] | Sequence[os.PathLike] | os.PathLike,
        vocab_size: int,
        max_len: int = 512,
        train_lines: int = 200_000,
        seed: int = 0,
        case_fold: bool = False,
    ) -> Tokenizer:
        """Learn a BPE sentencepiece model with `vocab_size` pieces (ids: vocab_size + 4) on raw text.

        `source` is a list of file paths given as `pathlib.Path` (read with trainer.data.readers, any supported format,
        .spm pieces detokenized), or any iterable of text strings. At most `train_lines` non-blank lines are used,
        drawn by a seeded reservoir sample, so the model depends only on (input, vocab_size, train_lines, seed).
        case_fold: the model's normalizer folds case (NFKC then case folding, sentencepiece's nmt_nfkc_cf) before
        learning and before every encoding, wherever the model is loaded (the server's encoder too)."""
        if vocab_size < 8:
            raise TokenizerError(f"vocab_size must be >= 8, got {vocab_size}")
        texts = _iter_source(source)
        sample = _reservoir(texts, train_lines, seed)
        if not sample:
            raise TokenizerError("cannot train a tokenizer on an empty corpus (no non-blank lines)")
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sample),
                model_writer=model,
                model_type="bpe",
                vocab_size=vocab_size + 1,  # + spm's <unk> (id 0), which is not written to vocab.txt
                character_coverage=CHARACTER_COVERAGE,
                normalization_rule_name="nmt_nfkc_cf" if case_fold else "nmt_nfkc",  # nmt_nfkc: spm's default
                byte_fallback=False,
                unk_id=0,  # spm needs an unknown piece; <s>, </s> and <pad> are ours, so spm has none of them
                bos_id=-1,
                eos_id=-1,
                pad_id=-1,
                input_sentence_size=0,  # we sampled already (deterministically)
                shuffle_input_sentence=False,
                max_sentence_length=MAX_SENTENCE_BYTES,
                num_threads=TRAIN_THREADS,
                minloglevel=2,  # errors only; spm logs every step otherwise
            )
        except RuntimeError as e:
            raise TokenizerError(
                f"sentencepiece could not learn {vocab_size} pieces from {len(sample)} lines: {e}"
            ) from None
        proto = model.getvalue()
        sp = spm.SentencePieceProcessor(model_proto=proto)
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_unknown(i)]
        if len(pieces) != vocab_size:  # hard_vocab_limit makes spm fail instead, but keep the contract checked
            raise TokenizerError(f"sentencepiece learned {len(pieces)} pieces, asked for {vocab_size}")
        return cls(proto, pieces, "train", max_len)

    # ------------------------------------------------------------------------------------------ folder I/O

    def save(self, folder: str | Path) -> Path:
        """Write the tokenizer/ folder atomically: built in a temp sibling, then renamed over `folder`."""
        folder = Path(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_dir(folder.parent, f".{folder.name}.")
        try:
            (tmp / "spm.model").write_bytes(self._model_proto)
            (tmp / "vocab.txt").write_text("".join(p + "\n" for p in self.pieces), encoding="utf-8")
            meta = TokenizerMeta(self.kind, self.vocab_size)
            (tmp / TOKENIZER_META).write_text(meta.to_json(), encoding="utf-8")
            for name in TOKENIZER_FILES:
                with open(tmp / name, "rb") as f:
                    os.fsync(f.fileno())
            if folder.exists():  # a directory cannot be replaced in one rename: move the old one aside first
                old = temp_dir(folder.parent, f".{folder.name}.old.")
                os.replace(folder, old / folder.name)
                os.replace(tmp, folder)
                shutil.rmtree(old)
            else:
                os.replace(tmp, folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return folder

    @classmethod
    def load(cls, folder: str | Path, max_len: int) -> Tokenizer:
        """Read a tokenizer/ folder, checking it against its own meta.json (tokenizer.json in a folder written
        before the rename), to cut at `max_len`."""
        folder = Path(folder)
        if not folder.is_dir():
            raise TokenizerError(f"tokenizer folder not found: {folder}")
        paths = {n: folder / n for n in TOKENIZER_FILES}
        paths[TOKENIZER_META] = meta_path(folder)
        missing = [n for n, p in paths.items() if not p.is_file()]
        if missing:
            raise TokenizerError(
                f"{folder}: missing {', '.join(missing)} (a tokenizer folder holds {', '.join(TOKENIZER_FILES)})"
            )
        return cls.from_files({n: p.read_bytes() for n, p in paths.items()}, folder, max_len)

    @classmethod
    def from_files(cls, files: Mapping[str, bytes], folder: Path, max_len: int) -> Tokenizer:
        """The tokenizer of a folder's three files' bytes (a verified bundle's, for one), cutting at `max_len`;
        `folder` names them."""
        tf = read_tokenizer_files(files, folder)
        try:
            return cls(tf.model_proto, tf.pieces, tf.meta.kind, max_len)
        except TokenizerError as e:
            raise TokenizerError(f"{folder}: {e}") from None


# ---------------------------------------------------------------------------------------------- helpers


def _read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise TokenizerError(f"{what} {path} is a directory, expected a file") from None


def _iter_source(source: Iterable[str] | Sequence[os.PathLike] | os.PathLike) -> Iterator[str]:
    """Texts of a training source: files (PathLike) are streamed through trainer.data.readers, strings are texts."""
    if isinstance(source, os.PathLike):
        source = [source]
    items = list(source) if isinstance(source, (list, tuple)) else None
    if items and all(isinstance(p, os.PathLike) for p in items):
        for path in items:
            for ex in iter_texts(Path(path)):
                yield ex.text if ex.text is not None else detokenize(ex.pieces or [])
        return
    for text in items if items is not None else source:
        if not isinstance(text, str):
            raise TokenizerError(f"training texts must be str (file paths must be pathlib.Path), got {type(text)}")
        yield text


def _reservoir(texts: Iterable[str], k: int, seed: int) -> list[str]:
    """At most k non-blank texts, uniformly sampled in one streaming pass (Algorithm R), seeded; input order kept."""
    if k < 1:
        raise TokenizerError(f"train_lines must be >= 1, got {k}")
    rng = random.Random(seed)
    sample: list[tuple[int, str]] = []
    n = 0
    for text in texts:
        if not text.strip():
            continue
        if len(sample) < k:
            sample.append((n, text))
        else:
            j = rng.randrange(n + 1)
            if j < k:
                sample[j] = (n, text)
        n += 1
    sample.sort()
    return [t for _, t in sample]


def build_tokenizer(cfg: RunConfig) -> Tokenizer:
    """The tokenizer a config asks for: the lab's (kind=lab) or one trained on `data.pretrain` (kind=train).

    .spm inputs are detokenized for training (`detokenize`, equal to the lab's .txt files). The model's embedding
    must match (config.check_tokenizer; a trained one's size was checked with the config, before training). It cuts
    at tokenizer.max_len."""
    tc = cfg.tokenizer
    if tc.kind == "lab":
        tok = Tokenizer.from_lab(cfg.data.path(tc.model), cfg.data.path(tc.vocab), tc.max_len)
    else:
        paths = expand_inputs([cfg.data.path(p) for p in cfg.data.pretrain])  # globs too
        texts = (ex.text if ex.text is not None else detokenize(ex.pieces or [])  # data.text_field's column
                 for p in paths for ex in iter_texts(p, cfg.data.text_field))
        tok = Tokenizer.train(texts, tc.vocab_size, tc.max_len, tc.train_lines, cfg.seed, tc.case_fold)
    check_tokenizer(tok.vocab_size, cfg, f"the {tc.kind} tokenizer")
    return tok
