"""data.crops: short training examples cut from each training text's first and last sentence (trainer/data/crops.py).
Only the training split gets them, with their text's label, and a wrong value is a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.config.choice import Choice
from trainer.config.schema import ConfigError
from trainer.data.crops import crops_of, sentences
from trainer.data.labelled import load
from trainer.data.readers import Example

REVIEW = ("Un roman lu d'une traite, sans ennui. L'intrigue se perd un peu au milieu, entre deux voyages et "
          "trop de personnages secondaires. Je le recommande à tous mes amis !")


def test_sentences_end_at_stops_followed_by_space() -> None:
    assert sentences("Bof... Trop long ?! Mais 3.5 sur 5.") == ["Bof...", "Trop long ?!", "Mais 3.5 sur 5."]
    assert sentences("  une seule phrase sans point ") == ["une seule phrase sans point"]


def test_first_and_last_sentence_of_3_to_25_words_keep_the_label() -> None:
    ex = Example(REVIEW, None, 1, "r.jsonl:7")
    got = crops_of(ex, ["first", "last"])
    assert [(c.text, c.label, c.source) for c in got] == [
        ("Un roman lu d'une traite, sans ennui.", 1, "r.jsonl:7 (first sentence)"),
        ("Je le recommande à tous mes amis !", 1, "r.jsonl:7 (last sentence)")]
    assert [c.text for c in crops_of(ex, ["last"])] == ["Je le recommande à tous mes amis !"]
    # one sentence: the crop would be the review again; two words, or 26: not a short review
    assert crops_of(Example("Un seul avis, une seule phrase.", None, 0, "x"), ["first", "last"]) == []
    long = " ".join(["mot"] * 26) + ". Bien trop court."
    assert [c.text for c in crops_of(Example(long, None, 0, "x"), ["first", "last"])] == ["Bien trop court."]
    assert crops_of(Example("Nul. " + long, None, 0, "x"), ["first"]) == []


def test_pieces_of_an_spm_file_are_cropped_as_their_text() -> None:
    pieces = "▁Très ▁bon ▁livre ▁vraiment . ▁Le ▁reste ▁est ▁long ▁et ▁lourd .".split()
    assert [c.text for c in crops_of(Example(None, pieces, 1, "t.spm:1"), ["first", "last"])] == [
        "Très bon livre vraiment.", "Le reste est long et lourd."]


def test_only_the_training_split_gets_crops(tmp_path: Path) -> None:
    files = {}
    for split, n in (("train", 13), ("valid", 5), ("test", 7)):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps({"text": f"{REVIEW} Avis {split} {i}.", "label": str(i % 2)})
                                        + "\n" for i in range(n)))
    sets = [f"data.{s}={f}" for s, f in files.items()] + ["data.labels=0,1"]
    plain = load(Choice("tiny", None, sets).resolve())
    cfg = Choice("tiny", None, [*sets, "data.crops=first,last"]).resolve()
    data = load(cfg)
    assert len(plain.train.examples) == 13 and len(data.train.examples) == 13 + 2 * 13
    assert data.train.examples[:13] == plain.train.examples  # the reviews first, unchanged
    assert [ex.label for ex in data.train.examples[13:15]] == [0, 0] and data.train.examples[15].label == 1
    assert data.train.source == str(files["train"])  # the file (a path), not how it was augmented
    assert any(line.endswith(f"train: {files['train']} + 26 crops (data.crops=first,last): 39 examples; 0 21, 1 18")
               for line in data.summary(cfg))
    # what the TF-IDF baseline fits and a tokenizer trains on: the reviews alone (with the crops, the demo's bar
    # would fall from 85.30 to 84.15)
    assert data.train.originals == plain.train.examples == plain.train.originals and data.train.crops == 26
    assert (len(data.valid.examples), len(data.test.examples)) == (5, 7)
    assert data.test.examples == plain.test.examples and data.valid.examples == plain.valid.examples
    # the cap counts reviews; their crops come after it
    capped = load(Choice("tiny", None, [*sets, "data.crops=last", "data.max_train_examples=4"]).resolve())
    assert len(capped.train.examples) == 4 + 4


@pytest.mark.parametrize("value", ["middle", "first,first"])
def test_a_wrong_crop_is_a_one_line_error(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^data.crops takes first, last or both, each once \(none: data.crops=\), "
                                          r"got \["):
        Choice("tiny", None, [f"data.crops={value}"]).resolve()


def test_the_demo_trains_on_crops_and_the_error_names_the_way_off() -> None:
    assert Choice("demo").resolve().data.crops == ["first", "last"]
    assert Choice("demo", None, ["data.crops="]).resolve().data.crops == []
