"""A user's own labelled files, the harder cases: what used to become a silent extra class (an empty label, a typo, two
spellings of one value), a .tsv whose quotes were kept as text, and blank texts kept by one reader and dropped by
another."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from trainer.config.choice import Choice
from trainer.data.blocks import block_texts, read_blocks
from trainer.data.labelled import MIN_CLASS_EXAMPLES, load, settle_labels
from trainer.data.readers import DataError, is_blank, iter_texts, read_labeled, read_rows, stdin_lines


def settle(path: Path, *more: str):
    fields = ("data.text_field=review", "data.label_field=sentiment") if path.suffix == ".csv" else ()
    return settle_labels(Choice("tiny", None, (f"data.train={path}", *fields, *more)).resolve(), num_classes_set=False)


def reviews(path: Path, labels: list[str], texts: list[str] | None = None) -> Path:
    """A CSV with a `sentiment,review` header, as the user's file was."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["sentiment", "review"])
    w.writerows([lab, texts[i] if texts else f"review number {i}"] for i, lab in enumerate(labels))
    path.write_text(buf.getvalue(), encoding="utf-8")
    return path


BALANCED = ["positive", "negative"] * 20


# ---------------------------------------------------------------------------------------------- labels


def test_an_empty_label_is_an_error_naming_its_rows(tmp_path: Path) -> None:
    f = reviews(tmp_path / "r.csv", BALANCED + ["", "positive", ""])
    with pytest.raises(DataError, match=rf"r\.csv: 2 examples with an empty label \({f}:42, {f}:44\); fill in or "
                                        "drop those rows"):
        settle(f)


def test_a_rare_class_is_an_error_naming_it_and_its_rows_unless_data_labels_lists_it(tmp_path: Path) -> None:
    f = reviews(tmp_path / "r.csv", BALANCED + ["neutral"] * 3)
    with pytest.raises(DataError, match=rf"label 'neutral' has 3 examples \({f}:42, {f}:43, {f}:44\), fewer than "
                                        rf"{MIN_CLASS_EXAMPLES}: .* list the classes to train in data.labels"):
        settle(f)
    cfg = settle(f, "data.labels=negative,neutral,positive")  # the user says it is a class: it is one
    assert cfg.data.labels == ["negative", "neutral", "positive"] and cfg.model.num_classes == 3
    assert sum(ex.label == 1 for ex in read_labeled(f, cfg.data.labels, "review", "sentiment")) == 3
    ok = reviews(tmp_path / "ok.csv", BALANCED + ["neutral"] * MIN_CLASS_EXAMPLES)
    assert settle(ok).data.labels == ["negative", "neutral", "positive"]


@pytest.mark.parametrize(("odd", "other", "kind"), [("Positive", "positive", "case"), ("true", "1", "type"),
                                                    ("1.0", "1", "type"), ("FALSE", "0", "type")])
def test_two_spellings_of_one_value_are_an_error_with_both(tmp_path: Path, odd: str, other: str, kind: str) -> None:
    f = reviews(tmp_path / "r.csv", [other, "neg" if kind == "case" else "2"] * 20 + [odd])
    with pytest.raises(DataError) as e:
        settle(f)
    msg = str(e.value)
    assert f"{odd!r} (1 example: {f}:42)" in msg and f"{other!r} (20 examples:" in msg, msg
    assert "differ only by case or type" in msg


def test_json_booleans_and_numbers_are_compared_as_the_file_writes_them(tmp_path: Path) -> None:
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps({"text": f"t{i}", "label": lab}) + "\n"
                         for i, lab in enumerate([True, False] * 12 + [1])))
    with pytest.raises(DataError, match=r"'1' \(1 example: .*\) and 'true' \(12 examples"):
        settle(f)


# ---------------------------------------------------------------------------------------------- TSV quoting


def _table(path: Path, delimiter: str, rows: list[list[str]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f, delimiter=delimiter).writerows(rows)  # as the csv module (and pandas' to_csv) writes it
    return path


TRICKY = [["label", "text"], ["1", 'He said "wonderful" twice'], ["0", '"Quoted" from the start'],
          ["1", "a tab\there, and a comma"], ["0", "two\nlines"], ["1", 'a "" pair'], ["0", "plain"],
          ["1", '5" tall, 3\' wide']]


def test_a_tsv_and_a_csv_of_the_same_table_give_identical_examples(tmp_path: Path) -> None:
    tsv = _table(tmp_path / "t.tsv", "\t", TRICKY)
    csv_ = _table(tmp_path / "t.csv", ",", TRICKY)
    assert '"' in tsv.read_text() and '""' in tsv.read_text()  # the writer quoted fields: the case that broke
    got_tsv = [(e.text, e.label) for e in read_labeled(tsv, ["0", "1"])]
    got_csv = [(e.text, e.label) for e in read_labeled(csv_, ["0", "1"])]
    assert got_tsv == got_csv == [(text, int(lab)) for lab, text in TRICKY[1:]]
    assert [e.source.rpartition(":")[2] for e in read_labeled(tsv, ["0", "1"])] == ["2", "3", "4", "5", "7", "8",
                                                                                    "9"]  # where each starts
    # the parallel reader of `prepare` cuts blocks only between records: the same documents
    blocks = list(read_blocks(tsv, block_bytes=16))
    assert len(blocks) > 2
    texts = [e.text for b in blocks for e in block_texts(tsv, b.first_line, b.data, b.header)]
    assert texts == [e.text for e in iter_texts(tsv)]


def test_a_raw_tsv_keeps_quotes_inside_fields_and_refuses_a_broken_quoted_one(tmp_path: Path) -> None:
    raw = tmp_path / "raw.tsv"
    raw.write_text('label\ttext\n1\tsaid "hi" to me\n0\t5" tall\n', encoding="utf-8")
    assert [e.text for e in read_labeled(raw, ["0", "1"])] == ['said "hi" to me', '5" tall']
    bad = tmp_path / "bad.tsv"
    bad.write_text('label\ttext\n1\tfine\n0\t"quoted" then more\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.tsv:3: malformed TSV record starting on line 3: .*a field that "
                                        "starts with a quote must end with one"):
        read_labeled(bad, ["0", "1"])


# ---------------------------------------------------------------------------------------------- blank texts


def test_blank_texts_are_skipped_and_said_in_training_and_kept_as_rows_for_predict(tmp_path: Path) -> None:
    texts = [f"review {i}" for i in range(40)]
    texts[3], texts[17] = "", "   "
    f = reviews(tmp_path / "r.csv", BALANCED, texts)
    cfg = settle(f)
    data = load(cfg)
    assert sum(len(p.examples) for p in (data.train, data.valid, data.test)) == 38
    lines = data.summary(cfg)
    assert lines[0].endswith(f"; 2 blank texts skipped ({f}:5, {f}:19)"), lines[0]
    rows = read_rows(f, cfg.data.labels, "review", "sentiment")  # predict: one row per input row
    assert len(rows) == 40 and [i for i, ex in enumerate(rows) if is_blank(ex)] == [3, 17]
    assert rows[3].label is None and rows[4].label is not None
    txt = tmp_path / "new.txt"
    txt.write_text("one\n\nthree\n", encoding="utf-8")
    assert [(e.text, e.source.rpartition(":")[2]) for e in read_rows(txt, None)] == [("one", "1"), ("", "2"),
                                                                                    ("three", "3")]
    only_blank = reviews(tmp_path / "b.csv", ["positive", "negative"], ["", " "])
    with pytest.raises(DataError, match=r"b\.csv: no examples: the text of each of its 2 records is blank"):
        read_labeled(only_blank, ["negative", "positive"], "review", "sentiment")


def test_standard_input_is_read_in_a_named_format() -> None:
    lines = stdin_lines(io.BytesIO(b'{"text": "good", "label": "1"}\n{"text": "", "label": "0"}\n'))
    rows = read_rows(Path("<stdin>"), ["0", "1"], lines=lines, fmt=".jsonl")
    assert [(r.text, r.label, r.source) for r in rows] == [("good", 1, "<stdin>:1"), ("", None, "<stdin>:2")]
    with pytest.raises(DataError, match=r"<stdin>:2: line 2 is not valid UTF-8"):
        stdin_lines(io.BytesIO(b"ok\n\xff\n"))
