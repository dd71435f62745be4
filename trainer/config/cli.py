"""`python -m trainer config`: every config key with its type, its value in the chosen preset (after --config and
--set) and its meaning; or that config as config.json (`--json`).

The meanings are the comments beside each field in trainer/config/schema.py (the one place they are written), read from
the source (contract/comments.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import types
import typing
from typing import Annotated, Any, Literal

from contract.comments import comments
from trainer.config.choice import add_config_args, config_choice
from trainer.config.schema import RunConfig, flatten

EXAMPLES = """examples:
  python -m trainer config --preset tiny                      # every key: type, value, meaning
  python -m trainer config --preset tiny | grep data.          # the data options
  python -m trainer config --preset demo --set data.train=reviews.jsonl --json   # the config a run would use
"""

BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "length >="),
          ("max_length", "length <="))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, default_preset="demo")
    parser.add_argument("--json", action="store_true", help="print the resolved config as config.json instead")


def main(args: argparse.Namespace) -> int:
    cfg = config_choice(args).resolve()
    if args.json:
        print(cfg.to_json(), end="")
        return 0
    rows = describe(cfg)
    width = max(len(k) for k, *_ in rows)
    value_width = min(32, max(len(v) for _, _, v, _ in rows))
    print(f"# preset {cfg.preset}; --set KEY=VALUE changes one (lists: a,b,c; no value: none)")
    try:
        for key, tp, value, meaning in rows:
            print(f"{key:<{width}} = {value:<{value_width}}  ({tp}) {meaning}")
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def describe(cfg: RunConfig) -> list[tuple[str, str, str, str]]:
    """(key, type, value, meaning) for every key of `cfg`, in config.json's order."""
    values = flatten(cfg.to_dict())
    out = []
    for key, (tp, meaning) in fields(RunConfig).items():
        out.append((key, type_name(tp), _shown(values[key]), meaning))
    return out


def fields(cls: type, prefix: str = "") -> dict[str, tuple[Any, str]]:
    """key -> (annotation, meaning) for every field of a config class, nested sections dotted."""
    hints = typing.get_type_hints(cls, include_extras=True)
    notes = comments(cls)
    out: dict[str, tuple[Any, str]] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(fields(tp, f"{prefix}{f.name}."))  # type: ignore[arg-type]
        else:
            out[prefix + f.name] = (tp, notes.get(f.name, ""))
    return out


def type_name(tp: Any) -> str:
    """An annotation for people: "int >= 1", "clm|mlm", "float in [0, 1)", "list", "float or none"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        bounds = ", ".join(f"{sym} {getattr(item, attr)}" for meta in args[1:]
                           for item in getattr(meta, "metadata", [meta]) for attr, sym in BOUNDS
                           if getattr(item, attr, None) is not None)
        bounds = re.sub(r"length >= (\d+), length <= \1", r"\1 values", bounds)
        return " ".join([type_name(args[0]), bounds]).strip()
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("none" if a is type(None) else type_name(a) for a in args)
    if origin is list:
        inner = args[0]
        return f"list of {type_name(typing.get_args(inner)[0] if typing.get_origin(inner) is Annotated else inner)}"
    return getattr(tp, "__name__", str(tp))


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "[]"
    if value is None:
        return "none"
    return '""' if value == "" else str(value)
