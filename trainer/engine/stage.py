"""How a training stage runs on one rank and ends: the exit code every rank agrees on (engine.finish), and what
SIGINT and SIGTERM do outside the training loop (inside it, trainer/engine/loop.py checkpoints first)."""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from trainer.cli import INPUT_ERRORS
from trainer.engine import deepspeed_engine as eng


def on_every_rank(stage: Callable[[], object]) -> NoReturn:
    """Run a training stage on this rank and end the process the way every rank must (engine.finish): exit 0, 2 for
    an error in the input (one line, naming the rank when there are several), 130 on SIGINT and 143 on SIGTERM
    (inside the training loop after a checkpoint, trainer/engine/loop.py), 1 with a traceback for anything else."""
    def term(signum: int, frame: object) -> None:  # outside the loop SIGTERM stops like Ctrl-C, with a message
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, term)
    code = 0
    try:
        stage()
    except INPUT_ERRORS as e:
        if os.environ.get("TS_TRACEBACK"):
            traceback.print_exc()
        where = f"[rank {eng.rank()}] " if eng.world_size() > 1 else ""  # which rank, when there are several
        # One write, newline included: under the launcher (python -u) print's two writes let ranks' lines interleave.
        sys.stderr.write(f"error: {where}{e}\n")
        code = 2
    except KeyboardInterrupt as e:
        code = getattr(e, "code", 143 if str(e) == "SIGTERM" else 130)
        if not hasattr(e, "code") and eng.is_main():  # the loop names its checkpoint; elsewhere say what was kept
            print(f"interrupted ({e or 'SIGINT'}) outside the training loop: checkpoints written so far are "
                  "kept (--resume continues from the latest); no new one was written", file=sys.stderr)
    except BaseException:  # print it, then leave through finish like every other path
        traceback.print_exc()
        code = 1
    eng.finish(code)
