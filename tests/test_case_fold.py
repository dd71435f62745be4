"""tokenizer.case_fold: a trained sentencepiece model that folds case in its own normalizer (nmt_nfkc_cf), so that a
review's capitalised first word gets the pieces of the same word inside a sentence, in training and in the server
alike (the rule travels in spm.model); a config and a tokenizer folder that disagree are a one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.tokens import TOKENIZER_FILES, TokenEncoder, read_tokenizer_files
from trainer.config.choice import Choice
from trainer.config.schema import ConfigError
from trainer.data.tokenizer import Tokenizer
from trainer.tasks.tokenizer_folder import run_tokenizer

CASES = [("Ennuyeux du début à la fin.", "ennuyeux du début à la fin."),
         ("MAUVAIS livre, à éviter.", "mauvais livre, à éviter.")]


@pytest.fixture(scope="module")
def lines(data_dir: Path) -> list[str]:
    return (data_dir / "cls-books-fr" / "train.review.txt").read_text(encoding="utf-8").splitlines()[:600]


def test_a_folding_model_gives_one_word_one_set_of_pieces_in_the_server_too(lines: list[str],
                                                                             tmp_path: Path) -> None:
    cased = Tokenizer.train(lines, 301, 37, train_lines=600, seed=0)
    folded = Tokenizer.train(lines, 301, 37, train_lines=600, seed=0, case_fold=True)
    assert (cased.case_fold, folded.case_fold) == (False, True)
    for upper, lower in CASES:
        assert cased.encode(upper) != cased.encode(lower)  # the default keeps case, as before
        assert folded.encode(upper) == folded.encode(lower)
    # the server's encoder (contract/, read from a bundle's tokenizer/ bytes) folds alike: the rule is in spm.model
    folder = folded.save(tmp_path / "tokenizer")
    files = read_tokenizer_files({n: (folder / n).read_bytes() for n in TOKENIZER_FILES}, folder)
    served = TokenEncoder.from_files(files, 37)
    for upper, lower in CASES:
        assert served.encode(upper).ids.tolist() == folded.encode(lower)
    assert Tokenizer.load(folder, 37).case_fold


def test_case_fold_is_for_a_trained_tokenizer_only() -> None:
    with pytest.raises(ConfigError, match=r"tokenizer.case_fold needs tokenizer.kind=train \(the lab's model keeps"):
        Choice("tiny", None, ["tokenizer.kind=lab", "tokenizer.case_fold=true"]).resolve()
    assert Choice("tiny", None, ["tokenizer.case_fold=true"]).resolve().tokenizer.case_fold


def test_a_given_folder_that_disagrees_with_the_config_is_refused(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    cfg = Choice("tiny", None, ["tokenizer.case_fold=true"]).resolve()
    with pytest.raises(ConfigError, match=r"the tokenizer keeps case but tokenizer.case_fold=True; set it to False"):
        run_tokenizer(cfg, tmp_path / "run", tiny_tokenizer_dir)
    assert not (tmp_path / "run" / "tokenizer").exists()  # refused before it was copied into the run
    ok = run_tokenizer(Choice("tiny", None, []).resolve(), tmp_path / "run2", tiny_tokenizer_dir)
    assert not ok.case_fold


def test_the_demo_folds_case_and_the_lab_preset_cannot() -> None:
    from trainer.config.presets import preset

    assert preset("demo").tokenizer.case_fold  # docs/RESULTS.md, Behaviour: short reviews 83.33% -> 91.67%
    assert not preset("lab").tokenizer.case_fold and preset("lab").tokenizer.kind == "lab"
