"""What the training subcommands (`pretrain`, `finetune`) share: options, entry/exit, tokenizer, seeds, batch slots."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from trainer import engine as eng
from trainer.config import ConfigError, RunConfig
from trainer.tokenizer import Tokenizer, build_tokenizer


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("run")
    g.add_argument("--out", required=True, metavar="RUN_DIR",
                   help="run folder: config.json, env.json, metrics.csv, tb/, checkpoints/, artifact/")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="TAG",
                   help="continue from RUN_DIR/checkpoints: the latest complete checkpoint, or TAG (e.g. step00000500)")
    g.add_argument("--deepspeed_config", metavar="FILE", default=None,
                   help="DeepSpeed JSON whose keys override the derived ones (default: engine.deepspeed_config)")
    g.add_argument("--stop_at", type=int, default=0, metavar="STEP",
                   help="stop after optimizer step STEP with a checkpoint, as if interrupted (time-boxed jobs)")
    g.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the DeepSpeed launcher


def entry(run: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> int:
    """Run a training stage on this rank and end the process the way every rank must (engine.finish).

    Errors in the input (config, data, checkpoint: ValueError / FileNotFoundError) print one line, rc 2."""
    code = 0
    try:
        run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: [rank {eng.rank()}] {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001  (print it, then leave through finish like every other path)
        traceback.print_exc()
        code = 1
    eng.finish(code)


def obtain_tokenizer(cfg: RunConfig, run_dir: Path, given: str | None) -> Tokenizer:
    """RUN_DIR/tokenizer: built once by rank 0 (from --tokenizer DIR, or from the config), then read by every rank."""
    folder = run_dir / "tokenizer"
    if eng.is_main():
        if not folder.exists():
            tok = Tokenizer.load(given) if given else build_tokenizer(cfg)
            tok.save(folder)
        elif given and Tokenizer.load(given).fingerprint != Tokenizer.load(folder).fingerprint:
            raise ConfigError(f"--tokenizer {given} differs from the run's {folder}; use a new --out")
    eng.barrier()
    tok = Tokenizer.load(folder)
    if tok.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"{folder}: the tokenizer has {tok.vocab_size} ids but model.vocab_size="
                          f"{cfg.model.vocab_size}; set model.vocab_size={tok.vocab_size}")
    return tok


def seed_micro_step(seed: int, step: int, micro: int, rank: int) -> None:
    """Dropout (and any torch RNG) of one micro-step depends only on (seed, step, micro, rank): resume is exact."""
    torch.manual_seed(int(np.random.SeedSequence([seed, step, micro, rank]).generate_state(1)[0]))


def slots(batch: list[int], plan: eng.BatchPlan) -> list[list[int]]:
    """Cut a global batch into grad_accum x world_size micro-batches; micro-step a of rank r is slot a * W + r.

    The cut depends only on the global batch, so 2 ranks x B see the same examples as 1 rank x 2B."""
    n = plan.grad_accum * plan.world_size
    return [part.tolist() for part in np.array_split(np.asarray(batch, dtype=np.int64), n)]


def usable(batches: list[list[int]], plan: eng.BatchPlan) -> list[list[int]]:
    """Drop a last global batch too small to give every micro-step at least one example."""
    return [b for b in batches if len(b) >= plan.grad_accum * plan.world_size]


def to_device(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """CPU batch tensors -> `device`. On CUDA they are pinned first: a copy from pageable memory is synchronous
    whatever `non_blocking` says, and would stall the host until the GPU had finished the previous step."""
    if device.type != "cuda":
        return tensors
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)
