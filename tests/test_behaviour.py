"""`export --check --behaviour`: the packaged French set is well-formed (both labels, balanced, in every capability;
no text twice; every row read by the project's reader), and its report counts what the server answers: each count
and each failed example is checked against serving's own Predictor on the same bundle, not against the code that
wrote the report."""

from __future__ import annotations

import csv
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
from bundles import edit_manifest

from serving.protocols.http import page
from trainer.__main__ import main as cli
from trainer.data.readers import DataError, read_labeled
from trainer.export.behaviour import ALL, behaviour_report, packaged_sets, read_set

FR_SET = packaged_sets()["fr"]
TEST_FILE = "cls-books-fr/test.review.txt"


def _rows(path: Path = FR_SET) -> list[dict[str, str]]:
    """The set's rows as the csv module reads a TSV: a reading independent of the project's reader."""
    with path.open(encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def test_the_french_set_is_well_formed_and_balanced() -> None:
    rows = _rows()
    assert FR_SET.name == "fr_books.tsv" and list(rows[0]) == ["capability", "label", "text"]
    per = Counter((r["capability"], r["label"]) for r in rows)
    capabilities = list(dict.fromkeys(r["capability"] for r in rows))
    assert capabilities == ["short", "negation", "intensity", "neutral_frame", "sentiment_change", "reviewer_opinion"]
    for cap in capabilities:  # both labels, as many of each, 20 to 30 examples
        assert per[cap, "0"] == per[cap, "1"] and 20 <= per[cap, "0"] + per[cap, "1"] <= 30, (cap, per)
    assert set(label for _, label in per) == {"0", "1"}
    texts = [r["text"].strip() for r in rows]
    assert all(texts) and len({t.casefold() for t in texts}) == len(texts), Counter(texts).most_common(3)
    # Every row read by the project's reader (the file's own lines: one row each), as --data reads a file.
    read = read_labeled(FR_SET, ["0", "1"])
    assert [ex.text for ex in read] == [r["text"] for r in rows]
    assert len(FR_SET.read_text(encoding="utf-8").splitlines()) == len(rows) + 1
    assert [(cap, ex.label) for cap, ex in read_set(FR_SET, ["0", "1"])] == \
        [(r["capability"], int(r["label"])) for r in rows]


def test_the_try_it_pages_examples_are_tests_of_the_set() -> None:
    """The page shows a newcomer these reviews first: the set holds each, with the label a reader gives it."""
    shown = re.search(r'<textarea id="texts"[^>]*>(.*?)</textarea>', page._BODY, re.S)
    assert shown is not None
    labels = {r["text"]: r["label"] for r in _rows() if r["capability"] == "short"}
    assert {t: labels.get(t) for t in shown.group(1).splitlines()} == {
        "Un livre magnifique, je le recommande.": "1", "Ennuyeux du début à la fin.": "0"}


def test_a_set_with_a_text_twice_or_a_blank_capability_is_refused(tmp_path: Path) -> None:
    twice = tmp_path / "twice.tsv"
    twice.write_text("capability\tlabel\ttext\nshort\t1\tBon.\nshort\t0\tNul.\nnegation\t1\tBon.\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"twice.tsv: the text 'Bon.' is in 2 rows"):
        read_set(twice, ["0", "1"])
    blank = tmp_path / "blank.tsv"
    blank.write_text("capability\tlabel\ttext\nshort\t1\tBon.\n \t0\tNul.\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"blank.tsv:3: blank text or capability"):
        read_set(blank, ["0", "1"])


def _expected(predictor, names: list[str]) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[str, float]]]:
    """Per capability (examples, correct), and each failed text -> (answer, its probability), from the server's
    in-process Predictor; `names`: the served name of the set's label 0 and of its label 1."""
    rows = _rows()
    answers = predictor.predict([r["text"] for r in rows])
    counts: dict[str, tuple[int, int]] = {}
    failed = {}
    for r, p in zip(rows, answers, strict=True):
        n, ok = counts.get(r["capability"], (0, 0))
        right = p.label == names[int(r["label"])]
        counts[r["capability"]] = (n + 1, ok + right)
        if not right:
            failed[r["text"]] = (p.label, float(p.probabilities[p.label_index]))
    return counts, failed


def _check_counts(report: dict, counts: dict[str, tuple[int, int]], failed: dict[str, tuple[str, float]]) -> None:
    (g,) = report["graphs"].values()
    assert {c: (t["examples"], t["correct"]) for c, t in g["capabilities"].items()} == counts
    for t in [*g["capabilities"].values(), g[ALL]]:
        assert t["accuracy"] == pytest.approx(100 * t["correct"] / t["examples"], abs=1e-3)
    assert (g[ALL]["examples"], g[ALL]["correct"]) == (144, sum(ok for _, ok in counts.values()))
    assert {f["text"]: f["predicted"] for f in g["failed"]} == {t: a for t, (a, _) in failed.items()}
    for f in g["failed"]:
        assert f["probability"] == pytest.approx(failed[f["text"]][1], abs=1e-3) and f["probability"] >= 0.5
        assert f["source"].startswith(f"{FR_SET}:")


def test_the_report_counts_what_the_server_answers(tiny_bundle: Path, predictor) -> None:
    report = behaviour_report(tiny_bundle, prefer_gpu=False)
    assert report["set"] == "fr_books.tsv" and report["examples"] == 144
    counts, failed = _expected(predictor, ["negative", "positive"])
    assert failed and sum(ok for _, ok in counts.values()), "the tiny model gets some right and some wrong"
    _check_counts(report, counts, failed)


def test_classes_are_matched_by_name_else_by_value(tiny_bundle: Path, predictor, tmp_path: Path) -> None:
    """Named negative/positive: by name (values swapped change nothing); other names: by the values 0 and 1 (here
    swapped, so logit 0 is the set's positive); neither: not scored, and said."""
    counts, failed = _expected(predictor, ["negative", "positive"])
    swapped = Path(shutil.copytree(tiny_bundle, tmp_path / "swapped"))
    edit_manifest(swapped, lambda m: m.update(label_values=["1", "0"]))
    _check_counts(behaviour_report(swapped, prefer_gpu=False), counts, failed)

    renamed = Path(shutil.copytree(tiny_bundle, tmp_path / "renamed"))
    edit_manifest(renamed, lambda m: m.update(label_names=["good", "bad"], label_values=["1", "0"]))
    (g,) = behaviour_report(renamed, prefer_gpu=False)["graphs"].values()
    assert {c: t["correct"] for c, t in g["capabilities"].items()} == {c: n - ok for c, (n, ok) in counts.items()}

    other = Path(shutil.copytree(tiny_bundle, tmp_path / "other"))
    edit_manifest(other, lambda m: m.update(label_names=["good", "bad"], label_values=["a", "b"]))
    assert behaviour_report(other, prefer_gpu=False)["skipped"] == (
        "behavioural set fr_books.tsv not scored: the bundle's classes ['good', 'bad'] (values ['a', 'b']) name no "
        "negative and positive class, nor values 0 and 1")


def test_check_prints_the_table_beside_the_test_split_and_writes_it_in_json(
        tiny_bundle: Path, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["export", "--check", str(tiny_bundle), "--data", str(data_dir / TEST_FILE), "--limit", "50",
              "--no-tfidf-baseline", "--behaviour", "--json", str(tmp_path / "c.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["examples"] == 50 and report["passed"] is True
    b = report["behaviour"]
    (g,) = b["graphs"].values()
    lines = out.splitlines()
    start = lines.index(f"behaviour: fr_books.tsv (144 examples in 6 capabilities: {FR_SET})")
    assert lines.index("  model.onnx (fp32, serves cpu, cuda, CPUExecutionProvider):", start) == start + 1
    table = lines[start + 2:start + 10]
    assert table[0].split() == ["capability", "examples", "correct", "accuracy"]
    for line, (cap, t) in zip(table[1:], [*g["capabilities"].items(), (ALL, g[ALL])], strict=True):
        assert line.split() == [cap, str(t["examples"]), str(t["correct"]), f"{t['accuracy']:.2f}%"]
    assert lines[start + 10] == f"    failed ({len(g['failed'])}: capability, label -> answered (its probability)):"
    f = g["failed"][0]
    assert lines[start + 11] == (f"      {f['capability']}, {f['label']} -> {f['predicted']} "
                                 f"({f['probability']:.2f}): {f['text']}")
    assert len(lines) == start + 11 + len(g["failed"])


def test_behaviour_alone_and_a_language_without_a_set(tiny_bundle: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """--behaviour needs no --data; an English bundle is told there is no set for it, and the check passes."""
    assert cli(["export", "--check", str(tiny_bundle), "--behaviour", "--json", str(tmp_path / "fr.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("behaviour: fr_books.tsv (144 examples") and "    short " in out
    report = json.loads((tmp_path / "fr.json").read_text())
    assert report["exit_code"] == 0 and report["behaviour"]["graphs"]["model.onnx"][ALL]["examples"] == 144

    english = Path(shutil.copytree(tiny_bundle, tmp_path / "english"))
    edit_manifest(english, lambda m: m["evaluation"].update(language="en"))
    assert cli(["export", "--check", str(english), "--behaviour", "--json", str(tmp_path / "en.json")]) == 0
    assert capsys.readouterr().out == ("behaviour: no behavioural set for language en (sets exist for fr); pass "
                                       "--behaviour FILE for a set of your own\n")
    assert json.loads((tmp_path / "en.json").read_text())["behaviour"]["skipped"].startswith(
        "no behavioural set for language en")


def test_the_baseline_scores_the_set_beside_the_graphs(tiny_bundle: Path, tiny_classifier_artifact: Path,
                                                        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The TF-IDF baseline of the bundle's own training split, each capability's tally from a fit made here."""
    from trainer import artifact
    from trainer.baseline import on_splits
    from trainer.data.labelled import load

    assert cli(["export", "--check", str(tiny_bundle), "--behaviour", "--json", str(tmp_path / "b.json")]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    base = json.loads((tmp_path / "b.json").read_text())["behaviour"]["tfidf_baseline"]
    cfg = artifact.load(tiny_classifier_artifact).cfg
    data, rows = load(cfg), read_set(FR_SET, ["0", "1"])
    caps = {cap: [ex for c, ex in rows if c == cap] for cap in dict.fromkeys(c for c, _ in rows)}
    fit = on_splits(cfg, data.train.originals, data.valid.examples, caps)
    assert {cap: t["correct"] for cap, t in base["capabilities"].items()} == {
        cap: round(fit[cap]["accuracy"] * len(exs) / 100) for cap, exs in caps.items()}
    assert base[ALL]["examples"] == 144
    assert base[ALL]["correct"] == sum(t["correct"] for t in base["capabilities"].values())
    assert last == (f"  TF-IDF + logistic regression baseline ({fit['recipe']} n-grams, C={fit['C']:g}, fitted on "
                    f"{data.train.source}): " + ", ".join(f"{c} {t['accuracy']:.2f}%" for c, t in
                                                          [*base["capabilities"].items(), (ALL, base[ALL])]))
    # off with the flag that turns it off for --data; an artifact that is not there: said, not guessed
    assert cli(["export", "--check", str(tiny_bundle), "--behaviour", "--no-tfidf-baseline", "--json",
                str(tmp_path / "off.json")]) == 0
    assert "TF-IDF" not in capsys.readouterr().out
    assert "tfidf_baseline" not in json.loads((tmp_path / "off.json").read_text())["behaviour"]
    moved = Path(shutil.copytree(tiny_bundle, tmp_path / "moved"))
    edit_manifest(moved, lambda m: m["source_artifact"].update(path=str(tmp_path / "gone")))
    assert cli(["export", "--check", str(moved), "--behaviour"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "  TF-IDF + logistic regression baseline not scored: no source artifact to take the training split from (the "
        "manifest's is not here: pass --artifact ARTIFACT)")


def test_data_and_behaviour_share_one_baseline_fit(tiny_bundle: Path, data_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--data and --behaviour together fit the baseline once (the `english` preset's fit takes minutes), and each
    report holds what it holds alone. The real fit runs: the wrapper only counts its calls."""
    from trainer import baseline
    real, fits = baseline.fit, []
    monkeypatch.setattr(baseline, "fit", lambda *a, **k: fits.append(a[0]) or real(*a, **k))
    check, data = ["export", "--check", str(tiny_bundle)], ["--data", str(data_dir / TEST_FILE), "--limit", "50"]
    assert cli([*check, *data, "--behaviour", "--json", str(tmp_path / "both.json")]) == 0
    assert len(fits) == 1
    assert cli([*check, *data, "--json", str(tmp_path / "data.json")]) == 0
    assert cli([*check, "--behaviour", "--json", str(tmp_path / "set.json")]) == 0
    assert len(fits) == 3
    capsys.readouterr()
    both, alone, set_alone = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("both", "data", "set"))
    for report in (both, alone):
        report["tfidf_baseline"].pop("fit_seconds")
    assert both["tfidf_baseline"] == alone["tfidf_baseline"] and "accuracy" in both["tfidf_baseline"]
    assert both["behaviour"]["tfidf_baseline"] == set_alone["behaviour"]["tfidf_baseline"]


def test_a_set_of_ones_own_in_the_bundles_label_values(tiny_bundle: Path, predictor, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    own = tmp_path / "own.jsonl"
    rows = [{"capability": "emphasis", "label": "1", "text": "Vraiment très bien."},
            {"capability": "emphasis", "label": "0", "text": "Vraiment très mauvais."}]
    own.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    report = behaviour_report(tiny_bundle, own, prefer_gpu=False)
    answers = predictor.predict([r["text"] for r in rows])
    right = sum(p.label == ("negative", "positive")[int(r["label"])] for r, p in zip(rows, answers, strict=True))
    assert report["graphs"]["model.onnx"]["capabilities"] == {
        "emphasis": {"examples": 2, "correct": right, "accuracy": 50.0 * right}}


@pytest.mark.parametrize("args, message", [
    (["--behaviour"], "go with --check BUNDLE"),
    (["--check", "{bundle}"], "--check needs --data FILE (a labelled file), --behaviour, or both"),
    (["--check", "{bundle}", "--behaviour", "--min-accuracy", "50"], "--min-accuracy goes with --data FILE"),
    (["--check", "{bundle}", "--behaviour", "--baseline", "{bundle}", "--max-drop", "1"],
     "--baseline, --max-drop go with --data FILE"),
    (["--check", "{bundle}", "--behaviour", "{missing}"], "missing.tsv: file not found"),
    # the baseline's artifact, named and not there: an error, not the manifest's artifact in its place
    (["--check", "{bundle}", "--behaviour", "--artifact", "{missing}"], "missing.tsv: not a folder"),
])
def test_bad_input_exits_2_in_one_line(tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       args: list[str], message: str) -> None:
    filled = [a.format(bundle=tiny_bundle, missing=tmp_path / "missing.tsv") for a in args]
    assert cli(["export", *filled]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
