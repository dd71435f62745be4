"""The Python half of launch/pretrain.sh and launch/finetune.sh: DeepSpeed's launcher runs them with Python
(`python -u launch/pretrain.sh --local_rank=N ...`, once per rank), so sys.path[0] is launch/ and they import this.
The same defaults as the bash half (launch/_stage.sh): the DeepSpeed JIT cache, the repo on the path."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package lives one folder up
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))
sys.path.insert(0, ROOT)


def run(stage: str) -> None:
    """One rank of `python -m trainer STAGE`, with the script's arguments; exits with its code."""
    from trainer.__main__ import main

    sys.exit(main([stage, *sys.argv[1:]]))
