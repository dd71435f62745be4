"""What a run records about how it was made, for its artifact.json and the model card (trainer/export/card.py): a
fine-tuned classifier's command and data files with their checksums, a pretrained model's corpus with its
checksums, and for both the hardware and the wall time."""

from __future__ import annotations

import argparse
import json
import platform
import shlex
from pathlib import Path
from typing import Any

import torch

from trainer.artifact import sha256_file
from trainer.config.schema import RunConfig
from trainer.data.corpus import MANIFEST, read_manifest
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
                     **({"cap": part.cap} if part.cap else {}), **({"crops": part.crops} if part.crops else {})}
    return out


def compute(device: torch.device, world_size: int, local_size: int, seconds: float, steps: int) -> dict[str, Any]:
    """What trained and for how long (the model card's hardware and wall time): the device kind and its name (a
    GPU's, else the CPU's model), ranks and nodes, threads per rank, and the wall seconds of the `steps` optimizer
    steps this process ran (a resumed run's earlier sessions are not counted: `steps` says how many it timed)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return {"device": device.type, "device_name": name, "world_size": world_size,
            "nodes": max(1, world_size // max(1, local_size)), "threads_per_rank": torch.get_num_threads(),
            "wall_seconds": round(seconds, 1), "steps_timed": steps}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def corpus(folder: Path) -> dict[str, Any]:
    """The pretraining corpus as its prepared folder's manifest.json says (trainer/data/corpus.py): each input file
    with its bytes and its sha256 (None where this machine lacks it, or holds a file of another size), the documents
    and tokens, and the sha256 of manifest.json itself, which lists every shard's sha256: the token ids trained on."""
    m = read_manifest(folder)
    files = []
    for f in m.get("inputs", []):
        p = Path(f["path"])
        same = p.is_file() and p.stat().st_size == f["bytes"]
        files.append({"file": str(p), "bytes": f["bytes"], "sha256": sha256_file(p) if same else None})
    return {"prepared": str(folder), "manifest_sha256": sha256_file(folder / MANIFEST), "documents": m.get("documents"),
            "tokens": m.get("tokens"), "files": files}
