"""A user's own data, in-process: what the config and the readers make of it. Each of these was a silent wrong result
or an unhelpful error before (label names detached from values, the preset's test file and caps borrowed, paths
under the data root, data found beside the installed package, a typo error without meanings)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from procs import REPO

from trainer.config.choice import Choice
from trainer.config.schema import ConfigError, valid_keys
from trainer.data.labelled import load, settle_labels, stratified_split
from trainer.data.readers import DataError, label_values, read_labeled


def own(*assignments: str, preset: str = "tiny") -> Choice:
    return Choice(preset, None, assignments)


# ---------------------------------------------------------------------------------------------- item 1: labels


def test_label_names_come_from_the_users_labels() -> None:
    """--set data.labels=pos,neg used to keep the preset's names (negative, positive) paired by position: every
    review labelled pos was served as "negative"."""
    cfg = own("data.train=r.jsonl", "data.labels=pos,neg").resolve()
    assert cfg.data.labels == ["pos", "neg"] and cfg.data.names == ["pos", "neg"]
    # even over the preset's own data (no file named), new labels drop the preset's names
    cfg = own("data.labels=pos,neg").resolve()
    assert cfg.data.names == ["pos", "neg"]


def test_label_names_given_as_pairs_follow_the_labels_order() -> None:
    cfg = own("data.train=r.jsonl", "data.labels=pos,neg", "data.label_names=neg:negative,pos:positive").resolve()
    assert cfg.data.names == ["positive", "negative"]  # head order: pos first
    cfg = own("data.train=r.jsonl", "data.labels=pos,neg", "data.label_names=good,bad").resolve()
    assert cfg.data.names == ["good", "bad"]  # given together, in the same order
    with pytest.raises(ConfigError, match=r"data.label_names pairs \['0:negative', '1:positive'\] must name each "
                                          r"of data.labels \['pos', 'neg'\] once"):
        own("data.train=r.jsonl", "data.labels=pos,neg", "data.label_names=0:negative,1:positive").resolve()
    with pytest.raises(ConfigError, match=r"data.label_names must be distinct and non-empty"):
        own("data.train=r.jsonl", "data.labels=pos,neg", "data.label_names=x,x").resolve()


def test_labels_are_the_training_files_values_when_not_given(tmp_path: Path) -> None:
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps({"text": f"t{i}", "label": lab}) + "\n"
                         for i, lab in enumerate([10, 2, 2, 10, 1, 1] * 5)))
    assert label_values(f) == ["1", "2", "10"]  # numbers in numeric order
    cfg = settle_labels(own(f"data.train={f}").resolve(), num_classes_set=False)
    assert cfg.data.labels == ["1", "2", "10"] and cfg.model.num_classes == 3 and cfg.data.names == cfg.data.labels
    with pytest.raises(ConfigError, match=r"model.num_classes=2 but .* holds 3 label values"):
        settle_labels(own(f"data.train={f}", "model.num_classes=2").resolve(), num_classes_set=True)
    (tmp_path / "one.jsonl").write_text('{"text": "a", "label": "pos"}\n')
    with pytest.raises(DataError, match=r"every example has label 'pos'; a classifier needs at least 2 classes"):
        settle_labels(own(f"data.train={tmp_path / 'one.jsonl'}").resolve(), num_classes_set=False)


# ---------------------------------------------------------------------------------------------- item 2: own data


def test_a_users_training_file_borrows_nothing_of_the_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--preset tiny --set data.train=mine.jsonl trained on 104 examples (the preset's cap), tested on the preset's
    French test file, with a tokenizer trained on French text."""
    monkeypatch.chdir(tmp_path)
    cfg = own("data.train=mine.jsonl").resolve()
    d = cfg.data
    assert (d.train, d.valid, d.test, d.pretrain, d.extra_test) == ("mine.jsonl", "", "", [], [])
    assert (d.max_train_examples, d.max_valid_examples, d.max_test_examples) == (0, 0, 0)
    assert d.labels == [] and d.label_names == []  # from the file, not the preset's 0/1
    assert d.root == str(tmp_path) and d.path("mine.jsonl") == tmp_path / "mine.jsonl"  # relative to the cwd
    assert cfg.tokenizer.kind == "train" and cfg.model.d_model == 32  # the rest of the preset stays
    # a relative data.root is the user's too, made absolute
    assert own("data.train=x.jsonl", "data.root=sub").resolve().data.root == str(tmp_path / "sub")


def test_the_lab_tokenizer_is_not_borrowed_for_own_data() -> None:
    with pytest.raises(ConfigError, match=r"preset 'lab' loads the lab's French tokenizer .*set tokenizer.kind=train"):
        own("data.train=x.jsonl", preset="lab").resolve()


def test_preset_data_come_from_ts_data_or_the_users_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never from beside the installed package (a wheel in a virtualenv looked in <venv>/lib/python3.X/shared), nor
    from beside the working directory: $TS_DATA, else $XDG_CACHE_HOME/transfer-sentiment/data, else ~/.cache/...,
    where `data fetch` puts the sets."""
    from trainer.config.presets import tiny

    monkeypatch.delenv("TS_DATA", raising=False)
    monkeypatch.chdir(tmp_path / ".")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny().data.root == str(tmp_path / "xdg" / "transfer-sentiment" / "data")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tiny().data.root == str(tmp_path / "home" / ".cache" / "transfer-sentiment" / "data")
    monkeypatch.setenv("TS_DATA", str(tmp_path / "sets"))
    assert tiny().data.root == str(tmp_path / "sets")
    with pytest.raises(ConfigError, match=r"data.root .*/sets: folder not found .*data fetch --preset NAME.*set "
                                          r"TS_DATA or --set data.root"):
        tiny().data.path("cls-books-fr/train.review.spm")


def test_an_installed_package_reads_the_data_named_by_ts_data(tmp_path: Path, data_dir: Path) -> None:
    """A non-editable install (the wheel's files, not the checkout) run from elsewhere finds the data sets."""
    src, site = tmp_path / "src", tmp_path / "site"  # a copy: setuptools writes build/ beside the sources
    for name in ("contract", "trainer", "serving", "proto"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True, capture_output=True, timeout=300)
    code = ("import trainer.config.presets as p; print(p.__file__); "
            "print(p.tiny().data.path('cls-books-fr/train.label'))")
    env = {**os.environ, "PYTHONPATH": str(site), "TS_DATA": str(data_dir)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0].startswith(str(site)) and Path(out[1]) == data_dir / "cls-books-fr" / "train.label"


def test_splits_are_stratified_seeded_and_disjoint(tmp_path: Path) -> None:
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps({"text": f"review {i}", "label": "pos" if i % 4 else "neg"}) + "\n"
                         for i in range(200)))  # 150 pos, 50 neg
    cfg = settle_labels(own(f"data.train={f}", "data.test_split=0.2").resolve(), num_classes_set=False)
    data = load(cfg)
    texts = [{ex.text for ex in part.examples} for part in (data.train, data.valid, data.test)]
    assert sum(map(len, texts)) == 200 and not (texts[0] & texts[1] or texts[0] & texts[2] or texts[1] & texts[2])
    neg = cfg.data.labels.index("neg")
    assert [sum(ex.label == neg for ex in p.examples) for p in (data.test, data.valid)] == [10, 4]  # 20%, 10% each
    assert len(data.test.examples) == 40 and len(data.valid.examples) == 16
    assert [ex.text for ex in load(cfg).test.examples] == [ex.text for ex in data.test.examples]  # seeded
    other = load(own(f"data.train={f}", "data.test_split=0.2", "seed=1", "data.labels=neg,pos").resolve())
    assert {ex.text for ex in other.test.examples} != texts[2]
    held, rest = stratified_split(read_labeled(f, ["neg", "pos"])[:3], 0.01, 0, 1)  # neg, pos, pos
    assert [ex.label for ex in held] == [1] and sorted(ex.label for ex in rest) == [0, 1]  # 2+: one on each side
    with pytest.raises(ConfigError, match=r"^no test set: name a labelled file with data.test=FILE, or hold out a "
                                          r"share of data.train with data.test_split=0.1$"):
        load(own(f"data.train={f}", "data.test_split=0", "data.labels=neg,pos").resolve())


# ---------------------------------------------------------------------------------------------- item 6: findable


def test_config_subcommand_prints_every_key_with_type_value_and_meaning() -> None:
    p = subprocess.run([sys.executable, "-m", "trainer", "config", "--preset", "tiny"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = {line.split(" = ")[0].strip(): line for line in p.stdout.splitlines()[1:]}
    assert set(lines) == set(valid_keys())
    for key, line in lines.items():
        value, _, rest = line.partition(" = ")[2].partition("  (")
        tp, _, meaning = rest.partition(") ")
        assert tp and len(meaning.strip()) > 8, f"{key}: no type or meaning in {line!r}"
    assert "(list of str) label values in head order" in lines["data.labels"]
    assert lines["data.max_train_examples"].split(" = ")[1].startswith("104 ")
    p = subprocess.run([sys.executable, "-m", "trainer", "config", "--preset", "tiny", "--set", "data.train=x.jsonl",
                        "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert json.loads(p.stdout)["data"]["test"] == ""


def test_a_typo_suggests_the_key_and_lists_its_section_not_every_key() -> None:
    with pytest.raises(ConfigError) as e:
        own("data.text_feild=review").resolve()
    msg = str(e.value)
    assert msg.startswith("unknown config key 'data.text_feild' (did you mean 'data.text_field'?); keys of 'data': ")
    assert "model.d_model" not in msg and msg.endswith("(every key, with its type and meaning: python -m trainer "
                                                       "config)")


def test_a_jsonl_field_error_names_the_option(tmp_path: Path) -> None:
    f = tmp_path / "r.jsonl"
    f.write_text('{"review": "fine", "stars": "pos"}\n')
    with pytest.raises(DataError) as e:
        read_labeled(f, ["pos"])
    assert str(e.value) == (f"{f}:1: no field 'text' (fields: ['review', 'stars']); name yours with "
                            "data.text_field=NAME (predict, export: --text-field NAME)")
    assert len(read_labeled(f, ["pos"], "review", "stars")) == 1


def test_a_headerless_tsv_is_reported_as_such(tmp_path: Path) -> None:
    f = tmp_path / "r.tsv"
    review = "This film was a long and careful study of patience, and I loved every minute of it."
    f.write_text(f"1\t{review}\n0\tDull.\n")
    with pytest.raises(DataError) as e:
        read_labeled(f, ["0", "1"])
    assert str(e.value).startswith(f"{f}:1: no header row: the first line reads like data (['1', 'This film was a "
                                   "long ...']); add a first line that names the columns")
    assert review not in str(e.value)
    g = tmp_path / "named.tsv"  # a header with other names is a header: the error names the option instead
    g.write_text("id\tbody\tstars\n1\tFine.\tgood\n")
    with pytest.raises(DataError, match=r"no column 'text' in the header \['id', 'body', 'stars'\]; name yours "
                                        r"with data.text_field=NAME"):
        read_labeled(g, ["good"])
    with pytest.raises(DataError, match=r"no column 'label' in the header \['id', 'body', 'stars'\]; name yours "
                                        r"with data.label_field=NAME"):
        read_labeled(g, ["good"], "body")
    assert read_labeled(g, ["good"], "body", "stars")[0].text == "Fine."


def test_suggestions_search_every_key_and_other_tools_names() -> None:
    """finetune.learning_rate got no suggestion, and the section's list hid finetune.optim.*, where lr lives."""
    for typed, meant in [("finetune.learning_rate", "finetune.optim.lr"), ("finetune.lr", "finetune.optim.lr"),
                         ("pretrain.learningrate", "pretrain.optim.lr"), ("engine.logging_steps", "engine.log_every"),
                         ("finetune.num_train_epochs", "finetune.epochs"), ("tokenizer.max_length",
                                                                             "tokenizer.max_len"),
                         ("finetune.batch_size", "finetune.micro_batch")]:
        with pytest.raises(ConfigError) as e:
            own(f"{typed}=1").resolve()
        assert str(e.value).startswith(f"unknown config key {typed!r} (did you mean {meant!r}?)"), str(e.value)
    with pytest.raises(ConfigError) as e:
        own("finetune.learning_rate=1e-3").resolve()
    assert "finetune.optim.lr, finetune.optim.weight_decay" in str(e.value)  # nested keys are listed too
    with pytest.raises(ConfigError, match=r"'learning_rate' \(did you mean 'pretrain.optim.lr' or "
                                          r"'finetune.optim.lr'\?\)"):
        own("learning_rate=1e-3").resolve()


def test_derived_keys_follow_their_source_unless_set() -> None:
    """Changing tokenizer.vocab_size stopped with "set model.vocab_size=1004"; listing 3 labels needed
    model.num_classes=3 too."""
    cfg = own("tokenizer.vocab_size=1000").resolve()
    assert cfg.model.vocab_size == 1004
    assert own("data.train=r.jsonl", "data.labels=a,b,c").resolve().model.num_classes == 3
    with pytest.raises(ConfigError, match=r"model.vocab_size=99; set model.vocab_size=1004"):
        own("tokenizer.vocab_size=1000", "model.vocab_size=99").resolve()  # set by the user: theirs, and checked
    with pytest.raises(ConfigError, match=r"model.num_classes=2 but data.labels has 3 classes"):
        own("data.train=r.jsonl", "data.labels=a,b,c", "model.num_classes=2").resolve()


def test_a_one_process_error_has_no_rank_prefix(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "trainer", "finetune", "--preset", "tiny", "--set",
                        "finetune.learning_rate=1e-3", "--out", str(tmp_path / "run")], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: unknown config key 'finetune.learning_rate' "
                                                             "(did you mean 'finetune.optim.lr'?)"), p.stderr
