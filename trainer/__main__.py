"""`python -m trainer SUBCOMMAND ...` (console script: `transfer-sentiment`).

Each subcommand lives in its own module with `add_arguments(parser)` and `main(args) -> int`; only the module of
the chosen subcommand is imported, so `params` or `export` never pay for importing DeepSpeed.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from contract.extras import missing_extra
from contract.version import version_line

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "params": ("trainer.model.params", "print the trainable-parameter table of a preset (the lab's question 3)"),
    "tokenizer": ("trainer.data.tokenizer_cli", "build the tokenizer of a config (load the lab's, or train one)"),
    "data": ("trainer.data.fetch", "fetch the public data sets the presets read (data fetch --list: their sources)"),
    "prepare": ("trainer.data.prepare", "tokenize data.pretrain once, in shards (pretrain --set data.prepared=DIR)"),
    "pretrain": ("trainer.tasks.pretrain", "pretrain the encoder as a language model (DeepSpeed)"),
    "finetune": ("trainer.tasks.finetune", "fine-tune a classifier, pretrained or from scratch, or --compare both"),
    "generate": ("trainer.tasks.generate", "greedy completion of a prompt with a pretrained LM artifact"),
    "export": ("trainer.export", "export a classifier artifact to a validated ONNX bundle, or --check one"),
    "predict": ("trainer.tasks.predict", "predict (and score) a file offline, with an artifact or a bundle"),
    "config": ("trainer.config.cli", "print every config key of a preset with its type, value and meaning"),
}


def _parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items())
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pretrain, fine-tune and export the transfer-sentiment encoder.",
        epilog=f"subcommands:\n{lines}\n\n`python -m trainer SUBCOMMAND --help` shows each one's options and examples.",
    )
    p.add_argument("subcommand", choices=sorted(SUBCOMMANDS), metavar="SUBCOMMAND")
    p.add_argument("--version", action="version", version=version_line("transfer-sentiment"))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        _parser().parse_args(argv[:1] or ["--help"])
    name, rest = argv[0], argv[1:]
    try:  # pydantic here, the subcommand's torch, DeepSpeed, onnx below: the `train` extra, absent from the others
        from trainer.cli import INPUT_ERRORS, one_line_errors
    except ModuleNotFoundError as e:
        return missing_extra("transfer-sentiment", "train", e)
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
    except INPUT_ERRORS as e:  # a setting read while importing (DS_ACCELERATOR, by DeepSpeed)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        return missing_extra("transfer-sentiment", "train", e)
    sub = argparse.ArgumentParser(
        prog=f"python -m trainer {name}",
        description=(module.__doc__ or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=getattr(module, "EXAMPLES", None),
    )
    module.add_arguments(sub)
    args = sub.parse_args(rest)
    return one_line_errors(lambda: module.main(args))


if __name__ == "__main__":
    sys.exit(main())
