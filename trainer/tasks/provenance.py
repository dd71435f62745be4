"""What a fine-tuned classifier records about how it was made, for its artifact.json and the model card
(trainer/export/card.py): the command that runs it again and the data files with their checksums."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from trainer.artifact import sha256_file
from trainer.config.schema import RunConfig
from trainer.data.labelled import Labelled


def command_line(args: argparse.Namespace, out: Path, pretrained: Path | None, compare: bool, seeds: int) -> str:
    """The command that runs this fine-tuning into `out` again (the model card quotes it); a resumed run's: the one
    that started it (its env.json)."""
    if args.resume:
        try:
            return str(json.loads((out / "env.json").read_text(encoding="utf-8"))["command"])
        except (OSError, ValueError, KeyError):
            pass
    parts = ["python", "-m", "trainer", "finetune", "--preset", args.preset or args.default_preset]
    parts += [*(["--config", args.config] if args.config else []), *(x for a in args.overrides for x in ("--set", a))]
    parts += [*(["--pretrained", str(pretrained)] if pretrained else []),
              *(["--compare"] if compare else []), *(["--seeds", str(seeds)] if seeds > 1 else [])]
    return shlex.join([*parts, "--out", str(out)])


def data_files(cfg: RunConfig, data: Labelled) -> dict[str, dict[str, Any]]:
    """Each split's file, its sha256, its examples and where they came from (a share split off, a cap): what the model
    card lists."""
    d, digests = cfg.data, {}
    named = {"train": d.train, "valid": d.valid or d.train, "test": d.test or d.train}
    parts = {"train": data.train, "valid": data.valid, "test": data.test, **data.extra}
    out = {}
    for role, part in parts.items():
        name = named.get(role, role)
        if name not in digests:
            digests[name] = sha256_file(d.path(name))
        out[role] = {"file": name, "sha256": digests[name], "examples": len(part.examples), "source": part.source,
                     **({"cap": part.cap} if part.cap else {})}
    return out
