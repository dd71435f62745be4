"""trainer/data/readers.py, corpus.py, batching.py: every reader on a slice of every data set, the errors users hit, the
corpus and batching."""

from __future__ import annotations

import gzip
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.data.batching import bucket_batches, pad_batch, padding_fraction
from trainer.data.corpus import encode_documents
from trainer.data.readers import DataError, Example, has_labels, iter_texts, label_values, read_labeled
from trainer.data.tokenizer import Tokenizer


def _first(path: Path, n: int = 3) -> list[Example]:
    return list(itertools.islice(iter_texts(path), n))


def _copy_head(src: Path, dst: Path, n: int) -> Path:
    """The first n lines of src (gzipped or not) into dst (gzipped when its name ends in .gz)."""
    opener = gzip.open if src.name.endswith(".gz") else open
    with opener(src, "rb") as f:
        head = b"".join(itertools.islice(f, n))
    with (gzip.open if dst.name.endswith(".gz") else open)(dst, "wb") as out:
        out.write(head)
    return dst


@pytest.fixture(scope="module")
def lab(data_dir: Path) -> Tokenizer:
    books = data_dir / "cls-books-fr"
    return Tokenizer.from_lab(books / "sentencepiece.french.model", books / "dict.txt", max_len=512)


# ---------------------------------------------------------------------------------------------- readers, real data


def test_iter_texts_on_each_data_set(data_dir: Path) -> None:
    spm = _first(data_dir / "cls-books-fr/train.review.spm")
    assert spm[0].text is None and spm[0].pieces[:3] == ["▁Que", "▁faire", "?"]  # type: ignore[index]
    assert spm[0].source.endswith("train.review.spm:1") and spm[0].label is None

    txt = _first(data_dir / "cls-books-fr/train.review.txt")
    assert txt[0].text is not None and txt[0].text.startswith("Que faire? en cas d?amour") and txt[0].pieces is None

    eltec = _first(data_dir / "eltec-fr/eltec_fra.txt.gz", 3)
    assert [e.text for e in eltec[:2]] == ["I", "UNE VEILLÉE."]

    sst2 = _first(data_dir / "sst2/train.tsv")  # CRLF line ends, header "label<TAB>sentence"
    assert sst2[0].text == "hide new secretions from the parental units"
    assert sst2[0].source.endswith("train.tsv:2") and not any("\r" in (e.text or "") for e in sst2)
    assert _first(data_dir / "sst2/test.tsv")[0].text == "no movement , no yuks , not much of anything ."

    imdb = _first(data_dir / "imdb/train.jsonl.gz")
    assert imdb[0].text is not None and imdb[0].text.startswith("Story of a man who has unnatural feelings for a pig")
    unsup = _first(data_dir / "imdb/unsup.txt.gz")
    assert unsup[0].text is not None and unsup[0].text.startswith("I admit, the great majority of films")


def test_read_labeled_on_each_data_set(data_dir: Path, tmp_path: Path) -> None:
    books = data_dir / "cls-books-fr"
    valid = read_labeled(books / "valid.review.spm", ["0", "1"])  # 400 lines, labels in valid.label
    assert len(valid) == 400 and sum(e.label for e in valid) == 200  # type: ignore[misc]
    assert valid[0].pieces is not None and valid[0].text is None
    valid_txt = read_labeled(books / "valid.review.txt", ["0", "1"])
    assert [e.label for e in valid_txt] == [e.label for e in valid]

    # Slices of the big files, with their labels beside them under the lab's naming.
    _copy_head(books / "train.review.spm", tmp_path / "train.review.spm", 40)
    _copy_head(books / "train.label", tmp_path / "train.label", 40)
    train = read_labeled(tmp_path / "train.review.spm", ["0", "1"])
    assert len(train) == 40 and {e.label for e in train} == {1}  # the lab's train file is sorted: 1s first

    dev = read_labeled(data_dir / "sst2/dev.tsv", ["0", "1"], text_field="sentence")
    assert len(dev) == 872 and dev[0].text == "one long string of cliches ." and dev[0].label == 0
    test = read_labeled(data_dir / "sst2/test.tsv", ["0", "1"])  # text column "content", found beside "label"
    assert len(test) == 1821 and sum(e.label for e in test) == 909  # type: ignore[misc]
    sst2_train = read_labeled(_copy_head(data_dir / "sst2/train.tsv", tmp_path / "sst2.tsv", 30), ["0", "1"])
    assert len(sst2_train) == 29 and all("\r" not in (e.text or "") for e in sst2_train)

    imdb = read_labeled(_copy_head(data_dir / "imdb/train.jsonl.gz", tmp_path / "imdb.jsonl.gz", 25), ["0", "1"])
    assert len(imdb) == 25 and imdb[0].label == 0 and imdb[0].text and imdb[0].source.endswith("imdb.jsonl.gz:1")
    # Labels are the declared classes in head order: the same file read with ["1", "0"] swaps the indices.
    assert [e.label for e in read_labeled(tmp_path / "imdb.jsonl.gz", ["1", "0"])] == [1 - e.label for e in imdb]


# ---------------------------------------------------------------------------------------------- errors


def _write(path: Path, data: bytes | str) -> Path:
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nothing\.txt: file not found"):
        next(iter_texts(tmp_path / "nothing.txt"))
    with pytest.raises(DataError, match="file not found"):
        read_labeled(tmp_path / "nothing.jsonl", ["0", "1"])
    with pytest.raises(DataError, match=r"nothing\.review\.spm: file not found"):
        read_labeled(tmp_path / "nothing.review.spm", ["0", "1"])
    with pytest.raises(DataError, match=r"empty\.txt: file is empty"):
        list(iter_texts(_write(tmp_path / "empty.txt", "")))
    with pytest.raises(DataError, match="file is empty"):
        list(iter_texts(_write(tmp_path / "blank.txt", "\n  \n\r\n")))
    _write(tmp_path / "e.label", "")
    with pytest.raises(DataError, match=r"e\.review\.spm: file is empty"):
        read_labeled(_write(tmp_path / "e.review.spm", ""), ["0", "1"])
    with pytest.raises(DataError, match=r"e\.jsonl: file is empty"):
        read_labeled(_write(tmp_path / "e.jsonl", ""), ["0", "1"])
    with pytest.raises(DataError, match="file is empty"):
        read_labeled(_write(tmp_path / "e.tsv", ""), ["0", "1"])
    gz = tmp_path / "e.txt.gz"
    with gzip.open(gz, "wb"):
        pass
    with pytest.raises(DataError, match="file is empty"):
        list(iter_texts(gz))
    with pytest.raises(DataError, match=r"plain\.txt\.gz: corrupt gzip data after line 0"):
        list(iter_texts(_write(tmp_path / "plain.txt.gz", "not gzip\n")))


def test_label_file_shorter_or_longer_than_its_text_file(tmp_path: Path) -> None:
    _write(tmp_path / "a.review.spm", "▁un ▁livre\n▁deux\n▁trois\n")
    _write(tmp_path / "a.label", "1\n0\n")
    with pytest.raises(DataError, match=r"a\.label has 2 lines but .*a\.review\.spm has 3: the label file is shorter"):
        read_labeled(tmp_path / "a.review.spm", ["0", "1"])
    _write(tmp_path / "a.label", "1\n0\n1\n0\n")
    with pytest.raises(DataError, match="a.label has 4 lines but .* has 3: the label file is longer"):
        read_labeled(tmp_path / "a.review.spm", ["0", "1"])
    _write(tmp_path / "b.review.txt", "un\n\ntrois\n")
    _write(tmp_path / "b.label", "1\n0\n1\n")
    skipped: list[str] = []  # a blank text is skipped and said, as in every format; its label line still pairs
    assert [(e.text, e.label) for e in read_labeled(tmp_path / "b.review.txt", ["0", "1"], skipped=skipped)] == \
        [("un", 1), ("trois", 1)]
    assert skipped == [f"{tmp_path / 'b.review.txt'}:2"]
    with pytest.raises(DataError, match="no label file beside it"):
        read_labeled(_write(tmp_path / "c.spm", "▁x\n"), ["0", "1"])


def test_unknown_label_names_file_line_and_allowed_set(tmp_path: Path) -> None:
    _write(tmp_path / "a.review.spm", "▁un\n▁deux\n▁trois\n")
    _write(tmp_path / "a.label", "1\n0\n2\n")
    with pytest.raises(DataError, match=r"a\.label:3: unknown label '2'; the declared labels .* \['0', '1'\]"):
        read_labeled(tmp_path / "a.review.spm", ["0", "1"])
    _write(tmp_path / "s.tsv", "label\tsentence\r\n1\tgood\r\npos\tbad\r\n")
    with pytest.raises(DataError, match=r"s\.tsv:3: unknown label 'pos'"):
        read_labeled(tmp_path / "s.tsv", ["0", "1"])
    _write(tmp_path / "j.jsonl", '{"text": "a", "label": 1}\n{"text": "b", "label": 7}\n')
    with pytest.raises(DataError, match=r"j\.jsonl:2: unknown label '7'"):
        read_labeled(tmp_path / "j.jsonl", ["0", "1"])


def test_non_utf8_line_is_named(tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad.txt", b"ok\nstill ok\ncaf\xe9 latin-1\nfine\n")
    with pytest.raises(DataError, match=r"bad\.txt:3: line 3 is not valid UTF-8 \(byte 0xe9 at column 4\)"):
        list(iter_texts(bad))
    gz = tmp_path / "bad.jsonl.gz"
    with gzip.open(gz, "wb") as f:
        f.write(b'{"text": "a", "label": 0}\n{"text": "\xff", "label": 1}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz:2: line 2 is not valid UTF-8"):
        read_labeled(gz, ["0", "1"])


def test_jsonl_and_tsv_field_errors(tmp_path: Path) -> None:
    j = _write(tmp_path / "j.jsonl", '{"text": "a", "label": 0}\n{"review": "b", "label": 1}\n')
    with pytest.raises(DataError, match=r"j\.jsonl:2: no field 'text' \(fields: \['label', 'review'\]\)"):
        list(iter_texts(j))
    nolabel = _write(tmp_path / "n.jsonl", '{"text": "a"}\n')
    assert [e.text for e in iter_texts(nolabel)] == ["a"]  # unlabeled reading needs no label
    with pytest.raises(DataError, match=r"n\.jsonl:1: no field 'label'"):
        read_labeled(nolabel, ["0", "1"])
    broken = _write(tmp_path / "b.jsonl", '{"text": "a"}\n{"text": "b"\n')
    with pytest.raises(DataError, match=r"b\.jsonl:2: malformed JSON"):
        list(iter_texts(broken))
    tsv = _write(tmp_path / "t.tsv", "id\tstars\tbody\n1\t5\tgreat\n")
    with pytest.raises(DataError, match=r"t\.tsv:1: no column 'text' in the header \['id', 'stars', 'body'\]"):
        list(iter_texts(tsv))
    assert [e.text for e in iter_texts(tsv, text_field="body")] == ["great"]
    ragged = _write(tmp_path / "r.tsv", "label\tsentence\n1\tgood\textra\n")
    with pytest.raises(DataError, match=r"r\.tsv:2: row 1 \(line 2\) has 3 tab-separated fields, the header has 2"):
        read_labeled(ragged, ["0", "1"])
    with pytest.raises(DataError, match=r"unsupported file type '\.xml'; supported: \.txt, \.jsonl, \.tsv, \.spm, "
                                        r"\.csv, \.parquet"):
        list(iter_texts(_write(tmp_path / "x.xml", "<a/>\n")))


# ---------------------------------------------------------------------------------------------- corpus


def test_encode_documents_frames_each_document_uncut(data_dir: Path, lab: Tokenizer) -> None:
    books = data_dir / "cls-books-fr"
    spm = _first(books / "train.review.spm", 300)
    imdb = _first(data_dir / "imdb/unsup.txt.gz", 7)
    ids, lengths = encode_documents(spm + imdb, lab)
    assert ids.dtype == np.int64 and len(ids) == int(lengths.sum()) and len(lengths) == 307
    docs = np.split(ids, np.cumsum(lengths)[:-1])
    for ex, doc in zip(spm[:3], docs, strict=False):  # the lab's pieces map directly: no re-encoding
        assert doc.tolist() == [Tokenizer.SOS, *[lab.piece_to_id(p) for p in ex.pieces or []], Tokenizer.EOS]
    assert lengths.max() > lab.max_len  # documents are not cut to max_len
    assert [d.tolist() for d in docs[300:]] == lab.with_max_len(10**6).encode_batch([e.text or "" for e in imdb])


def test_encode_documents_with_a_trained_tokenizer_detokenizes_spm(data_dir: Path, tiny_tokenizer) -> None:
    books = data_dir / "cls-books-fr"
    from_spm = encode_documents(_first(books / "train.review.spm", 20), tiny_tokenizer)
    from_txt = encode_documents(_first(books / "train.review.txt", 20), tiny_tokenizer)
    assert all(np.array_equal(a, b) for a, b in zip(from_spm, from_txt, strict=True))


# ---------------------------------------------------------------------------------------------- csv, parquet


def test_csv_quoted_fields_for_fine_tuning_and_pretraining(tmp_path: Path) -> None:
    rows = 'id,review,stars\n1,"Good, really ""good""",pos\n2,"two\nlines, one review",neg\n\n3,plain,pos\n'
    f = _write(tmp_path / "r.csv", rows)
    got = read_labeled(f, ["neg", "pos"], text_field="review", label_field="stars")
    assert [(e.text, e.label, e.source.rsplit(":", 1)[1]) for e in got] == [
        ('Good, really "good"', 1, "2"), ("two\nlines, one review", 0, "3"), ("plain", 1, "6")]
    assert [e.text for e in iter_texts(f, text_field="review")] == [e.text for e in got]
    assert label_values(f, "review", "stars") == ["neg", "pos"] and has_labels(f, "stars") and not has_labels(f)
    bad = _write(tmp_path / "bad.csv", 'text,label\nfine,1\n"a, b",1,extra\n')
    with pytest.raises(DataError, match=r"bad\.csv:3: row 2 \(line 3\) has 3 comma-separated fields, the header has 2"):
        read_labeled(bad, ["0", "1"])
    stray = _write(tmp_path / "q.csv", 'text,label\nok,1\n"quoted" then not,1\n')
    with pytest.raises(DataError, match=r"q\.csv:3: malformed CSV record"):
        list(iter_texts(stray))
    with pytest.raises(DataError, match=r"u\.csv:3: unknown label '7'"):
        read_labeled(_write(tmp_path / "u.csv", 'text,label\na,1\n"b\nb",7\n'), ["0", "1"])


def test_parquet_columns_from_the_config_read_by_row_group(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer.data.tables import parquet_row_groups

    f = tmp_path / "r.parquet"
    texts = [f"review {i}" for i in range(25)]
    pq.write_table(pa.table({"body": texts, "y": [i % 3 for i in range(25)], "other": list(range(25))}), f,
                   row_group_size=10)
    assert parquet_row_groups(f) == [10, 10, 5]
    got = read_labeled(f, ["0", "1", "2"], text_field="body", label_field="y")
    assert [e.text for e in got] == texts and [e.label for e in got] == [i % 3 for i in range(25)]
    assert got[12].source == f"{f}:13" and has_labels(f, "y") and not has_labels(f)
    with pytest.raises(DataError, match=r"r\.parquet: no column 'text' \(columns: \['body', 'y', 'other'\]"):
        list(iter_texts(f))
    nulls = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": ["a", None, "c"], "label": ["1", "0", None]}), nulls, row_group_size=2)
    with pytest.raises(DataError, match=r"n\.parquet:2: row 2 \(row group 0\): column 'text' is null"):
        list(iter_texts(nulls))
    with pytest.raises(DataError, match=r"not a readable parquet file"):
        list(iter_texts(_write(tmp_path / "fake.parquet", "not parquet\n")))


# ---------------------------------------------------------------------------------------------- batching


@pytest.fixture(scope="module")
def review_lengths(data_dir: Path) -> list[int]:
    """Word counts of 3,000 real IMDB reviews (long-tailed: 10 to 1,000+ words)."""
    return [len((e.text or "").split()) for e in itertools.islice(iter_texts(data_dir / "imdb/unsup.txt.gz"), 3000)]


def test_bucket_batches_cover_every_index_once_deterministically(review_lengths: list[int]) -> None:
    n = len(review_lengths)
    batches = bucket_batches(review_lengths, 13, seed=5, epoch=0)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(n)) and all(1 <= len(b) <= 13 for b in batches)
    assert sum(len(b) < 13 for b in batches) <= (n // (64 * 13)) + 1  # only each chunk's last batch is short
    assert bucket_batches(review_lengths, 13, seed=5, epoch=0) == batches
    assert bucket_batches(review_lengths, 13, seed=5, epoch=1) != batches
    assert bucket_batches(review_lengths, 13, seed=6, epoch=0) != batches
    ordered = bucket_batches(review_lengths, 13, seed=5, epoch=0, shuffle=False)
    assert sorted(i for b in ordered for i in b) == list(range(n))
    assert bucket_batches([], 4, seed=0, epoch=0) == []


def test_bucketing_pads_much_less_than_random_batches(review_lengths: list[int]) -> None:
    rng = np.random.default_rng(0)
    order = rng.permutation(len(review_lengths)).tolist()
    random_batches = [order[i : i + 16] for i in range(0, len(order), 16)]
    random_pad = padding_fraction(review_lengths, random_batches)
    bucket_pad = padding_fraction(review_lengths, bucket_batches(review_lengths, 16, seed=0, epoch=0))
    assert random_pad > 0.4  # real reviews: random batches are mostly padding
    assert bucket_pad < 0.05 and bucket_pad < random_pad / 10


def test_pad_batch() -> None:
    ids, pad = pad_batch([[0, 5, 6, 2], [0, 7, 2], [0, 2]], pad_id=1)
    assert ids.dtype == torch.int64 and pad.dtype == torch.bool and ids.shape == pad.shape == (3, 4)
    assert ids.tolist() == [[0, 5, 6, 2], [0, 7, 2, 1], [0, 2, 1, 1]]
    assert pad.tolist() == [[False] * 4, [False] * 3 + [True], [False, False, True, True]]
    ids, pad = pad_batch([np.array([4, 5], dtype=np.uint16)], pad_id=1)
    assert ids.tolist() == [[4, 5]] and not pad.any()
    with pytest.raises(ValueError, match="at least one sequence"):
        pad_batch([])
