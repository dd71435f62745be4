"""Seeded tiny and (shortened) demo runs, and the sha256 of what they write: proof that a change moved code only.

Pretrains, fine-tunes (`--compare`) and exports each preset with one process, then prints the sha256 of every
weights file (safetensors) and every bundle graph. A graph's digest is taken with each node's metadata cleared: the
exporter records the Python class path of every module there (`trainer.model.encoder.Classifier`), so moving a
class changes the bytes and nothing else. Run it before and after a change and compare the two outputs:

  .venv/bin/python bench/fingerprint.py --out /tmp/fp-before > before.txt    # on the old commit
  .venv/bin/python bench/fingerprint.py --out /tmp/fp-after > after.txt      # on the new one
  diff before.txt after.txt

About 2 minutes on 2 CPU cores. The demo run is cut to 40 steps and a few hundred reviews (--set overrides below).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

import onnx

# The demo preset, shortened so that a fingerprint takes minutes, not a quarter of an hour.
SHORT_DEMO = ["pretrain.max_steps=40", "finetune.epochs=1", "data.max_train_examples=300",
              "data.max_valid_examples=100", "data.max_test_examples=100", "tokenizer.train_lines=20000"]


def graph_digest(path: Path) -> str:
    """sha256 of an ONNX file with each node's metadata_props cleared (the module class paths the exporter keeps)."""
    model = onnx.load(str(path))
    for node in model.graph.node:
        del node.metadata_props[:]
    return hashlib.sha256(model.SerializeToString()).hexdigest()


def run(preset: str, out: Path, sets: list[str]) -> None:
    """pretrain -> finetune --compare -> export for one preset, each a `python -m trainer` process."""
    over = [a for s in sets for a in ("--set", s)]
    steps = [["pretrain", "--preset", preset, "--out", str(out / "pretrain"), *over],
             ["finetune", "--preset", preset, "--pretrained", str(out / "pretrain" / "artifact"), "--compare",
              "--out", str(out / "finetune"), *over],
             ["export", str(out / "finetune" / "artifact"), "--out", str(out / "bundle")]]
    for step in steps:
        with open(out.parent / f"{preset}.{step[0]}.log", "w") as log:
            p = subprocess.run([sys.executable, "-m", "trainer", *step], stdout=log, stderr=subprocess.STDOUT)
        if p.returncode != 0:
            sys.exit(f"{preset}: `python -m trainer {step[0]}` failed (exit {p.returncode}); see {log.name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="a new folder for the runs (it must not exist yet)")
    p.add_argument("--presets", nargs="+", default=["tiny", "demo"], choices=["tiny", "demo"],
                   help="the presets to run (default: tiny demo; demo is shortened to 40 steps)")
    args = p.parse_args()
    if args.out.exists():
        p.error(f"--out {args.out} exists; name a new folder")
    for preset in args.presets:
        (args.out / preset).mkdir(parents=True)
        run(preset, args.out / preset, SHORT_DEMO if preset == "demo" else [])
    for f in sorted(args.out.rglob("*")):
        rel = f.relative_to(args.out)
        if f.suffix == ".safetensors":
            print(hashlib.sha256(f.read_bytes()).hexdigest(), rel)
        elif f.suffix == ".onnx":
            print(graph_digest(f), rel, "(node metadata cleared)")


if __name__ == "__main__":
    main()
