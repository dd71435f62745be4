"""trainer/data/prepare.py, corpus.py, windows.py: the prepared folder's bytes (the same whatever the worker count,
after a kill and a resume), its documents against the tokenizer's own encoding, the checks a copy goes through, and the
packed windows that training reads from it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from procs import REPO

from trainer.data import corpus as corpus_mod
from trainer.data.corpus import MANIFEST, PreparedCorpus, PreparedError, files_of, read_manifest, verify
from trainer.data.prepare import prepare
from trainer.data.readers import DataError, iter_texts
from trainer.data.tokenizer import Tokenizer
from trainer.data.windows import EpochOrder, Windows, permute, split

SHARD = 20_000  # ids a shard: a dozen shards from the inputs below


@pytest.fixture(scope="module")
def inputs(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Every reader: .txt, the lab's .spm, .tsv (a header), .jsonl.gz, and a .csv (quoted commas and newlines) and a
    .parquet (3 row groups) made here."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("inputs")
    rows = [e.text or "" for e in iter_texts(data_dir / "sst2" / "dev.tsv")][:150]
    with open(d / "quoted.csv", "w", encoding="utf-8", newline="") as f:
        f.write("id,text,label\n")
        for i, r in enumerate(rows):
            text = f'{r}, "a comma",\nnext line' if i % 3 else r
            f.write(f'{i},"{text.replace(chr(34), chr(34) * 2)}",{i % 2}\n')
    pq.write_table(pa.table({"text": rows[:100], "label": [i % 2 for i in range(100)]}), d / "reviews.parquet",
                   row_group_size=40)
    jsonl = d / "head.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for e in list(iter_texts(data_dir / "imdb" / "train.jsonl.gz"))[:60]:
            f.write(json.dumps({"text": e.text}) + "\n")
    books = data_dir / "cls-books-fr"
    return [books / "train.review.txt", books / "valid.review.spm", data_dir / "sst2" / "dev.tsv", jsonl,
            d / "quoted.csv", d / "reviews.parquet"]


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(inputs: list[Path], tiny_tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "prepared"
    prepare(inputs, tiny_tokenizer, out, workers=1, shard_tokens=SHARD)
    return out


def test_same_bytes_whatever_the_workers_and_blocks(reference: Path, inputs: list[Path], tiny_tokenizer: Tokenizer,
                                                     tmp_path: Path) -> None:
    prepare(inputs, tiny_tokenizer, tmp_path / "w2", workers=2, shard_tokens=SHARD, block_bytes=3000)
    assert len(read_manifest(reference)["shards"]) > 5
    assert digest(tmp_path / "w2") == digest(reference)


def test_documents_are_the_tokenizers_own_encoding(reference: Path, inputs: list[Path],
                                                   tiny_tokenizer: Tokenizer) -> None:
    """Every document equals [<sos>] + pieces + [<eos>] of its text as iter_texts reads it and Tokenizer.encode
    encodes it (uncut), in input order, across every shard boundary."""
    corpus = PreparedCorpus(reference, fingerprint=tiny_tokenizer.fingerprint)
    texts = [e.text if e.text is not None else "".join(e.pieces or []).replace("\u2581", " ").strip()
             for p in inputs for e in iter_texts(p)]
    assert corpus.n_docs == len(texts) == 1600 + 400 + 872 + 60 + 150 + 100
    stream = corpus.read(0, corpus.n_tokens)
    want = tiny_tokenizer.with_max_len(10**6).encode_batch(texts)
    starts = [corpus.doc_start(d) for d in range(corpus.n_docs + 1)]
    assert [stream[a:b].tolist() for a, b in zip(starts, starts[1:], strict=False)] == want
    assert corpus.dtype == np.uint16 and corpus.n_tokens == len(stream) == sum(len(w) for w in want)
    quoted = texts[2932:3082]  # the csv's: quoted newlines and commas kept inside their field
    assert sum("\n" in t and '"a comma"' in t for t in quoted) == 100


def test_resume_after_a_kill_gives_the_same_bytes(reference: Path, inputs: list[Path], tiny_tokenizer_dir: Path,
                                                  tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    code = ("import sys; from pathlib import Path; from trainer.data.prepare import prepare; "
            "from trainer.data.tokenizer import Tokenizer\n"
            "if __name__ == '__main__':\n"
            f"    prepare([Path(p) for p in {[str(p) for p in inputs]!r}],"
            f" Tokenizer.load({str(tiny_tokenizer_dir)!r}, 48),"
            f" Path({str(out)!r}), workers=1, shard_tokens={SHARD}, block_bytes=2000)")
    script = tmp_path / "run.py"
    script.write_text(code)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:  # kill once 2 shards are listed
        try:
            if len(json.loads((out / MANIFEST).read_text())["shards"]) >= 2:
                break
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = read_manifest(out)
    assert not killed["complete"], "the prepare finished before it was killed"
    prepare(inputs, tiny_tokenizer, out, workers=2, shard_tokens=SHARD)
    assert digest(out) == digest(reference)


def test_resume_removes_what_a_kill_mid_write_left(reference: Path, inputs: list[Path], tiny_tokenizer: Tokenizer,
                                                  tmp_path: Path) -> None:
    """A kill while the manifest (or a shard) was written leaves its temporary sibling: the resume removes it (the
    kill above lands there now and then: its folder kept a .manifest.json.*.tmp)."""
    out = Path(shutil.copytree(reference, tmp_path / "killed"))
    body = read_manifest(out)
    body["shards"] = body["shards"][:2]  # as a prepare killed after its second shard left it
    body.update(complete=False, documents=sum(s["documents"] for s in body["shards"]),
                tokens=sum(s["tokens"] for s in body["shards"]))
    (out / MANIFEST).write_text(json.dumps(body, indent=1) + "\n")
    (out / f".{MANIFEST}.0123456789ab.tmp").write_text("{")
    (out / ".shard-00002.bin.0123456789ab.tmp").write_bytes(b"\0")
    prepare(inputs, tiny_tokenizer, out, workers=1, shard_tokens=SHARD)
    assert digest(out) == digest(reference)


def test_a_finished_folder_is_reused_and_other_inputs_are_refused(reference: Path, inputs: list[Path],
                                                                   tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(reference, tmp_path / "copy"))
    before = digest(copy)
    assert prepare(inputs, tiny_tokenizer, copy, shard_tokens=SHARD)["complete"]  # nothing redone
    assert digest(copy) == before
    with pytest.raises(PreparedError, match="prepared with other inputs"):
        prepare(inputs[:2], tiny_tokenizer, copy, shard_tokens=SHARD)
    with pytest.raises(PreparedError, match="prepared with other shard_tokens"):
        prepare(inputs, tiny_tokenizer, copy, shard_tokens=SHARD + 1)
    assert digest(copy) == before


def test_a_bad_row_stops_the_prepare_naming_file_and_line(inputs: list[Path], tiny_tokenizer: Tokenizer,
                                                          tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text('text,label\n"fine, quoted",1\nok,0\n"a,b",1,extra\n')
    with pytest.raises(DataError, match=rf"^{bad}:4: row 3 \(line 4\) has 3 comma-separated fields"):
        prepare([inputs[2], bad], tiny_tokenizer, tmp_path / "p", workers=2)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'text' must be a string"):
        prepare([tmp_path / "bad.jsonl"], tiny_tokenizer, tmp_path / "q", workers=1)
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(DataError, match=r"blank\.txt: file is empty"):
        prepare([tmp_path / "blank.txt"], tiny_tokenizer, tmp_path / "r", workers=1)


def test_verify_names_the_damaged_or_missing_file(reference: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(reference, tmp_path / "copy"))
    m = read_manifest(copy)
    assert verify(copy, files_of(m)) == []
    victim = copy / m["shards"][2]["bin"]
    data = bytearray(victim.read_bytes())
    data[100] ^= 1
    victim.write_bytes(bytes(data))
    assert verify(copy, files_of(m), full=False) == []  # same size: only the checksum sees it
    assert verify(copy, files_of(m)) == [f"{victim}: sha256 differs from the manifest's (a different or damaged copy)"]
    (copy / m["shards"][3]["idx"]).unlink()
    assert f"{copy / m['shards'][3]['idx']}: missing" in verify(copy, files_of(m), full=False)
    with pytest.raises(PreparedError, match="shard-00003.idx: missing"):
        PreparedCorpus(copy)
    (copy / "tokenizer" / "vocab.txt").write_text("changed\n")
    assert any("tokenizer/vocab.txt: " in p for p in verify(copy, files_of(m), full=False))


def test_refuses_another_tokenizer_and_an_unfinished_folder(reference: Path, tmp_path: Path) -> None:
    with pytest.raises(PreparedError, match="made by tokenizer"):
        PreparedCorpus(reference, fingerprint="0" * 64)
    copy = Path(shutil.copytree(reference, tmp_path / "copy"))
    m = read_manifest(copy)
    (copy / MANIFEST).write_text(json.dumps({**m, "complete": False}))
    with pytest.raises(PreparedError, match="did not finish"):
        PreparedCorpus(copy)
    (copy / MANIFEST).write_text("{")
    with pytest.raises(PreparedError, match="not a readable manifest"):
        PreparedCorpus(copy)


def test_the_cli_prepares_with_a_progress_log_and_one_line_errors(data_dir: Path, tiny_tokenizer_dir: Path,
                                                                  tmp_path: Path) -> None:
    from procs import run

    base = [sys.executable, "-m", "trainer", "prepare", "--preset", "tiny", "--set", f"data.root={data_dir}",
            "--tokenizer", str(tiny_tokenizer_dir)]
    p = run([*base, "--set", "data.pretrain=cls-books-fr/*.review.txt", "--workers", "2", "--out",
             str(tmp_path / "p")], 300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    m = read_manifest(tmp_path / "p")
    assert [Path(i["path"]).name for i in m["inputs"]] == ["test.review.txt", "train.review.txt", "valid.review.txt"]
    assert m["documents"] == 4000 and f"--set data.prepared={tmp_path / 'p'}" in p.stdout
    p = run([*base, "--set", "data.pretrain=nothing/*.txt", "--out", str(tmp_path / "q")], 300, cwd=REPO)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].endswith("no file matches this pattern")


# ---------------------------------------------------------------------------------------------- windows


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097, 123_457])
def test_permute_is_a_keyed_bijection(n: int) -> None:
    p = permute(np.arange(n), n, seed=3, epoch=1)
    assert sorted(p.tolist()) == list(range(n))
    np.testing.assert_array_equal(permute(np.arange(n), n, seed=3, epoch=1), p)  # deterministic
    if n > 64:
        assert not np.array_equal(permute(np.arange(n), n, seed=3, epoch=2), p)  # a new order per epoch
        assert not np.array_equal(permute(np.arange(n), n, seed=4, epoch=1), p)  # and per seed
        assert abs(np.corrcoef(np.arange(n), p)[0, 1]) < 0.1  # shuffled, not shifted
    with pytest.raises(IndexError):
        permute(np.array([n]), n, 0, 0)


def test_global_batches_cover_each_window_once_per_epoch(reference: Path) -> None:
    corpus = PreparedCorpus(reference)
    train, held = split(corpus, eval_docs=50, seq_len=13, overlap=1)
    assert held.lo == train.hi == corpus.doc_start(corpus.n_docs - 50) and held.hi == corpus.n_tokens
    G = 24
    order = EpochOrder(train, 0, G, seed=0)
    assert len(order) == len(train) // G and len(train) == (train.hi - 1) // 13
    seen = np.concatenate([order[b] for b in range(len(order))])
    assert len(np.unique(seen)) == len(seen) == len(order) * G
    assert EpochOrder(train, 1, G, seed=0)[0] != order[0]
    ids = order[5]
    tok = train.tokens(ids)  # (G, 14): one slice of the stream a window, overlapping the next by one token
    assert tok.shape == (G, 14)
    for row, w in zip(tok, ids, strict=True):
        np.testing.assert_array_equal(row, corpus.read(w * 13, w * 13 + 14))
    assert Windows(corpus, 0, 27, 13, 1).n == 2 and Windows(corpus, 0, 26, 13, 0).n == 2


def test_the_reader_maps_only_what_it_reads(reference: Path) -> None:
    corpus = PreparedCorpus(reference)
    assert corpus._maps == {}
    corpus.read(5, 9)
    assert list(corpus._maps) == ["shard-00000.bin"]
    last = corpus_mod.read_manifest(reference)["shards"][-1]["bin"]
    corpus.read(corpus.n_tokens - 3, corpus.n_tokens)
    assert list(corpus._maps) == ["shard-00000.bin", last]


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["shards"][0].update(bin="../outside.bin"), r"shards\[0\]\.bin '\.\./outside\.bin': not a file name"),
    (lambda m: m["shards"][1].update(idx="/etc/hostname"), r"shards\[1\]\.idx '/etc/hostname': not a file name"),
    (lambda m: m["tokenizer"]["files"].update({"../../x": {"bytes": 1, "sha256": "0"}}),
     r"tokenizer\.files '\.\./\.\./x': not a file name"),
    (lambda m: m["shards"][0].pop("tokens"), r"shards\[0\]: no 'tokens'"),
    (lambda m: m["shards"][0].update(documents=-1), r"shards\[0\]\.documents -1: not a count"),
    (lambda m: m.update(dtype="object"), r"dtype 'object': not uint16 or uint32"),
    (lambda m: m.update(shards={}), r"shards: not a list"),
])
def test_a_tampered_manifest_is_one_line_and_reads_nothing_outside(reference: Path, tmp_path: Path, edit,
                                                                   message: str) -> None:
    """A prepared folder travels between nodes; its manifest names the files every rank maps. One that names a file
    outside the folder, or lacks a field, is refused with one line naming the field, before any file is read."""
    copy = Path(shutil.copytree(reference, tmp_path / "copy"))
    m = read_manifest(copy)
    edit(m)
    (copy / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(PreparedError, match=message):
        PreparedCorpus(copy)
