"""contract/tokens.py, the encoder the server runs (the trainer's Tokenizer wraps the same one), on real reviews:
sequences decode back to their text, ids follow vocab.txt's lines, the cut is exact, unknown pieces are <oov>, and
the lab's vocabulary gives the lab's ids. Then the tokenizer folder's refusals."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from procs import REPO
from serving_fixtures import reviews

from contract.errors import TokenizerError
from contract.tokens import EOS, OOV, SOS, TOKENIZER_FILES, TokenEncoder, read_tokenizer_files
from trainer.data.tokenizer import Tokenizer


def encoder_of(folder: Path, max_len: int = 48) -> TokenEncoder:
    """The server's route: the folder's bytes, checked, then the encoder (at the tiny preset's max_len)."""
    files = read_tokenizer_files({n: (folder / n).read_bytes() for n in TOKENIZER_FILES}, folder)
    return TokenEncoder.from_files(files, max_len)


@pytest.fixture(scope="module")
def texts(data_dir: Path) -> list[str]:
    """300 test reviews, and 100 short cuts of them (at max_len 48 every full review of the tiny tokenizer is cut)."""
    full = reviews(data_dir, 300)
    return full + [t[:20] for t in full[:100]]


def test_real_reviews_decode_back_to_their_text(tiny_tokenizer_dir: Path, tiny_tokenizer: Tokenizer,
                                                texts: list[str]) -> None:
    """The trainer's decode (our id -> sentencepiece id, written apart from the encoder) gives back what
    sentencepiece itself reads in each text, so every id names the right piece."""
    enc = encoder_of(tiny_tokenizer_dir)
    sp = enc.processor
    checked = 0
    for text in texts:
        e = enc.encode(text)
        ids = e.ids.tolist()
        assert ids[0] == SOS and ids[-1] == EOS and e.token_count == len(ids) <= 48
        n_pieces = len(sp.encode(text))
        assert e.truncated == (n_pieces > 46) and len(ids) == min(n_pieces, 46) + 2
        if OOV not in ids:
            assert tiny_tokenizer.decode(ids) == sp.decode(sp.encode(text)[:46]), text[:80]
            checked += 1
    assert checked > 100  # most texts have no <oov> at 95 pieces: the check above ran on them


def test_ids_follow_the_lines_of_vocab_txt(tiny_tokenizer_dir: Path, tmp_path: Path, texts: list[str]) -> None:
    """Reversing vocab.txt reverses the piece ids (line i of n -> id n - 1 - i + 4) and nothing else: the ids come
    from the vocabulary file, not from the sentencepiece model's own numbering."""
    rev = Path(shutil.copytree(tiny_tokenizer_dir, tmp_path / "reversed"))
    lines = (rev / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    (rev / "vocab.txt").write_text("".join(p + "\n" for p in reversed(lines)), encoding="utf-8")
    enc, enc_rev = encoder_of(tiny_tokenizer_dir), encoder_of(rev)
    n = len(lines)
    for text in texts[:100]:
        ids, ids_rev = enc.encode(text).ids, enc_rev.encode(text).ids
        pieces = ids >= 4
        assert (ids_rev[~pieces] == ids[~pieces]).all()
        assert (ids_rev[pieces] == n - 1 - (ids[pieces] - 4) + 4).all()


def test_the_cut_is_exact_at_max_len(tiny_tokenizer_dir: Path, texts: list[str]) -> None:
    enc = encoder_of(tiny_tokenizer_dir, max_len=10_000)
    for text in texts[:50]:
        whole = enc.encode(text)
        n = whole.token_count - 2  # pieces
        fits = encoder_of(tiny_tokenizer_dir, max_len=n + 2).encode(text)
        assert not fits.truncated and fits.ids.tolist() == whole.ids.tolist()
        if n >= 2:
            cut = encoder_of(tiny_tokenizer_dir, max_len=n + 1).encode(text)
            assert cut.truncated and cut.ids.tolist() == [*whole.ids[:n].tolist(), EOS]


def test_pieces_missing_from_the_vocabulary_are_oov(tiny_tokenizer_dir: Path, tmp_path: Path,
                                                    texts: list[str]) -> None:
    """Dropping the last half of vocab.txt's lines turns exactly those pieces into <oov>; the others keep their
    ids (their lines did not move). A character the model lacks is <oov> too."""
    half = Path(shutil.copytree(tiny_tokenizer_dir, tmp_path / "half"))
    lines = (half / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    keep = len(lines) // 2
    (half / "vocab.txt").write_text("".join(p + "\n" for p in lines[:keep]), encoding="utf-8")
    meta = json.loads((half / "meta.json").read_text())
    (half / "meta.json").write_text(json.dumps({**meta, "vocab_size": keep + 4}))
    enc, enc_half = encoder_of(tiny_tokenizer_dir), encoder_of(half)
    changed = 0
    for text in texts[:100]:
        ids, ids_half = enc.encode(text).ids, enc_half.encode(text).ids
        dropped = ids >= keep + 4
        assert (ids_half[dropped] == OOV).all() and (ids_half[~dropped] == ids[~dropped]).all()
        changed += int(dropped.sum())
    assert changed > 0
    assert OOV in enc.encode("un livre ☃ superbe").ids.tolist()


def test_the_lab_vocabulary_gives_the_labs_ids(data_dir: Path, tmp_path: Path) -> None:
    """The lab's model + dict.txt (a vocabulary foreign to the model: some pieces are surface strings the model
    lacks): the server's encoder gives, text by text, the ids of the lab's own pre-tokenized .spm file looked up in
    dict.txt (line i -> id i + 4)."""
    books = data_dir / "cls-books-fr"
    folder = Tokenizer.from_lab(books / "sentencepiece.french.model", books / "dict.txt", 10_000).save(
        tmp_path / "tokenizer")
    enc = encoder_of(folder, 10_000)
    dict_ids = {line.rsplit(" ", 1)[0]: i + 4
                for i, line in enumerate((books / "dict.txt").read_text(encoding="utf-8").split("\n")[:-1])}
    with open(books / "valid.review.txt", encoding="utf-8", newline="\n") as f_txt, \
            open(books / "valid.review.spm", encoding="utf-8", newline="\n") as f_spm:
        pairs = list(itertools.islice(zip(f_txt, f_spm, strict=True), 200))
    for text, pieces in pairs:
        want = [SOS, *(dict_ids.get(p, OOV) for p in pieces.rstrip("\n").split(" ") if p), EOS]
        assert enc.encode(text.rstrip("\n")).ids.tolist() == want, text[:80]


def test_encode_many_equals_encode_text_by_text(data_dir: Path, tmp_path: Path) -> None:
    """The server's request path encodes a call's texts in one go (`encode_many`): the same ids and truncation flags
    as one text at a time, with a foreign vocabulary's holes, texts cut at max_len, and texts with no pieces."""
    books = data_dir / "cls-books-fr"
    folder = Tokenizer.from_lab(books / "sentencepiece.french.model", books / "dict.txt", 10_000).save(
        tmp_path / "tokenizer")
    enc = encoder_of(folder, max_len=37)  # odd-sized: many reviews are cut
    with open(books / "valid.review.txt", encoding="utf-8", newline="\n") as f:
        texts = [line.rstrip("\n") for line in itertools.islice(f, 150)]
    texts += ["", "\u200b", "un livre ☃ superbe", "x"]
    many = enc.encode_many(texts)
    one = [enc.encode(t) for t in texts]
    assert [(e.ids.tolist(), e.truncated) for e in many] == [(e.ids.tolist(), e.truncated) for e in one]
    assert any(e.truncated for e in one) and any(not e.truncated for e in one)
    assert any(OOV in e.ids.tolist() for e in one)
    assert all(e.ids.dtype == np.int64 for e in many)


def test_tokenizer_folder_refusals_name_the_file(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    def folder(name: str, **files: bytes) -> Path:
        f = Path(shutil.copytree(tiny_tokenizer_dir, tmp_path / name))
        for n, data in files.items():
            (f / n.replace("_", ".")).write_bytes(data)
        return f

    vocab = (tiny_tokenizer_dir / "vocab.txt").read_bytes()
    cases = {
        "size": (folder("size", vocab_txt=vocab + b"extra\n"), r"vocab\.txt has 96 pieces .* vocab_size 99"),
        "dup": (folder("dup", vocab_txt=vocab.replace(vocab.split(b"\n")[2], vocab.split(b"\n")[0], 1)),
                "vocabulary line 3: piece .* repeats line 1"),
        "utf8": (folder("utf8", vocab_txt=b"\xff\n" + vocab.split(b"\n", 1)[1]), r"vocab\.txt:1: not valid UTF-8"),
        "utf8 later": (folder("utf8-later", vocab_txt=b"\n".join([*vocab.split(b"\n")[:2], b"z\xff",
                                                                   *vocab.split(b"\n")[3:]])),
                       r"vocab\.txt:3: not valid UTF-8 \(byte 0xff at column 2\)"),
        "model": (folder("model", spm_model=b"not a model"), "not a sentencepiece model"),
        "json": (folder("json", meta_json=b'{"format": 1,'), r"meta\.json: invalid JSON"),
        "deep": (folder("deep", meta_json=b"[" * 100_000 + b"]" * 100_000), r"meta\.json: invalid JSON"),
        "specials": (folder("specials", meta_json=(tiny_tokenizer_dir / "meta.json").read_bytes()
                            .replace(b'"pad": 1', b'"pad": 5')), "specials .* differ"),
    }
    for f, message in cases.values():
        with pytest.raises(TokenizerError, match=message):
            encoder_of(f)
        with pytest.raises(TokenizerError, match=message):  # the trainer reads folders through the same checks
            Tokenizer.load(f, 48)


def test_a_tokenizer_read_again_shares_its_tables_and_cuts_at_its_own_max_len(tiny_tokenizer_dir: Path,
                                                                             tmp_path: Path) -> None:
    """A server loading a new version of a model builds its tokenizer's tables once (they are the pretraining's);
    each encoder still cuts at its own max_len, and another vocabulary gets tables of its own."""
    a, b = encoder_of(tiny_tokenizer_dir, max_len=7), encoder_of(tiny_tokenizer_dir, max_len=9)
    assert a.spm_to_id is b.spm_to_id and (a.max_len, b.max_len) == (7, 9)
    text = "un livre vraiment magnifique, je le recommande à tous"
    assert a.encode(text).token_count == 7 and b.encode(text).token_count == 9
    other = Path(shutil.copytree(tiny_tokenizer_dir, tmp_path / "reversed"))
    lines = (other / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    (other / "vocab.txt").write_text("".join(p + "\n" for p in reversed(lines)), encoding="utf-8")
    assert encoder_of(other, max_len=7).spm_to_id is not a.spm_to_id


def test_encoded_ids_are_int64_arrays(tiny_tokenizer_dir: Path) -> None:
    e = encoder_of(tiny_tokenizer_dir).encode("")
    assert e.ids.dtype == np.int64 and e.ids.tolist() == [SOS, EOS] and not e.truncated


def test_the_server_loads_a_bundle_without_torch_or_trainer(tiny_bundle: Path) -> None:
    """The contract is what lets serving/ share the trainer's rules without importing the trainer (or torch)."""
    script = ("import sys; from serving.model.predictor import Predictor; import serving.server; "
              "Predictor(sys.argv[1], device='cpu').predict(['Bien.']); "
              "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'trainer', 'deepspeed'}))")
    run = subprocess.run([sys.executable, "-c", script, str(tiny_bundle)], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[-2] == "[]"



def test_a_max_len_under_3_is_refused_alike_by_every_reader(tiny_tokenizer_dir: Path, tiny_bundle: Path,
                                                              tiny_classifier_artifact: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """<sos>, one piece, <eos>: the rule of contract/tokens.py, and the same one-line error wherever a max_len is
    read (the tokenizer, a bundle's manifest, export, the run config), each naming its source."""
    from bundles import edit_manifest

    from contract.bundle import verify_bundle
    from contract.errors import BundleError
    from trainer.__main__ import main as trainer_cli
    from trainer.config.presets import tiny
    from trainer.config.schema import ConfigError, override
    from trainer.export import ExportError, ExportOptions

    def refusal(error: type[Exception], call: Callable[[], object]) -> str:
        with pytest.raises(error) as e:
            call()
        return str(e.value)

    bundle = Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))
    tok = Tokenizer.load(tiny_tokenizer_dir, 48)
    for bad in (2, 0, -1, True):
        edit_manifest(bundle, lambda m, bad=bad: m.update(max_len=bad), sealed=True)
        seen = [
            ("max_len", refusal(TokenizerError, lambda bad=bad: encoder_of(tiny_tokenizer_dir, bad))),
            (f"{tiny_tokenizer_dir}: max_len", refusal(TokenizerError,
                                                        lambda bad=bad: Tokenizer.load(tiny_tokenizer_dir, bad))),
            ("max_len", refusal(TokenizerError, lambda bad=bad: tok.with_max_len(bad))),
            (f"{bundle / 'manifest.json'}: field 'max_len'", refusal(BundleError, lambda: verify_bundle(bundle))),
            ("max_len", refusal(ExportError, lambda bad=bad: ExportOptions(max_len=bad))),
        ]
        if bad is not True:  # the config's pydantic reads true as 1; --set never sends a bool
            seen.append(("tokenizer.max_len", refusal(ConfigError, lambda bad=bad: override(
                tiny(), [f"tokenizer.max_len={bad}"]))))
        for where, message in seen:
            assert message == f"{where} must be an int >= 3 (<sos>, one piece, <eos>), got {bad!r}"
    # The export command line: that line, exit 2, nothing written.
    rc = trainer_cli(["export", str(tiny_classifier_artifact), "--out", str(tmp_path / "out"), "--max-len", "2"])
    assert rc == 2 and not (tmp_path / "out").exists()
    assert capsys.readouterr().err == "error: max_len must be an int >= 3 (<sos>, one piece, <eos>), got 2\n"
