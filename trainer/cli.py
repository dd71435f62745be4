"""Pieces every subcommand shares: how a config is chosen on the command line, and how errors are shown."""

from __future__ import annotations

import argparse

from trainer import config as config_mod
from trainer.config import RunConfig


def add_config_args(parser: argparse.ArgumentParser, default_preset: str = "demo") -> None:
    g = parser.add_argument_group("configuration (applied in this order)")
    g.add_argument("--preset", default=default_preset, choices=sorted(config_mod.PRESETS),
                   help=f"named preset (default: {default_preset})")
    g.add_argument("--config", metavar="FILE", help="JSON file of overrides, nested like config.json")
    g.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one field, e.g. --set pretrain.optim.lr=1e-3 (repeatable; lists: a,b,c)")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    return config_mod.resolve(args.preset, args.overrides, args.config)
