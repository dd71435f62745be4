"""`python -m trainer data fetch`: the public data sets from their pinned sources, verified, resumable, atomic,
against a mirror on 127.0.0.1 (tests/data_mirror.py; this machine has no internet).

cls-books-fr is served from this project's copy of the lab's files, which are byte for byte the lab's repository's
at the pinned commit (their sha256 are the pinned ones): what the user's fetch builds must equal that copy, the
detokenized `*.review.txt` included. The archive sources (IMDB, the SST treebank, Allociné) and ELTeC's TEI novels
are served as small synthetic files of the same layout, under a catalogue whose hashes are theirs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from data_mirror import Mirror
from procs import REPO

from trainer.data import fetch as fetch_mod
from trainer.data.download import FetchError
from trainer.data.sources import SETS, DataSet, Remote

CLS = SETS["cls-books-fr"]


def _run(*args: str, root: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k not in ("TS_DATA", "TS_DATA_MIRROR")}
    e.update(TS_DATA=str(root), **env)
    return subprocess.run([sys.executable, "-m", "trainer", "data", "fetch", *args], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=timeout)


def _lab_mirror(m: Mirror, data_dir: Path) -> dict[str, str]:
    """The lab's files at their source paths; returns {file name: mirror path}."""
    return {r.filename: m.add(r.url, (data_dir / "cls-books-fr" / r.filename).read_bytes()) for r in CLS.remotes}


def _one_error_line(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr
    return errors[0]


def test_cls_books_fetched_from_a_mirror_equal_the_labs_files_and_a_second_fetch_downloads_nothing(
        data_dir: Path, tmp_path: Path) -> None:
    with Mirror() as m:
        paths = _lab_mirror(m, data_dir)
        p = _run("cls-books-fr", "--mirror", m.url, root=tmp_path)
        assert p.returncode == 0, p.stderr
        got = tmp_path / "cls-books-fr"
        for name in CLS.files:  # the lab's 8 files and the 3 detokenized splits, byte for byte
            assert (got / name).read_bytes() == (data_dir / "cls-books-fr" / name).read_bytes(), name
        record = json.loads((got / "SOURCE.json").read_text(encoding="utf-8"))
        assert record["revision"] == "b14c34637f62e5c6ebf86401be0f6aba1099e8ba" and record["license"]
        text = (got / "train.review.txt").read_bytes()
        assert record["files"]["train.review.txt"] == hashlib.sha256(text).hexdigest()
        assert not (tmp_path / ".downloads" / "cls-books-fr").exists()  # the downloads go once the set is built
        asked = len(m.log)
        assert asked == len(paths)
        again = _run("cls-books-fr", "--mirror", m.url, root=tmp_path)
        assert again.returncode == 0 and "complete" in again.stdout, again.stderr
        assert len(m.log) == asked  # nothing asked of the mirror


def test_a_flipped_byte_is_refused_naming_the_file_both_hashes_and_the_url_and_leaves_nothing(
        data_dir: Path, tmp_path: Path) -> None:
    with Mirror() as m:
        paths = _lab_mirror(m, data_dir)
        bad = bytearray(m.files[paths["train.label"]])
        bad[100] ^= 1
        m.files[paths["train.label"]] = bytes(bad)
        line = _one_error_line(_run("cls-books-fr", "--mirror", m.url, root=tmp_path))
    pinned = next(r for r in CLS.remotes if r.filename == "train.label")
    assert "train.label" in line and pinned.sha256 in line and hashlib.sha256(bad).hexdigest() in line
    assert m.url + paths["train.label"] in line
    assert not (tmp_path / "cls-books-fr").exists()
    left = [p.name for p in (tmp_path / ".downloads" / "cls-books-fr").iterdir()]
    assert not [n for n in left if n.startswith("train.label")], left  # neither the file nor its part


def test_a_transfer_cut_halfway_resumes_from_where_it_stopped(data_dir: Path, tmp_path: Path) -> None:
    with Mirror() as m:
        paths = _lab_mirror(m, data_dir)
        spm = paths["test.review.spm"]
        m.cut_once.add(spm)
        line = _one_error_line(_run("cls-books-fr", "--mirror", m.url, root=tmp_path))
        assert "test.review.spm" in line and "resumes" in line, line
        part = tmp_path / ".downloads" / "cls-books-fr" / "test.review.spm.part"
        half = part.stat().st_size
        assert 0 < half < len(m.files[spm])
        p = _run("cls-books-fr", "--mirror", m.url, root=tmp_path)
        assert p.returncode == 0, p.stderr
        assert m.requests_for(spm) == [None, f"bytes={half}-"]  # the second asked only for the rest
    assert (tmp_path / "cls-books-fr" / "test.review.spm").read_bytes() == m.files[spm]


def test_a_missing_file_a_stalled_server_and_no_server_each_give_one_line_with_the_remedies(
        data_dir: Path, tmp_path: Path) -> None:
    with Mirror() as m:
        paths = _lab_mirror(m, data_dir)
        del m.files[paths["dict.txt"]]
        line = _one_error_line(_run("cls-books-fr", "--mirror", m.url, root=tmp_path / "a"))
        assert "HTTP 404" in line and m.url + paths["dict.txt"] in line and "TS_DATA" in line and "--mirror" in line
        m.files[paths["dict.txt"]] = (data_dir / "cls-books-fr" / "dict.txt").read_bytes()
        first = CLS.remotes[0].filename  # the first download: no other file meets the 1 s timeout on a busy machine
        m.stall.add(paths[first])
        t0 = time.monotonic()
        line = _one_error_line(_run("cls-books-fr", "--mirror", m.url, "--timeout", "1", root=tmp_path / "b"))
        assert time.monotonic() - t0 < 25
        assert "stopped sending" in line and first in line and "resumes" in line, line
    line = _one_error_line(_run("cls-books-fr", "--mirror", m.url, root=tmp_path / "c"))  # the mirror is gone
    assert "connection refused" in line and "TS_DATA" in line, line


def test_the_proxy_of_the_environment_is_used(data_dir: Path, tmp_path: Path) -> None:
    """A mirror host that no resolver knows, reached through HTTP_PROXY (requests honours HTTPS_PROXY the same way
    for https sources)."""
    with Mirror() as proxy:
        _lab_mirror(proxy, data_dir)
        p = _run("cls-books-fr", "--mirror", "http://mirror.invalid", root=tmp_path, HTTP_PROXY=proxy.url,
                 NO_PROXY="", no_proxy="")
        assert p.returncode == 0, p.stderr
        assert len(proxy.log) == len(CLS.remotes)


def test_list_names_every_sets_source_and_license(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "trainer", "data", "fetch", "--list"], cwd=REPO, capture_output=True,
                       text=True, env={**os.environ, "TS_DATA": str(tmp_path)}, timeout=60)
    assert p.returncode == 0, p.stderr
    for ds in SETS.values():
        assert ds.name in p.stdout and ds.source in p.stdout and ds.license in p.stdout and ds.revision in p.stdout


def test_an_unknown_set_and_an_unwritable_folder_are_one_line(tmp_path: Path) -> None:
    assert "unknown data set" in _one_error_line(_run("cls-books", root=tmp_path))
    assert "--timeout 0: must be more than 0" in _one_error_line(_run("sst2", "--timeout", "0", root=tmp_path))
    assert "unknown preset 'nope'" in _one_error_line(_run("--preset", "nope", root=tmp_path))
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "cannot write" in _one_error_line(_run("cls-books-fr", root=blocker / "data"))


def test_a_preset_that_reads_none_of_the_sets_fetches_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Never every set in its place: the user asked for a preset's sets, and there are none."""
    monkeypatch.setenv("TS_DATA", str(tmp_path))
    monkeypatch.setattr(fetch_mod, "sets_of_preset", lambda name: [])
    monkeypatch.setattr(fetch_mod, "fetch", lambda *a, **k: pytest.fail("fetched a set nobody asked for"))
    args = argparse.Namespace(list=False, sets=[], preset="mine", mirror=None, timeout=30.0)
    assert fetch_mod.main(args) == 0 and "reads none of the sets" in capsys.readouterr().out


def test_a_folder_of_the_sets_name_that_is_not_whole_is_left_alone(data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "cls-books-fr").mkdir()
    mine = tmp_path / "cls-books-fr" / "train.label"
    mine.write_text("the user's own\n")
    line = _one_error_line(_run("cls-books-fr", "--mirror", "http://127.0.0.1:9", root=tmp_path))
    assert "exists but lacks" in line and mine.read_text() == "the user's own\n"


def test_a_fetched_set_that_lost_a_file_is_not_taken_as_whole(data_dir: Path, tmp_path: Path) -> None:
    with Mirror() as m:
        _lab_mirror(m, data_dir)
        assert _run("cls-books-fr", "--mirror", m.url, root=tmp_path).returncode == 0
        (tmp_path / "cls-books-fr" / "test.label").unlink()
        line = _one_error_line(_run("cls-books-fr", "--mirror", m.url, root=tmp_path))
    assert "exists but lacks test.label" in line, line


# ------------------------------------------------------------------------------------------------ converters


def _served(m: Mirror, ds: DataSet, files: dict[str, bytes]) -> DataSet:
    """`ds` with its remotes replaced by `files` (name -> bytes), served by `m` at made-up source URLs."""
    remotes = []
    for name, data in files.items():
        url = f"https://example.org/{ds.name}/{name}"
        m.add(url, data)
        remotes.append(Remote(url, hashlib.sha256(data).hexdigest(), len(data)))
    return dataclasses.replace(ds, remotes=tuple(remotes))


TEI = """<?xml version="1.0" encoding="UTF-8"?>
<TEI xmlns="http://www.tei-c.org/ns/1.0"><teiHeader><fileDesc><titleStmt><title>T</title></titleStmt>
</fileDesc></teiHeader><text><front><p>Préface, left out.</p></front><body><div type="chapter">
<head>I</head>
<p>Il dit\u00a0: « Bonjour »
   <hi rend="italic">à tous</hi>.<ref target="#n1">[1]</ref> Fin.</p>
<p>   </p>
<div type="poem"><l>Un vers,</l><l>un autre.</l></div>
<p>Dernier <l>vers inclus</l> ici.</p>
</div></body><back><div type="notes"><note xml:id="n1">Une note.</note></div></back></text></TEI>"""


def test_eltec_novels_become_one_paragraph_a_line(tmp_path: Path) -> None:
    with Mirror() as m:
        ds = _served(m, SETS["eltec-fr"], {"B.xml": TEI.encode(), "A.xml": TEI.replace("Bonjour", "Salut").encode(),
                                           "ELTeC-fra_metadata.tsv": b"id\ttitle\n"})
        fetch_mod.fetch(ds, tmp_path, mirror=m.url)
    lines = gzip.open(tmp_path / "eltec-fr" / "eltec_fra.txt.gz", "rt", encoding="utf-8").read().splitlines()
    one = ["I", "Il dit\u00a0: « Salut » à tous . [1] Fin.", "Un vers,", "un autre.", "Dernier vers inclus ici."]
    assert lines == one + [x.replace("Salut", "Bonjour") for x in one]  # A before B; front and notes left out
    assert (tmp_path / "eltec-fr" / "metadata.tsv").read_bytes() == b"id\ttitle\n"


def _tar(members: dict[str, str | bytes], compression: str = "gz") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{compression}") as tar:
        for name, text in members.items():
            data = text.encode() if isinstance(text, str) else text
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_imdb_archive_becomes_labelled_jsonl_and_unlabelled_lines_the_readers_take(tmp_path: Path) -> None:
    from trainer.data.labelled import read_labeled

    members = {"aclImdb/README": "x"}
    for split in ("train", "test"):
        for kind, rating in (("pos", 9), ("neg", 2)):
            for i in (10, 2):
                members[f"aclImdb/{split}/{kind}/{i}_{rating}.txt"] = f"{split} {kind} {i}<br />second"
    members["aclImdb/train/unsup/1_0.txt"] = "unlabelled one"
    members["aclImdb/train/unsup/0_0.txt"] = "unlabelled zero"
    with Mirror() as m:
        ds = _served(m, SETS["imdb"], {"aclImdb_v1.tar.gz": _tar(members)})
        fetch_mod.fetch(ds, tmp_path, mirror=m.url)
    rows = [json.loads(x) for x in gzip.open(tmp_path / "imdb" / "train.jsonl.gz", "rt", encoding="utf-8")]
    assert [(r["label"], r["id"], r["rating"]) for r in rows] == [(0, 2, 2), (0, 10, 2), (1, 2, 9), (1, 10, 9)]
    assert rows[0]["text"] == "train neg 2<br />second" and rows[0]["orig_dir"] == "train"
    assert gzip.open(tmp_path / "imdb" / "unsup.txt.gz", "rt").read() == "unlabelled zero\nunlabelled one\n"
    test = read_labeled(tmp_path / "imdb" / "test.jsonl.gz", ["0", "1"])
    assert sorted(e.label for e in test) == [0, 0, 1, 1]


def test_sst_treebank_becomes_binary_sentences_without_the_neutral_ones(tmp_path: Path) -> None:
    from trainer.data.labelled import read_labeled

    trees = {"train": "(3 (2 A) (4 (3 good) (2 film)))\n(2 (2 So) (2 so))\n"
                      "(0 (1 Bad) (2 (2 -LRB-) (2 (2 x) (2 -RRB-))))\n",
             "dev": "(1 (2 Dull) (2 .))\n", "test": "(4 (4 Great) (2 .))\n(2 (2 meh))\n"}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for split, text in trees.items():
            z.writestr(f"trees/{split}.txt", text)
    with Mirror() as m:
        ds = _served(m, SETS["sst2"], {"trainDevTestTrees_PTB.zip": buf.getvalue()})
        fetch_mod.fetch(ds, tmp_path, mirror=m.url)
    assert (tmp_path / "sst2" / "train.tsv").read_text() == "label\tsentence\n1\ta good film\n0\tbad -lrb- x -rrb-\n"
    test = read_labeled(tmp_path / "sst2" / "test.tsv", ["0", "1"])
    assert [(e.text, e.label) for e in test] == [("great .", 1)]


ALLOCINE_ROWS = {  # split: (review, polarity) in the source's order
    "train": [("Un chef-d'œuvre : l'émotion à l'état pur, à voir !", 1), ("Décevant… « navet » de l'année.", 0),
              ("Drôle\net touchant, sur deux lignes\u2028et un séparateur.", 1)],
    "val": [("Ennuyeux à mourir.", 0), ("Très réussi.", 1), ("Scénario creux.", 0)],
    "test": [("Génial, bravo aux acteurs.", 1), ("Nul, nul, nul.", 0)],
}


def _allocine_split(split: str) -> str:
    """A split as the source writes it: one JSON object a line, the film's page beside the review and polarity."""
    return "".join(json.dumps({"film-url": f"http://www.allocine.fr/film/fichefilm-{i}/critiques/spectateurs",
                               "review": text, "polarity": polarity}, ensure_ascii=False) + "\n"
                   for i, (text, polarity) in enumerate(ALLOCINE_ROWS[split]))


def _allocine_fetch(root: Path, **members: str | None) -> None:
    """Fetch allocine-fr from a synthetic data.tar.bz2 of ALLOCINE_ROWS; `members` replaces (str) or leaves out
    (None) a split's member, by split name. Two members that are no split (a pickle, a name near a split's) must be
    skipped unread."""
    files: dict[str, str | bytes] = {"data/allocine_dataset.pickle": b"\x80\x04\x95 not for reading"}
    for split in ("train", "val", "test"):
        text = members.get(split, _allocine_split(split))
        if text is not None:
            files[f"data/{split}.jsonl"] = text
    files["data/train.jsonl.orig"] = "not a split"
    with Mirror() as m:
        ds = _served(m, SETS["allocine-fr"], {"data.tar.bz2": _tar(files, "bz2")})
        fetch_mod.fetch(ds, root, mirror=m.url)


def test_allocine_archive_becomes_the_labelled_jsonl_the_readers_take_in_the_sources_order(tmp_path: Path) -> None:
    from trainer.data.labelled import read_labeled

    _allocine_fetch(tmp_path)
    got = tmp_path / "allocine-fr"
    assert sorted(p.name for p in got.iterdir()) == ["SOURCE.json", "test.jsonl", "train.jsonl.gz", "valid.jsonl"]
    assert (got / "valid.jsonl").read_bytes() == ('{"text": "Ennuyeux à mourir.", "label": 0}\n'
                                                  '{"text": "Très réussi.", "label": 1}\n'
                                                  '{"text": "Scénario creux.", "label": 0}\n').encode()
    train = gzip.open(got / "train.jsonl.gz", "rb").read().decode("utf-8").split("\n")
    assert train[2] == '{"text": "Drôle\\net touchant, sur deux lignes\u2028et un séparateur.", "label": 1}'
    for name, split in (("train.jsonl.gz", "train"), ("valid.jsonl", "val"), ("test.jsonl", "test")):
        examples = read_labeled(got / name, ["0", "1"])
        assert [(e.text, e.label) for e in examples] == ALLOCINE_ROWS[split], name
    assert not list(tmp_path.rglob("*.pickle")) and not list(tmp_path.rglob("*.orig"))  # never extracted


@pytest.mark.parametrize(("row", "error"), [
    ('{"review": "Très bien", "polarity": 2}', '"polarity" is 2, not 0 or 1'),
    ('{"review": "Bien", "polarity": true}', '"polarity" is true, not 0 or 1'),
    ('{"film-url": "x", "polarity": 1}', "no field 'review' (fields: ['film-url', 'polarity'])"),
    ('{"review": null, "polarity": 1}', "field 'review' must be a string, got NoneType"),
    ('{"review": "Bien", "polarity": 1', "malformed JSON at column 33: Expecting ',' delimiter"),
])
def test_an_allocine_row_that_is_not_a_review_fails_naming_member_line_and_field_and_leaves_no_set(
        tmp_path: Path, row: str, error: str) -> None:
    lines = _allocine_split("val").splitlines()
    bad = "\n".join([lines[0], row, *lines[1:]]) + "\n"
    with pytest.raises(ValueError) as e:
        _allocine_fetch(tmp_path, val=bad)
    assert str(e.value) == f"data.tar.bz2: data/val.jsonl:2: {error}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".downloads", ".fetch.lock"]  # no set, no partial folder


def test_an_allocine_archive_without_a_split_or_a_class_fails_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^data.tar.bz2: no data/test.jsonl among the archive's files$"):
        _allocine_fetch(tmp_path / "a", test=None)
    one_class = "".join(line + "\n" for line in _allocine_split("test").splitlines() if line.endswith("1}"))
    with pytest.raises(ValueError, match=r"^data.tar.bz2: data/test.jsonl: no negative review \(polarity 0\) "
                                         r"among its 1 review$"):
        _allocine_fetch(tmp_path / "b", test=one_class)
    assert not (tmp_path / "a" / "allocine-fr").exists() and not (tmp_path / "b" / "allocine-fr").exists()


def test_fetch_refuses_a_download_larger_than_pinned(tmp_path: Path) -> None:
    with Mirror() as m:
        ds = _served(m, SETS["sst2"], {"trainDevTestTrees_PTB.zip": b"x" * 100})
        m.files[next(iter(m.files))] = b"x" * 1000
        with pytest.raises(FetchError, match="more than the pinned 100 bytes"):
            fetch_mod.fetch(ds, tmp_path, mirror=m.url)
    assert not list((tmp_path / ".downloads" / "sst2").iterdir()) and not (tmp_path / "sst2").exists()


@pytest.mark.slow  # the whole pipeline, DeepSpeed launcher starts included: minutes
def test_a_stranger_runs_the_demo_script_from_fetch_to_served_answers(data_dir: Path, tmp_path: Path) -> None:
    """launch/demo.sh (what `make demo` runs) on the tiny preset, with no TS_DATA and an empty home: it fetches
    cls-books-fr into the user's cache from the mirror, then trains, exports, serves and classifies."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TS_DATA", "XDG_CACHE_HOME")}
    with Mirror() as m:
        _lab_mirror(m, data_dir)
        env.update(HOME=str(home), TS_DATA_MIRROR=m.url, PRESET="tiny", RUN=str(tmp_path / "run"))
        p = subprocess.run(["bash", "launch/demo.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    cache = home / ".cache" / "transfer-sentiment" / "data" / "cls-books-fr"
    assert (cache / "SOURCE.json").is_file() and "server stopped cleanly" in p.stdout
    assert (tmp_path / "run" / "bundle" / "manifest.json").is_file()
