"""Configs: presets build and validate, overrides are typed, unknown keys are errors that list the valid ones."""

from __future__ import annotations

import json

import pytest

from trainer.config import PRESETS, ConfigError, ModelConfig, load, override, preset, resolve


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
    with pytest.raises(ConfigError, match=r"unknown config key 'model.widht'.*model\.d_model"):
        override(preset("tiny"), ["model.widht=3"])


def test_bad_values_name_the_field_and_value():
    with pytest.raises(ConfigError, match="model.n_heads=3 must divide model.d_model=32"):
        override(preset("tiny"), ["model.n_heads=3"])
    with pytest.raises(ConfigError, match="engine.zero_stage must be 0, 1 or 2, got 3"):
        override(preset("tiny"), ["engine.zero_stage=3"])
    with pytest.raises(ConfigError, match="engine.keep_checkpoints must be >= 1, got 0"):
        override(preset("tiny"), ["engine.keep_checkpoints=0"])
    with pytest.raises(ConfigError, match="engine.checkpoint_every must be >= 0"):
        override(preset("tiny"), ["engine.checkpoint_every=-5"])
    with pytest.raises(ConfigError, match="model.d_model must be int, got 'wide'"):
        override(preset("tiny"), ["model.d_model=wide"])
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")
    with pytest.raises(ConfigError):
        ModelConfig(dropout=1.5)


def test_config_file_rejects_unknown_keys_with_file_name(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**preset("tiny").to_dict(), "optimiser": {}}))
    with pytest.raises(ConfigError, match=r"config.json.*unknown config key\(s\) \['optimiser'\]"):
        load(bad)
    with pytest.raises(ConfigError, match="unknown config key 'pretrain.lr'"):
        (tmp_path / "o.json").write_text(json.dumps({"pretrain": {"lr": 1}}))
        resolve("tiny", [], str(tmp_path / "o.json"))


@pytest.mark.parametrize("name", ["demo", "english", "lab"])
def test_every_file_a_preset_names_is_in_the_data_folder(name: str, data_dir) -> None:
    data = override(preset(name), {"data.root": str(data_dir)}).data
    for rel in [*data.pretrain, data.train, data.test, *data.extra_test]:
        assert data.path(rel).is_file(), f"preset {name}: {rel} not found under {data_dir}"
