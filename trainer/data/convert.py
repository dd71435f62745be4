"""From a set's verified downloads to the files the presets read (trainer/data/sources.py names each set's files).

Every converter reads the folder of downloads `raw` and writes into `out`, a fresh folder that becomes the set's once
SOURCE.json is written (trainer/data/fetch.py). Gzip files are written with no name and mtime 0, so that the same
downloads give the same bytes.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import shutil
import tarfile
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO
from xml.etree import ElementTree

from trainer.data.errors import DataError
from trainer.data.readers import jsonl_records, stream_lines
from trainer.data.sources import DataSet


def build(ds: DataSet, raw: Path, out: Path) -> None:
    CONVERTERS[ds.build](ds, raw, out)


def _gzip_text(path: Path, lines: Iterator[str]) -> None:
    with open(path, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as z:
        w = io.TextIOWrapper(z, encoding="utf-8", newline="\n")
        for line in lines:
            w.write(line + "\n")
        w.flush()
        w.detach()


def _plain_text(path: Path, lines: Iterator[str]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line + "\n")


def cls_books(ds: DataSet, raw: Path, out: Path) -> None:
    """The lab's files as they are, plus each split's reviews detokenized to plain text (`*.review.txt`): the
    sentencepiece pieces of a line decoded with the lab's own model (decoding then encoding gives the pieces back)."""
    import sentencepiece as spm

    for r in ds.remotes:
        shutil.copyfile(raw / r.filename, out / r.filename)
    sp = spm.SentencePieceProcessor(model_file=str(raw / "sentencepiece.french.model"))
    for split in ("train", "valid", "test"):
        lines = (raw / f"{split}.review.spm").read_text(encoding="utf-8").split("\n")
        text = "\n".join(sp.decode_pieces(line.split()) if line else "" for line in lines)
        (out / f"{split}.review.txt").write_text(text, encoding="utf-8", newline="\n")


TEI = "{http://www.tei-c.org/ns/1.0}"
_BLOCKS = {f"{TEI}p", f"{TEI}head", f"{TEI}l"}  # paragraphs, headings, verse lines
_SPACE = re.compile(r"[ \t\r\n]+")  # XML's white space only: a no-break space (U+00A0) is the text's own


def tei_paragraphs(xml: bytes) -> Iterator[str]:
    """The text of each paragraph, heading and verse line of a TEI file's <body> (front and back matter left out),
    in document order, its XML white space collapsed to single spaces; a block inside another is part of it."""
    body = ElementTree.fromstring(xml).find(f"{TEI}text/{TEI}body")
    if body is None:
        raise ValueError("no <text><body>: not an ELTeC level-1 TEI file")

    def walk(el: ElementTree.Element) -> Iterator[str]:
        for child in el:
            if child.tag in _BLOCKS:
                text = _SPACE.sub(" ", " ".join(child.itertext())).strip(" ")
                if text:
                    yield text
            else:
                yield from walk(child)

    yield from walk(body)


def eltec(ds: DataSet, raw: Path, out: Path) -> None:
    """One paragraph a line, the novels in file-name order (`eltec_fra.txt.gz`), and the corpus' metadata table."""
    novels = sorted(r.filename for r in ds.remotes if r.filename.endswith(".xml"))

    def lines() -> Iterator[str]:
        for name in novels:
            try:
                yield from tei_paragraphs((raw / name).read_bytes())
            except (ElementTree.ParseError, ValueError) as e:
                raise ValueError(f"{name}: {e}") from None

    _gzip_text(out / "eltec_fra.txt.gz", lines())
    shutil.copyfile(raw / "ELTeC-fra_metadata.tsv", out / "metadata.tsv")


_REVIEW = re.compile(r"aclImdb/(train|test)/(pos|neg|unsup)/(\d+)_(\d+)\.txt$")


def imdb(ds: DataSet, raw: Path, out: Path) -> None:
    """aclImdb_v1.tar.gz to one JSON object a line per labelled review ({"id", "rating", "label", "orig_dir",
    "text"}; negatives first, then positives, each by id) and one unlabelled review a line (`unsup.txt.gz`, by id)."""
    reviews: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
    with tarfile.open(raw / ds.remotes[0].filename, "r:gz") as tar:
        for member in tar:
            m = _REVIEW.match(member.name)
            if not (m and member.isfile()):
                continue
            text = tar.extractfile(member).read().decode("utf-8")  # type: ignore[union-attr]
            reviews.setdefault((m[1], m[2]), []).append((int(m[3]), int(m[4]), text))
    for split in ("train", "test"):
        def rows(split: str = split) -> Iterator[str]:
            for label, kind in ((0, "neg"), (1, "pos")):
                for id_, rating, text in sorted(reviews.get((split, kind), [])):
                    yield json.dumps({"id": id_, "rating": rating, "label": label, "orig_dir": split, "text": text},
                                     ensure_ascii=False)
        _gzip_text(out / f"{split}.jsonl.gz", rows())
    _gzip_text(out / "unsup.txt.gz", (" ".join(t.split("\n")) for _, _, t in sorted(reviews.get(("train", "unsup"),
                                                                                                    []))))
    counts = {k: len(v) for k, v in reviews.items()}
    if any(counts.get((s, k), 0) == 0 for s in ("train", "test") for k in ("pos", "neg")):
        raise ValueError(f"{ds.remotes[0].filename}: reviews by split and class {counts}: one is empty")


_LEAF = re.compile(r"\(\d ([^()]+)\)")


def sst2(ds: DataSet, raw: Path, out: Path) -> None:
    """The treebank's sentence trees to binary labelled sentences, as SST-2: the root's label 0-1 negative (0), 3-4
    positive (1), 2 (neutral) left out; the sentence is its leaves joined by spaces, lower-cased (GLUE's SST-2
    text). One `label<TAB>sentence` file per split, with that header."""
    with zipfile.ZipFile(raw / ds.remotes[0].filename) as z:
        for split in ("train", "dev", "test"):
            rows = ["label\tsentence"]
            for line in z.read(f"trees/{split}.txt").decode("utf-8").splitlines():
                line = line.strip()
                if not line:
                    continue
                root = int(line[1])
                if root == 2:
                    continue
                rows.append(f"{int(root > 2)}\t{' '.join(_LEAF.findall(line)).lower()}")
            (out / f"{split}.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8", newline="\n")


_ALLOCINE_SPLITS = {"data/train.jsonl": "train.jsonl.gz", "data/val.jsonl": "valid.jsonl",
                    "data/test.jsonl": "test.jsonl"}


def allocine(ds: DataSet, raw: Path, out: Path) -> None:
    """Blard's data.tar.bz2 to one JSON object a line per review ({"text", "label"}: its "review", and its
    "polarity", 1 positive and 0 negative), each split in the source's order: data/train.jsonl to `train.jsonl.gz`,
    data/val.jsonl to `valid.jsonl`, data/test.jsonl to `test.jsonl`. The archive is read as one stream, nothing is
    extracted to disk, and its other members (a pickle, say) are skipped unread, never unpickled."""
    archive = ds.remotes[0].filename
    done: set[str] = set()
    with tarfile.open(raw / archive, "r|bz2") as tar:
        for member in tar:
            name = member.name.removeprefix("./")
            if name not in _ALLOCINE_SPLITS or not member.isfile():
                continue
            if name in done:
                raise ValueError(f"{archive}: {name} is in the archive twice")
            where, dest = f"{archive}: {name}", out / _ALLOCINE_SPLITS[name]
            counts: Counter[int] = Counter()
            rows = _allocine_rows(where, tar.extractfile(member), counts)  # type: ignore[arg-type]
            (_gzip_text if dest.name.endswith(".gz") else _plain_text)(dest, rows)
            for polarity, kind in ((0, "negative"), (1, "positive")):
                if not counts[polarity]:
                    n = counts.total()
                    raise ValueError(f"{where}: no {kind} review (polarity {polarity}) among its {n:,} "
                                     f"review{'s' * (n != 1)}")
            done.add(name)
    missing = [name for name in _ALLOCINE_SPLITS if name not in done]
    if missing:
        raise ValueError(f"{archive}: no {' nor '.join(missing)} among the archive's files")


def _allocine_rows(where: str, f: IO[bytes], counts: Counter[int]) -> Iterator[str]:
    """The converted lines of one split, read as the readers read a .jsonl file (trainer/data/readers.py): a row
    that is not a JSON object with a string "review" and a "polarity" of 0 or 1 stops the build, naming its line and
    field."""
    rows = jsonl_records(Path(where), stream_lines(f, where), "review", "polarity", True, fields_are_the_users=False)
    for n, review, polarity in rows:  # polarity as its JSON text: true or 1.0 are not the source's 0 or 1
        if polarity not in ("0", "1"):
            raise DataError(f"{where}:{n}: \"polarity\" is {str(polarity)[:40]}, not 0 or 1")
        try:
            review.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, from a "\\ud800" escape
            raise DataError(f"{where}:{n}: \"review\" holds a lone surrogate at character {e.start + 1}") from None
        counts[int(polarity)] += 1
        yield json.dumps({"text": review, "label": int(polarity)}, ensure_ascii=False)


CONVERTERS = {"cls_books": cls_books, "eltec": eltec, "imdb": imdb, "sst2": sst2, "allocine": allocine}
