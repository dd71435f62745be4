"""How the command line chooses a run's config: a preset (or a run's own config.json), then a JSON file of
overrides, then `--set` assignments; a user's own data files replace the preset's whole data section. The options
that say so (`add_config_args`) are declared here too, for every subcommand that takes a config.

It sits above both trainer/config/schema.py (the types) and trainer/config/presets.py (the named configs), so neither
imports the other's caller.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from trainer.config.presets import PRESETS, preset
from trainer.config.schema import (
    ConfigError,
    DataConfig,
    RunConfig,
    flatten,
    load,
    override,
    read_json,
    split_assignment,
)


def resolve(preset_name: str, overrides: list[str] | None = None, config_file: str | None = None) -> RunConfig:
    """Preset, then a JSON file's keys, then `--set` overrides: the order the CLI applies them."""
    return Choice(preset_name, config_file, tuple(overrides or ())).resolve()


# Keys that name data files: setting any of them makes the run's data the user's own (Choice.resolve).
OWN_DATA = ("data.pretrain", "data.train", "data.valid", "data.test", "data.extra_test")


@dataclasses.dataclass(frozen=True)
class Choice:
    """How the command line chose a config: a preset (or a run's own config.json), then a JSON file of overrides,
    then `--set` assignments."""

    preset: str
    file: str | None = None  # --config FILE
    assignments: tuple[str, ...] = ()  # --set KEY=VALUE, in order
    run: str | None = None  # a run's config.json to start from instead of the preset (--resume alone)

    def settings(self) -> dict[str, Any]:
        """Every key the user set (file, then --set), with its raw value."""
        out = flatten(read_json(self.file)) if self.file else {}
        out.update(split_assignment(a) for a in self.assignments)
        return out

    def resolve(self, fixed: dict[str, Any] | None = None, fixed_by: str = "") -> RunConfig:
        """The config. `fixed`: keys that something else decides (e.g. `--pretrained ARTIFACT` fixes the tokenizer
        and the encoder's shape): a user setting that would change one is an error, not silently dropped.

        A user who names a data file gets a data section of their own: none of the preset's files, caps or labels
        (a preset's test file scored against their training file would be a silent wrong result). Label names
        come from the user's labels unless given with them. data.root ends up absolute.

        Every setting is applied at once (one `override`, one validation): keys that go together, such as
        model.num_classes and data.labels, are checked together whichever source set them."""
        settings = self.settings()
        own = self.run is None and any(k in settings for k in OWN_DATA)
        cfg = load(self.run) if self.run else preset(self.preset)
        if own:  # the preset's files go, the lab tokenizer's too (unused by a trained one, refused below)
            tc = cfg.tokenizer
            cfg = dataclasses.replace(cfg, data=DataConfig(), tokenizer=tc if tc.kind == "lab" else
                                      dataclasses.replace(tc, model="", vocab=""))
        changes: dict[str, Any] = {**(fixed or {}), **settings}
        if "data.labels" in settings and "data.label_names" not in settings:
            changes["data.label_names"] = []
        changes["data.root"] = os.path.abspath(os.path.expanduser(str(changes.get("data.root", cfg.data.root))))
        cfg = override(cfg, changes)
        if own and cfg.tokenizer.kind == "lab" and "tokenizer.kind" not in (fixed or {}) \
                and "tokenizer.model" not in settings:
            raise ConfigError(f"preset {cfg.preset!r} loads the lab's French tokenizer (tokenizer.kind=lab) from its "
                              "data sets; with your own data set tokenizer.kind=train, or name the files "
                              "(tokenizer.model, tokenizer.vocab)")
        flat = flatten(cfg.to_dict())
        for key in settings:
            if fixed and key in fixed and flat[key] != fixed[key]:
                raise ConfigError(f"{key}={flat[key]!r} would be ignored: {fixed_by} fixes it to {fixed[key]!r}; "
                                  "remove the setting")
        return cfg


def add_config_args(parser: argparse.ArgumentParser, default_preset: str = "demo", resumable: bool = False) -> None:
    g = parser.add_argument_group("configuration (applied in this order; every key: python -m trainer config)")
    more = "; with --resume and no --preset/--config: the run's own config.json" if resumable else ""
    g.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help=f"named preset (default: {default_preset}{more})")
    g.add_argument("--config", metavar="FILE", help="JSON file of overrides, nested like config.json")
    g.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one field, e.g. --set pretrain.optim.lr=1e-3 (repeatable; lists: a,b,c); naming a "
                        "data file (data.train, data.test, ...) replaces the preset's whole data section")
    parser.set_defaults(default_preset=default_preset)


# `--resume auto`: continue the run the folder holds, or start it (trainer/engine/loop.py, resume_tags).
RESUME_AUTO = "auto"


def config_choice(args: argparse.Namespace) -> Choice:
    """The preset, --config and --set of the command line; `--resume` with neither a preset nor a config file
    continues from the run's own config.json (plus any --set, which must then change nothing). `--resume auto` in a
    folder that holds no run yet starts one from the preset."""
    run = None
    if getattr(args, "resume", None) and args.preset is None and args.config is None:
        run = Path(args.out) / "config.json"
        if not run.is_file():
            if args.resume != RESUME_AUTO:
                raise ConfigError(f"nothing to resume: {run} not found")
            run = None
    return Choice(args.preset or args.default_preset, args.config, tuple(args.overrides),
                  str(run) if run else None)
