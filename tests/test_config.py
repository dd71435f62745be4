"""Configs: presets build and validate, overrides are typed, unknown keys are errors that list the valid ones, every
range and every rule across sections is checked when a config is built (one line naming the key and the value)."""

from __future__ import annotations

import json

import pytest

from trainer.config.choice import Choice, resolve
from trainer.config.presets import PRESETS, preset
from trainer.config.schema import ConfigError, ModelConfig, OptimConfig, load, override


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_json(name, tmp_path):
    cfg = preset(name)
    (tmp_path / "config.json").write_text(cfg.to_json())
    assert load(tmp_path / "config.json") == cfg


def test_override_is_typed_and_nested():
    cfg = override(preset("tiny"), ["pretrain.optim.lr=0.01", "model.classifier_causal=false",
                                    "data.labels=neg,pos", "engine.zero_stage=2"])
    assert cfg.pretrain.optim.lr == 0.01 and cfg.model.classifier_causal is False
    assert cfg.data.labels == ["neg", "pos"] and cfg.engine.zero_stage == 2


def test_unknown_key_is_rejected_with_the_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'model.widht'; keys of 'model': .*model\.d_model.* "
                                          r"\(every key, with its type and meaning: python -m trainer config\)"):
        override(preset("tiny"), ["model.widht=3"])


@pytest.mark.parametrize("key, closest", [("model.d_modle", "'model.d_model'"),
                                          ("pretrian.max_steps", "'pretrain.max_steps'"),
                                          ("pretrain.lr", "'pretrain.optim.lr'"),
                                          ("optim.lr", "'pretrain.optim.lr' or 'finetune.optim.lr'")])
def test_unknown_key_suggests_the_closest_one(key: str, closest: str) -> None:
    with pytest.raises(ConfigError, match=rf"unknown config key '{key}' \(did you mean {closest}\?\); "):
        override(preset("tiny"), [f"{key}=1"])


def test_bad_values_name_the_field_and_value():
    with pytest.raises(ConfigError, match="model.n_heads=3 must divide model.d_model=32"):
        override(preset("tiny"), ["model.n_heads=3"])
    with pytest.raises(ConfigError, match="engine.zero_stage must be <= 3, got 4"):
        override(preset("tiny"), ["engine.zero_stage=4"])
    with pytest.raises(ConfigError, match="engine.keep_checkpoints must be >= 1, got 0"):
        override(preset("tiny"), ["engine.keep_checkpoints=0"])
    with pytest.raises(ConfigError, match="engine.checkpoint_every must be >= 0"):
        override(preset("tiny"), ["engine.checkpoint_every=-5"])
    with pytest.raises(ConfigError, match="model.d_model must be an integer, got 'wide'"):
        override(preset("tiny"), ["model.d_model=wide"])
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")
    with pytest.raises(ConfigError, match=r"^model.dropout must be < 1.0, got 1.5$"):  # built directly, too
        ModelConfig(dropout=1.5)


# Training inputs that used to run (a NaN loss, no step, an artifact anyway): each refused when the config is built.
@pytest.mark.parametrize("assignment, message", [
    ("pretrain.optim.lr=inf", "pretrain.optim.lr must be a finite number, got inf"),
    ("finetune.optim.lr=nan", "finetune.optim.lr must be a finite number, got nan"),
    ("pretrain.optim.lr=0", "pretrain.optim.lr must be > 0.0, got 0"),
    ("pretrain.max_steps=-5", "pretrain.max_steps must be >= 0, got -5"),
    ("finetune.max_steps=-1", "finetune.max_steps must be >= 0, got -1"),
    ("pretrain.optim.weight_decay=-0.01", "pretrain.optim.weight_decay must be >= 0.0, got -0.01"),
    ("finetune.optim.grad_clip=0", "finetune.optim.grad_clip must be > 0.0, got 0"),
    ("pretrain.optim.grad_clip=-1", "pretrain.optim.grad_clip must be > 0.0, got -1"),
    ("pretrain.optim.grad_clip=nan", "pretrain.optim.grad_clip must be a finite number, got nan"),
    ("pretrain.optim.warmup_steps=-3", "pretrain.optim.warmup_steps must be >= 0, got -3"),
    ("pretrain.epochs=0", "pretrain.epochs must be >= 1, got 0"),
    ("finetune.epochs=-2", "finetune.epochs must be >= 1, got -2"),
    ("pretrain.optim.betas=0.9,1.5", "pretrain.optim.betas.1 must be < 1.0, got 1.5"),
    ("seed=-1", "seed must be >= 0, got -1"),
])
def test_training_ranges_are_declared_and_refused(assignment: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        override(preset("tiny"), [assignment])
    assert str(e.value) == message


def test_rules_across_sections_are_checked_once_in_the_run_config() -> None:
    with pytest.raises(ConfigError, match=r"tokenizer.vocab_size=95 plus the 4 specials give 99 ids, but "
                                          r"model.vocab_size=100; set model.vocab_size=99"):
        override(preset("tiny"), ["model.vocab_size=100"])
    with pytest.raises(ConfigError, match=r"model.num_classes=3 but data.labels has 2 classes"):
        override(preset("tiny"), ["model.num_classes=3"])
    with pytest.raises(ConfigError, match=r"tokenizer.max_len=65 exceeds model.max_positions=64"):
        override(preset("tiny"), ["tokenizer.max_len=65"])
    with pytest.raises(ConfigError, match=r"pretrain.seq_len=65 exceeds model.max_positions=64"):
        override(preset("tiny"), ["pretrain.seq_len=65"])
    # Two linked keys changed together are checked together.
    cfg = override(preset("tiny"), ["model.num_classes=3", "data.labels=a,b,c", "data.label_names=x,y,z"])
    assert cfg.model.num_classes == 3
    assert OptimConfig(lr=1.0).lr == 1.0


def test_a_setting_that_something_else_fixes_is_refused_not_dropped(tmp_path) -> None:
    fixed = {"tokenizer.max_len": 48, "model.d_model": 32}
    choice = Choice("tiny", None, ("tokenizer.max_len=40",))
    with pytest.raises(ConfigError, match=r"^tokenizer.max_len=40 would be ignored: --pretrained A fixes it to 48"):
        choice.resolve(fixed, "--pretrained A")
    (tmp_path / "c.json").write_text(json.dumps({"model": {"d_model": 64, "n_heads": 2}}))
    with pytest.raises(ConfigError, match=r"^model.d_model=64 would be ignored"):
        Choice("tiny", str(tmp_path / "c.json")).resolve(fixed, "--pretrained A")
    same = Choice("tiny", None, ("tokenizer.max_len=48", "finetune.epochs=3")).resolve(fixed, "--pretrained A")
    assert same.tokenizer.max_len == 48 and same.finetune.epochs == 3  # setting the fixed value itself is fine


def test_config_file_rejects_unknown_keys_with_file_name(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**preset("tiny").to_dict(), "optimiser": {}}))
    with pytest.raises(ConfigError, match=r"config.json: unknown config key 'optimiser'; top-level keys: preset, "
                                          r"seed; sections: model"):
        load(bad)
    with pytest.raises(ConfigError, match="unknown config key 'pretrain.lr'"):
        (tmp_path / "o.json").write_text(json.dumps({"pretrain": {"lr": 1}}))
        resolve("tiny", [], str(tmp_path / "o.json"))


@pytest.mark.parametrize("name", ["demo", "english", "lab"])
def test_every_file_a_preset_names_is_in_the_data_folder(name: str, data_dir) -> None:
    data = override(preset(name), {"data.root": str(data_dir)}).data
    for rel in [*data.pretrain, data.train, data.test, *([data.valid] if data.valid else []), *data.extra_test]:
        assert data.path(rel).is_file(), f"preset {name}: {rel} not found under {data_dir}"
