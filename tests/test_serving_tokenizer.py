"""serving/tokenizer.py: the COMMON.md token-id contract, and the same ids as trainer/tokenizer.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from serving_fixtures import reviews

from serving.errors import BundleError
from serving.tokenizer import EOS, OOV, SOS, Tokenizer


def test_same_ids_as_the_trainer_on_real_reviews(tiny_tokenizer_dir: Path, data_dir: Path) -> None:
    """The server must feed the model exactly what it was trained on: 300 test reviews, tiny trained tokenizer."""
    from trainer.tokenizer import Tokenizer as TrainerTokenizer

    ours, theirs = Tokenizer.load(tiny_tokenizer_dir), TrainerTokenizer.load(tiny_tokenizer_dir)
    texts = reviews(data_dir, 300)
    texts += [t[:20] for t in texts[:100]]  # at 95 pieces every full review passes max_len 48: add short ones
    truncated = 0
    for text in texts:
        e = ours.encode(text)
        assert e.ids.tolist() == theirs.encode(text), text[:80]
        truncated += e.truncated
    assert 0 < truncated < len(texts)  # max_len 48: both sides of the cut were exercised


@pytest.mark.parametrize("max_len", [512, 40])
def test_same_ids_as_the_trainer_with_the_lab_vocabulary(tmp_path: Path, data_dir: Path, max_len: int) -> None:
    """The lab's model + dict.txt (a vocabulary foreign to the model: unknown surface pieces), uncut and cut."""
    from trainer.tokenizer import Tokenizer as TrainerTokenizer

    books = data_dir / "cls-books-fr"
    folder = TrainerTokenizer.from_lab(books / "sentencepiece.french.model", books / "dict.txt", max_len).save(
        tmp_path / "tokenizer")
    ours, theirs = Tokenizer.load(folder), TrainerTokenizer.load(folder)
    for text in reviews(data_dir, 200, split="valid"):
        assert ours.encode(text).ids.tolist() == theirs.encode(text), text[:80]


def _folder_with_vocab(src: Path, dst: Path, pieces: list[str], max_len: int) -> Path:
    shutil.copytree(src, dst)
    (dst / "vocab.txt").write_text("".join(p + "\n" for p in pieces), encoding="utf-8")
    meta = json.loads((dst / "tokenizer.json").read_text())
    meta.update(vocab_size=len(pieces) + 4, max_len=max_len)
    (dst / "tokenizer.json").write_text(json.dumps(meta))
    return dst


def test_sequence_layout_oov_and_the_exact_cut(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    full = Tokenizer.load(tiny_tokenizer_dir)
    text = "Un roman superbe, que je relirai volontiers."
    pieces = full.processor.encode(text, out_type=str)
    vocab = sorted(set(pieces))[::2]  # half the pieces are known, the others must become <oov>
    n = len(pieces)
    exact = Tokenizer.load(_folder_with_vocab(tiny_tokenizer_dir, tmp_path / "a", vocab, max_len=n + 2))
    e = exact.encode(text)
    expected = [SOS, *(vocab.index(p) + 4 if p in vocab else OOV for p in pieces), EOS]
    assert e.ids.tolist() == expected and e.token_count == n + 2 and not e.truncated
    assert OOV in expected and any(i >= 4 for i in expected)

    cut = Tokenizer.load(_folder_with_vocab(tiny_tokenizer_dir, tmp_path / "b", vocab, max_len=n + 1))
    c = cut.encode(text)
    assert c.ids.tolist() == [*expected[: n], EOS] and c.token_count == n + 1 and c.truncated


def test_bad_folders_name_the_file(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    missing = shutil.copytree(tiny_tokenizer_dir, tmp_path / "missing")
    (missing / "vocab.txt").unlink()
    with pytest.raises(BundleError, match="vocab.txt"):
        Tokenizer.load(missing)

    wrong_size = shutil.copytree(tiny_tokenizer_dir, tmp_path / "size")
    with open(wrong_size / "vocab.txt", "a", encoding="utf-8") as f:
        f.write("extra-piece\n")
    with pytest.raises(BundleError, match="vocab_size"):
        Tokenizer.load(wrong_size)

    dup = _folder_with_vocab(tiny_tokenizer_dir, tmp_path / "dup", ["▁le", "▁la", "▁le"], max_len=20)
    with pytest.raises(BundleError, match="line 3"):
        Tokenizer.load(dup)

    corrupt = shutil.copytree(tiny_tokenizer_dir, tmp_path / "corrupt")
    (corrupt / "spm.model").write_bytes(b"not a model")
    with pytest.raises(BundleError, match="spm.model"):
        Tokenizer.load(corrupt)
