"""Build the tokenizer a config asks for (load the lab's, or train one on `data.pretrain`) and save its folder.

The folder (spm.model, vocab.txt, meta.json) can be passed to `pretrain --tokenizer DIR` to skip training.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from trainer.cli import check_out
from trainer.config.choice import add_config_args, config_choice
from trainer.data.tokenizer import build_tokenizer

EXAMPLES = """examples:
  python -m trainer tokenizer --preset demo --out runs/demo/tokenizer
  python -m trainer tokenizer --preset lab --out runs/lab/tokenizer       # the lab's 50,001 ids
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, default_preset="demo")
    parser.add_argument("--out", required=True, metavar="DIR", help="tokenizer folder to write")


def main(args: argparse.Namespace) -> int:
    cfg = config_choice(args).resolve()
    check_out(Path(args.out).parent, "the folder of --out")
    t0 = time.perf_counter()
    tok = build_tokenizer(cfg)
    tok.save(args.out)
    print(f"{tok!r} -> {args.out} ({time.perf_counter() - t0:.1f} s)")
    return 0
