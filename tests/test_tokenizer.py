"""trainer/data/tokenizer.py: the lab's ids reproduced exactly, a trained tokenizer, the saved folder and its errors."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from trainer.config.presets import tiny
from trainer.config.schema import ConfigError, override
from trainer.data.readers import iter_texts
from trainer.data.tokenizer import Tokenizer, TokenizerError, build_tokenizer, detokenize

N_LINES = 100  # the acceptance test: first 100 lines of train.review.spm


def _head(path: Path, n: int) -> list[str]:
    with open(path, encoding="utf-8", newline="\n") as f:
        return [line.rstrip("\n") for line in itertools.islice(f, n)]


@pytest.fixture(scope="module")
def books(data_dir: Path) -> Path:
    return data_dir / "cls-books-fr"


@pytest.fixture(scope="module")
def lab(books: Path) -> Tokenizer:
    return Tokenizer.from_lab(books / "sentencepiece.french.model", books / "dict.txt", max_len=512)


@pytest.fixture(scope="module")
def lab_ids(books: Path) -> list[list[int]]:
    """The lab's ids computed straight from dict.txt: <sos>, piece on line i -> i + 4 (unknown -> 3), <eos>."""
    vocab = {}
    for i, line in enumerate((books / "dict.txt").read_text(encoding="utf-8").split("\n")[:-1]):
        vocab[line.rsplit(" ", 1)[0]] = i + 4
    return [[0, *(vocab.get(p, 3) for p in line.split(" ")), 2] for line in _head(books / "train.review.spm", N_LINES)]


# ---------------------------------------------------------------------------------------------- the lab's ids


def test_lab_ids_from_the_pieces_file(lab: Tokenizer, lab_ids: list[list[int]], books: Path) -> None:
    assert lab.vocab_size == 50_001
    lines = _head(books / "train.review.spm", N_LINES)
    got = [lab.with_max_len(10_000).encode_pieces(line.split(" ")) for line in lines]
    assert got == lab_ids
    assert max(len(ids) for ids in got) > 512  # some reviews are long enough to test the cut below


def test_lab_ids_from_the_raw_text_file(lab: Tokenizer, lab_ids: list[list[int]], books: Path) -> None:
    texts = _head(books / "train.review.txt", N_LINES)
    uncut = lab.with_max_len(10_000)
    assert uncut.encode_batch(texts) == lab_ids
    assert [uncut.encode(t) for t in texts[:10]] == lab_ids[:10]
    known = [i for i, ids in enumerate(lab_ids) if Tokenizer.OOV not in ids]
    assert len(known) > 90  # decode gives the text back where no piece became <oov>
    assert [lab.decode(lab_ids[i]) for i in known] == [texts[i] for i in known]


def test_cut_to_max_len_keeps_sos_and_eos(lab: Tokenizer, lab_ids: list[list[int]], books: Path) -> None:
    texts = _head(books / "train.review.txt", N_LINES)
    cut = [ids[:511] + [2] if len(ids) > 512 else ids for ids in lab_ids]  # 512 ids in total, <eos> kept
    assert lab.encode_batch(texts) == cut
    lines = _head(books / "train.review.spm", N_LINES)
    assert [lab.encode_pieces(line.split(" ")) for line in lines] == cut
    short = lab.with_max_len(7).encode(texts[0])
    assert short == lab_ids[0][:6] + [2] and len(short) == 7
    assert lab.max_len == 512  # with_max_len gives another tokenizer; this one still cuts at 512
    with pytest.raises(TokenizerError, match=r"max_len must be an int >= 3 \(<sos>, one piece, <eos>\), got 2"):
        lab.with_max_len(2)


def test_unknown_characters_and_pieces_become_oov(lab: Tokenizer, books: Path) -> None:
    ids = lab.encode("un livre ☃ superbe")
    assert ids[0] == Tokenizer.SOS and ids[-1] == Tokenizer.EOS and Tokenizer.OOV in ids
    assert "⁇" in lab.decode(ids)
    assert lab.encode_pieces(["▁un", "pas-une-pièce"]) == [0, lab.piece_to_id("▁un"), 3, 2]
    assert lab.piece_to_id("<pad>") == Tokenizer.OOV  # special names are not pieces
    assert [lab.id_to_piece(i) for i in range(5)] == ["<sos>", "<pad>", "<eos>", "<oov>", "▁d"]
    # A vocabulary with a piece the model lacks (a foreign dict) gets it by its surface string, as the contract says.
    dict_lines = (books / "dict.txt").read_text(encoding="utf-8").split("\n")[:-1]
    foreign = Tokenizer((books / "sentencepiece.french.model").read_bytes(),
                        [line.rsplit(" ", 1)[0] for line in dict_lines] + ["☃"], "lab", 64)
    assert foreign.encode("un livre ☃ superbe")[1:-1] == [
        foreign.piece_to_id(p) for p in ["▁un", "▁livre", "▁", "☃", "▁superbe"]
    ]
    assert foreign.piece_to_id("☃") == 50_001


def test_encode_example_picks_pieces_or_text(lab: Tokenizer, tiny_tokenizer: Tokenizer, books: Path) -> None:
    from trainer.data.readers import iter_texts

    spm_ex = next(iter_texts(books / "train.review.spm"))
    txt_ex = next(iter_texts(books / "train.review.txt"))
    assert lab.encode_example(spm_ex) == lab.encode_example(txt_ex)
    # A trained tokenizer cannot use the lab's pieces: it re-encodes their detokenized text (== the .txt line).
    assert detokenize(spm_ex.pieces or []) == txt_ex.text
    assert tiny_tokenizer.encode_example(spm_ex) == tiny_tokenizer.encode(txt_ex.text or "")


# ---------------------------------------------------------------------------------------------- training, folders


def test_train_tiny_is_deterministic_and_round_trips(tiny_tokenizer: Tokenizer, books: Path, tmp_path: Path) -> None:
    tok = tiny_tokenizer
    assert (tok.vocab_size, tok.max_len, tok.kind) == (99, 48, "train")
    assert len(tok.pieces) == 95 and not any(p in ("<unk>", "<s>", "</s>") for p in tok.pieces)
    texts = _head(books / "test.review.txt", 50)
    ids = tok.encode_batch(texts)
    assert all(len(x) <= 48 and x[0] == 0 and x[-1] == 2 for x in ids)
    assert all(0 <= i < 99 for i in itertools.chain(*ids))

    again = Tokenizer.train((t for t in _head(books / "train.review.txt", 2000)), 95, 48, train_lines=2000, seed=0)
    assert again.pieces == tok.pieces and again.fingerprint == tok.fingerprint  # same input, same model

    folder = tok.save(tmp_path / "tokenizer")
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "spm.model", "vocab.txt"]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta == {"format": 1, "kind": "train", "vocab_size": 99,  # no cut: the run's config holds it
                    "specials": {"sos": 0, "pad": 1, "eos": 2, "oov": 3}}
    assert (folder / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1] == tok.pieces
    loaded = Tokenizer.load(folder, 48)
    assert loaded.encode_batch(texts) == ids and loaded.fingerprint == tok.fingerprint
    tok.save(folder)  # saving over an existing folder replaces it
    assert Tokenizer.load(folder, 48).encode_batch(texts) == ids
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left behind


def test_train_errors_are_clear() -> None:
    with pytest.raises(TokenizerError, match="empty corpus"):
        Tokenizer.train(iter(["", "   "]), 95)
    with pytest.raises(TokenizerError, match="could not learn 20 pieces"):
        Tokenizer.train(["Une phrase avec assez de lettres différentes: xyzwkq, éèàç!"] * 5, 20)


def test_lab_round_trips_through_its_folder(lab: Tokenizer, lab_ids: list[list[int]], tmp_path: Path) -> None:
    loaded = Tokenizer.load(lab.save(tmp_path / "tokenizer"), 512)
    assert loaded.kind == "lab" and loaded.vocab_size == 50_001
    assert loaded.fingerprint == lab.fingerprint
    assert loaded.encode_pieces(loaded.pieces[:3]) == [0, 4, 5, 6, 2]


def test_load_errors_name_the_problem(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    good = tiny_tokenizer.save(tmp_path / "good")
    with pytest.raises(TokenizerError, match="tokenizer folder not found"):
        Tokenizer.load(tmp_path / "nowhere", 48)

    missing = shutil.copytree(good, tmp_path / "missing")
    (missing / "vocab.txt").unlink()
    with pytest.raises(TokenizerError, match="missing vocab.txt"):
        Tokenizer.load(missing, 48)

    size = shutil.copytree(good, tmp_path / "size")
    meta = json.loads((size / "meta.json").read_text())
    (size / "meta.json").write_text(json.dumps({**meta, "vocab_size": 120}))
    with pytest.raises(TokenizerError, match=r"95 pieces .* 99 ids\) but meta.json says vocab_size 120"):
        Tokenizer.load(size, 48)

    bad_json = shutil.copytree(good, tmp_path / "bad_json")
    (bad_json / "meta.json").write_text('{"format": 1,')
    with pytest.raises(TokenizerError, match="meta.json: invalid JSON"):
        Tokenizer.load(bad_json, 48)

    corrupt = shutil.copytree(good, tmp_path / "corrupt")
    (corrupt / "spm.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a sentencepiece model"):
        Tokenizer.load(corrupt, 48)


def test_from_lab_errors(books: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="sentencepiece model not found"):
        Tokenizer.from_lab(tmp_path / "none.model", books / "dict.txt")
    bad = tmp_path / "dict.txt"
    bad.write_text("▁d 1\nes\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"dict.txt:2: expected 'piece count'"):
        Tokenizer.from_lab(books / "sentencepiece.french.model", bad)


# ---------------------------------------------------------------------------------------------- build_tokenizer


def test_build_tokenizer_trains_or_loads_and_checks_the_model_size(data_dir: Path, tmp_path: Path) -> None:
    cfg = override(tiny(), {"data.root": str(data_dir), "data.pretrain": "cls-books-fr/train.review.spm"})
    tok = build_tokenizer(cfg)  # .spm pieces are detokenized: the same text as train.review.txt
    assert tok.kind == "train" and tok.vocab_size == 99
    from_txt = build_tokenizer(override(cfg, {"data.pretrain": "cls-books-fr/train.review.txt"}))
    assert from_txt.pieces == tok.pieces
    # A table whose text column is named by data.text_field (quoted CSV fields): the same texts, the same pieces.
    import csv

    table = tmp_path / "reviews.csv"
    with open(table, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "review"])
        w.writerows([i, e.text] for i, e in enumerate(iter_texts(data_dir / "cls-books-fr/train.review.txt")))
    from_csv = build_tokenizer(override(cfg, {"data.pretrain": str(table), "data.text_field": "review"}))
    assert from_csv.pieces == tok.pieces

    with pytest.raises(ConfigError, match=r"tokenizer.vocab_size=95 plus the 4 specials give 99 ids, "
                                          r"but model.vocab_size=100"):
        build_tokenizer(override(cfg, {"model.vocab_size": 100}))

    lab_cfg = override(cfg, {"tokenizer.kind": "lab", "model.vocab_size": 50_001})
    assert build_tokenizer(lab_cfg).vocab_size == 50_001
    with pytest.raises(ConfigError, match=r"the lab tokenizer: the tokenizer has 50001 ids, but model.vocab_size=99"):
        build_tokenizer(override(lab_cfg, {"model.vocab_size": 99}))


def test_a_tokenizer_folder_gives_the_ids_and_the_run_config_the_cut(tiny_tokenizer_dir: Path, data_dir: Path,
                                                                      tmp_path: Path) -> None:
    """`--tokenizer FOLDER` with tokenizer.max_len=40, a folder written by a 48-long run: the run cuts at 40, and the
    folder it keeps holds no cut (config.json is where the artifact stores it)."""
    from trainer.tasks.tokenizer_folder import run_tokenizer

    (tmp_path / "run").mkdir()
    cfg = override(tiny(), {"data.root": str(data_dir), "tokenizer.max_len": 40})
    tok = run_tokenizer(cfg, tmp_path / "run", tiny_tokenizer_dir)
    assert tok.max_len == 40 and len(tok.encode("Un livre " * 100)) == 40
    assert "max_len" not in json.loads((tmp_path / "run" / "tokenizer" / "meta.json").read_text())
