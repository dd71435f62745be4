"""The command line's shared glue: the run options of the training subcommands, and how a subcommand ends (an error
in the input: one line, exit 2). How a subcommand picks its config (`--preset`, `--config`, `--set`):
trainer/config/choice.py.

Imports no torch and no DeepSpeed at module level: `params`, `tokenizer` and `export` use it too.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from trainer.config import schema as config_mod

# Errors in the user's input: config, data, checkpoint, artifact (ConfigError, DataError, CheckpointError,
# ArtifactError, ExportError... are ValueErrors whose message names the file, key or limit).
INPUT_ERRORS = (ValueError, FileNotFoundError)

T = TypeVar("T")


def add_run_arguments(parser: argparse.ArgumentParser, tokenizer_help: str) -> None:
    """The options of `pretrain` and `finetune` (loop.RunOptions)."""
    g = parser.add_argument_group("run")
    g.add_argument("--out", required=True, metavar="RUN_DIR",
                   help="run folder: config.json, env.json, metrics.csv, tb/, checkpoints/, artifact/ (one run at "
                        "a time: a second run into it stops before writing)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="TAG",
                   help="continue from RUN_DIR/checkpoints: the latest complete checkpoint, or TAG (e.g. "
                        "step00000500); 'auto': continue the run RUN_DIR holds, or start it when it holds none (one "
                        "command for the first start and every restart: preempted pods, requeued jobs)")
    g.add_argument("--deepspeed-config", metavar="FILE", default=None,
                   help="DeepSpeed JSON whose keys override the derived ones (default: engine.deepspeed_config)")
    g.add_argument("--stop-at", type=int, default=0, metavar="STEP",
                   help="stop after optimizer step STEP with a checkpoint, as if interrupted (time-boxed jobs)")
    old_spelling(g, "--deepspeed_config", "deepspeed_config")
    old_spelling(g, "--stop_at", "stop_at", type=int)
    g.add_argument("--tokenizer", metavar="DIR", help=tokenizer_help)
    g.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the DeepSpeed launcher


def old_spelling(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, dest: str,
                 **kw: Any) -> None:
    """Accept an option's earlier underscore spelling (scripts written for it keep working), hidden from --help."""
    parser.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)


def run_options(args: argparse.Namespace, cls: Callable[..., T], **more: Any) -> T:
    """`cls` (loop.RunOptions or a subclass) from the options `add_run_arguments` declared, plus `more`."""
    return cls(out=Path(args.out), resume=args.resume, deepspeed_config=args.deepspeed_config, stop_at=args.stop_at,
               tokenizer=Path(args.tokenizer) if args.tokenizer else None, **more)


def check_out(folder: Path, flag: str = "--out") -> None:
    """An output folder must be one this process can write (created if missing, with the umask's modes): a file in
    the way or a read-only mount is one line before any work, not a traceback after it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(folder) else ""
        raise config_mod.ConfigError(f"{flag} {folder}: cannot write there: {e.strerror or type(e).__name__}{where}") \
            from None


def add_field_arguments(parser: argparse.ArgumentParser, what: str = "") -> None:
    """--text-field / --label-field: the column (.csv/.tsv/.parquet) or key (.jsonl) of a labelled file, as the
    training config's data.text_field / data.label_field name them; `what` prefixes the help ("--data: ")."""
    for field in ("text", "label"):
        parser.add_argument(f"--{field}-field", metavar="NAME",
                            help=f"{what}the column or .jsonl key of the {field} (default: the one the model was "
                                 f"trained with: the artifact's data.{field}_field, the bundle's data_fields)")


def one_line_errors(main: Callable[[], int | None]) -> int:
    """`main()`'s exit code; an error in the input is one line on stderr and exit 2, not a traceback."""
    try:
        return int(main() or 0)
    except INPUT_ERRORS as e:
        if os.environ.get("TS_TRACEBACK"):  # where a one-line error came from (a library's ValueError, say)
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
