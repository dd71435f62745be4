"""Pretrain the encoder as a language model with DeepSpeed: next-token (the lab) or masked LM (BERT-style).

Data: a prepared folder (trainer/data/corpus.py): `data.prepared=DIR` from `python -m trainer prepare`, or, without it,
RUN/prepared made from `data.pretrain` by this run before its process group starts (the first rank to take the run
folder's lock prepares; the others wait on the lock, not in a collective that would time out on a large corpus).
At start every node checks its copy against the manifest (`data.verify`: each local rank a share of the files); a
missing or different copy on any node stops every rank with one line naming the node and the file.

The documents, [<sos>] + pieces + [<eos>] back to back, are read as packed windows of `pretrain.seq_len` tokens
(trainer/data/windows.py: full windows, no padding; a window may span two documents). The last
`data.pretrain_eval_lines` documents (at most a tenth) are held out whole for the eval loss. The loss is the mean
over predicted tokens of the whole global batch, so 2 ranks x B equal 1 rank x 2B.
  clm: input window[:-1] predicts window[1:] under the causal mask (windows overlap by one token, so every token
       but the stream's first is predicted once): seq_len predictions a window.
  mlm: round(mask_prob x seq_len) positions of a window are predicted (at least one), chosen among its pieces
       (never <sos>/<eos>, unless a window holds fewer pieces than that), no causal mask; of those 80% become
       <oov> (id 3, the mask token), 10% a random piece, 10% stay. A fixed count a window keeps the loss's
       denominator known without reading other ranks' windows.
Writes RUN_DIR/artifact (task "lm", objective in artifact.json) for `finetune --pretrained`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainer import artifact, cli
from trainer.config.choice import RESUME_AUTO, add_config_args, config_choice
from trainer.config.schema import ConfigError, ModelConfig, RunConfig
from trainer.data import corpus
from trainer.data.prepare import prepare_config
from trainer.data.tokenizer import Tokenizer
from trainer.data.windows import EpochOrder, Windows, split
from trainer.engine import checkpoint as ckpt
from trainer.engine import deepspeed_engine as eng
from trainer.engine import loop, monitor, trackers
from trainer.engine.distributed import all_gather_bytes, file_lock
from trainer.engine.stage import on_every_rank
from trainer.model.encoder import LanguageModel
from trainer.tasks import provenance
from trainer.tasks.tokenizer_folder import run_tokenizer

EXAMPLES = """examples:
  python -m trainer pretrain --preset demo --out runs/demo/pretrain
  python -m trainer prepare --preset demo --out runs/demo/prepared     # once; then any number of runs:
  python -m trainer pretrain --preset demo --set data.prepared=runs/demo/prepared --out runs/demo/pretrain
  python -m trainer pretrain --preset demo --set pretrain.objective=mlm --out runs/demo/pretrain-mlm
  deepspeed --num_gpus 2 --bind_cores_to_rank launch/pretrain.sh --preset tiny --out runs/tiny
  python -m trainer pretrain --preset demo --out runs/demo/pretrain --resume      # after an interruption
"""

MASK = Tokenizer.OOV  # the mask token is <oov> (id 3): the served vocabulary has no <mask> row, so none is added
EVAL_EPOCH = 1 << 30  # seeds the eval windows' MLM masks: fixed, so every eval scores the same task


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, default_preset="demo", resumable=True)
    cli.add_run_arguments(parser, tokenizer_help="use this tokenizer folder instead of building one (with "
                                                 "data.prepared: the folder's own, DIR/tokenizer, by default)")


def main(args: argparse.Namespace) -> int:
    on_every_rank(lambda: run(config_choice(args).resolve(), cli.run_options(args, loop.RunOptions)))


class LMObjective(LanguageModel):
    """The language model with its loss inside forward, so DeepSpeed's engine runs both.

    Same parameter names as LanguageModel (a subclass): checkpoints and artifacts load into either."""

    def __init__(self, cfg: ModelConfig, causal: bool) -> None:
        super().__init__(cfg)
        self.causal = causal

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor,  # type: ignore[override]
                positions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(B, T) ids, (B, T) pad mask, (N,) flat indices into B*T of predicted positions, (N,) target ids
        -> summed cross-entropy (scalar). Windows are full, so the pad mask is all False and attention gets none
        (SDPA's fastest kernels). The head runs on the N predicted positions only (it is most FLOPs)."""
        h = self.encoder(input_ids, None, self.causal)  # (B, T, d)
        picked = h.reshape(-1, h.shape[-1]).index_select(0, positions)  # (N, d)
        return F.cross_entropy(self.head(picked).float(), targets, reduction="sum")


# ---------------------------------------------------------------------------------------------- batches


class WindowBatcher:
    """Window ids -> model inputs and targets; the count of predicted tokens is known without reading a window."""

    def __init__(self, windows: Windows, objective: str, mask_prob: float, vocab: int, seed: int) -> None:
        self.windows, self.objective, self.vocab, self.seed = windows, objective, vocab, seed
        self.per_window = windows.seq_len if objective == "clm" else max(1, round(mask_prob * windows.seq_len))

    def n_predicted(self, batch: list[int]) -> int:
        return len(batch) * self.per_window

    def make(self, batch: list[int], epoch: int) -> tuple[torch.Tensor, ...]:
        """(input_ids (B, L), padding_mask (B, L) all False, positions (N,), targets (N,)); N = B x per_window."""
        tokens = self.windows.tokens(batch)  # (B, L + overlap)
        B, L = len(batch), self.windows.seq_len
        if self.objective == "clm":
            ids, pos, tgt = tokens[:, :-1], np.arange(B * L), tokens[:, 1:].reshape(-1)
        else:
            ids, pos, tgt = self.mask(tokens, batch, epoch)
        return (torch.from_numpy(np.ascontiguousarray(ids)), torch.zeros((B, L), dtype=torch.bool),
                torch.from_numpy(pos.astype(np.int64)), torch.from_numpy(np.ascontiguousarray(tgt)))

    def mask(self, x: np.ndarray, batch: list[int], epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """BERT masking of (B, L) windows, each seeded by (seed, epoch, window): the same on any number of ranks.
        -> (masked ids (B, L), flat positions (B x k,), original ids there (B x k,))."""
        x = x.copy()
        B, L = x.shape
        k = self.per_window
        pos, target = np.empty((B, k), dtype=np.int64), np.empty((B, k), dtype=np.int64)
        for row, w in enumerate(batch):  # a loop over windows, never over pieces
            rng = np.random.default_rng([self.seed, epoch, int(w)])
            special = (x[row] == Tokenizer.SOS) | (x[row] == Tokenizer.EOS)
            pieces, marks = np.flatnonzero(~special), np.flatnonzero(special)
            if len(pieces) >= k:
                chosen = np.sort(rng.choice(pieces, size=k, replace=False))
            else:  # a window of one-piece documents: <sos>/<eos> make up the count
                chosen = np.sort(np.concatenate([pieces, rng.choice(marks, size=k - len(pieces), replace=False)]))
            r, random_ids = rng.random(k), rng.integers(Tokenizer.OOV + 1, self.vocab, size=k)
            pos[row], target[row] = chosen, x[row, chosen]
            x[row, chosen[r < 0.8]] = MASK
            keep = (r >= 0.8) & (r < 0.9)
            x[row, chosen[keep]] = random_ids[keep]
        return x, (pos + np.arange(B)[:, None] * L).reshape(-1), target.reshape(-1)


# ---------------------------------------------------------------------------------------------- data


class StartError(ValueError):
    """A rank could not ready its data; every rank raises it with the same line (the first rank's problem)."""


def ready_data(cfg: RunConfig, opts: loop.RunOptions, run_dir: Path) -> tuple[Tokenizer | None, Path]:
    """Before the process group (no collective waits on it): with data.prepared, nothing (each node's copy is
    checked collectively at start); else the run's tokenizer, then RUN/prepared, each made by the first process to
    take its lock in the run folder (the others wait on the lock, then find it made)."""
    if cfg.data.prepared:
        return None, Path(cfg.data.prepared).expanduser().absolute()  # its messages name the file on this node
    tok = run_tokenizer(cfg, run_dir, opts.tokenizer)
    folder = run_dir / "prepared"
    with file_lock(run_dir / ".prepare.lock"):
        prepare_config(cfg, tok, folder)
    return tok, folder


def check_data(folder: Path, tok: Tokenizer | None, cfg: RunConfig, opts: loop.RunOptions, run_dir: Path,
               info: eng.DistInfo) -> tuple[corpus.PreparedCorpus, Tokenizer]:
    """Collective, on every rank: this node's copy of `folder` against its manifest (each local rank checks a share
    of the files: data.verify), the verdict agreed by all ranks, then every node's manifest against rank 0's. Any
    problem stops every rank with the same line naming the node and the file. Returns the corpus and the run's
    tokenizer (with data.prepared: the folder's own, or --tokenizer if it is the same)."""
    problem, mine = "", ""
    try:
        m = corpus.read_manifest(folder)
        if not m.get("complete"):
            raise corpus.PreparedError(f"{folder}: its prepare did not finish "
                                       "(run the same prepare again to resume)")
        share = corpus.files_of(m)[info.local_rank::info.local_size]  # largest files first: shares of similar size
        problems = corpus.verify(folder, share, full=cfg.data.verify == "sha256")
        if problems:
            raise corpus.PreparedError(problems[0])
        mine = corpus.digest(m)
    except (corpus.PreparedError, OSError) as e:
        problem = f"{info.node}: {e}"
    problem = eng.agree(problem)
    if problem:
        raise corpus.PreparedError(problem)
    rows = [r.decode().split(" ", 1) for r in all_gather_bytes(f"{mine} {info.node}".encode())]
    for theirs, node in rows:
        if theirs != rows[0][0]:
            raise corpus.PreparedError(f"{node}: {folder / corpus.MANIFEST} differs from {rows[0][1]}'s (prepared "
                                       "from other inputs, tokenizer or shard size): give every node a copy of the "
                                       "same folder")
    if tok is None:
        tok = run_tokenizer(cfg, run_dir, opts.tokenizer or folder / corpus.TOKENIZER_DIR)
    return corpus.PreparedCorpus(folder, tok.fingerprint), tok


# ---------------------------------------------------------------------------------------------- run


@dataclass
class PretrainTask:
    """The loop's view of pretraining (trainer/engine/loop.py's Task): windows in, next-token or masked-token loss
    out."""

    cfg: RunConfig
    windows: Windows  # the training windows
    train: WindowBatcher
    held_out: WindowBatcher
    plan: eng.BatchPlan
    info: eng.DistInfo

    def batches(self, epoch: int) -> EpochOrder:
        return EpochOrder(self.windows, epoch, self.plan.global_batch, self.cfg.seed)

    def inputs(self, part: list[int], epoch: int) -> tuple[torch.Tensor, ...]:
        return self.train.make(part, epoch)

    def denominator(self, batch: list[int]) -> int:
        return self.train.n_predicted(batch)

    def tokens(self, batch: list[int]) -> int:
        return len(batch) * self.windows.seq_len  # full windows: no padding

    def report(self, engine: Any, state: ckpt.LoopState, interval: loop.Interval, evaluate: bool) -> dict[str, Any]:
        row: dict[str, Any] = {"epoch": state.epoch, "loss": interval.loss, "ppl": _ppl(interval.loss),
                               "lr": eng.current_lr(engine), "tokens_per_s": interval.tokens_per_s,
                               "elapsed_s": interval.elapsed_s}
        if evaluate:
            with eng.whole_weights(engine):  # each rank scores its share of the windows
                row["eval_loss"] = eval_loss(engine, self.held_out, self.plan, self.info)
            row["eval_ppl"] = _ppl(row["eval_loss"])
            state.history.append({"step": state.step, "loss": interval.loss, "eval_loss": row["eval_loss"]})
        return row

    def improved(self, state: ckpt.LoopState) -> bool:
        return False  # the artifact holds the last step's weights

    def store_best(self, engine: Any, ckpt_dir: Path, tag: str, state: ckpt.LoopState) -> None:
        raise AssertionError("pretraining keeps the last weights")

    def stop_early(self, state: ckpt.LoopState) -> str | None:
        return None


def run(cfg: RunConfig, opts: loop.RunOptions) -> Path | None:
    """Pretrain into `opts.out`; returns the artifact folder (None on ranks > 0, or when stopped by stop_at)."""
    pc = cfg.pretrain
    run_dir, ckpt_dir = opts.out, opts.out / "checkpoints"
    local = eng.local_env()
    (resume_tag,) = loop.resume_tags(run_dir, cfg, [ckpt_dir], opts.resume)
    ds, plan = eng.ds_config(cfg, "pretrain", local.world_size, opts.deepspeed_config or cfg.engine.deepspeed_config)
    cli.check_out(run_dir)  # every rank writes its checkpoint shards there
    if not cfg.data.prepared and not cfg.data.pretrain:
        raise ConfigError("data.pretrain is empty: name your unlabelled text files (--set data.pretrain=FILE,FILE), "
                          "or a prepared folder (--set data.prepared=DIR)")
    monitor.note(f"data: prepared: {cfg.data.prepared}" if cfg.data.prepared else
                 f"data: pretrain: {', '.join(str(cfg.data.path(p)) for p in cfg.data.pretrain)}")
    tok, folder = None, Path()
    problem = eng.hold_run(run_dir) if local.rank == 0 else ""  # one run at a time in a folder
    try:
        if not problem:
            tok, folder = ready_data(cfg, opts, run_dir)
    except cli.INPUT_ERRORS as e:  # told to every rank below, so none waits for a peer that has left
        problem = f"{local.node}: {e}"
    info = eng.init_distributed()
    problem = eng.agree(problem)
    if problem:
        raise StartError(problem)
    prepared, tok = check_data(folder, tok, cfg, opts, run_dir, info)

    overlap = 1 if pc.objective == "clm" else 0  # clm windows overlap by one token (module docstring)
    # Held-out: the last documents, at most a tenth of them
    n_eval = min(cfg.data.pretrain_eval_lines, max(1, prepared.n_docs // 10))
    train_w, eval_w = split(prepared, n_eval, pc.seq_len, overlap)
    if len(eval_w) == 0:
        raise ConfigError(f"the {cfg.data.pretrain_eval_lines} held-out documents (data.pretrain_eval_lines) hold "
                          f"{eval_w.hi - eval_w.lo} tokens, less than one window of {pc.seq_len + overlap}; hold "
                          "out more")
    task = PretrainTask(cfg, train_w, WindowBatcher(train_w, pc.objective, pc.mask_prob, tok.vocab_size, cfg.seed),
                        WindowBatcher(eval_w, pc.objective, pc.mask_prob, tok.vocab_size, cfg.seed), plan, info)
    per_epoch, total = loop.steps_of(task, pc.epochs, pc.max_steps, f"{len(train_w)} training windows",
                                     plan.global_batch)
    ds = trackers.with_monitor(ds, cfg.monitor, run_dir)
    facts = trackers.run_facts([folder / corpus.MANIFEST]) if eng.is_main() else {}
    corpus_record = provenance.corpus(folder) if eng.is_main() else {}  # the model card's pretraining data
    monitor.write_run_info(run_dir, cfg, ds, {"stage": "pretrain", "prepared": str(folder),
                                              "documents": prepared.n_docs, "tokens": prepared.n_tokens,
                                              "train_windows": len(train_w), "eval_windows": len(eval_w),
                                              "steps": total, "global_batch": plan.global_batch, **facts})

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank and for every world size
    trackers.prepare(ds, run_dir)
    engine = eng.initialize(LMObjective(cfg.model, causal=pc.objective == "clm"), ds, pc.optim, total, cfg.engine)
    trackers.log_run(engine, {"config": cfg.to_dict(), **facts})
    state = ckpt.LoopState()
    if resume_tag:
        state, _ = ckpt.load(engine, ckpt_dir, resume_tag)
    start_step = state.step
    log = monitor.RunLog(run_dir, total, state.step, f"pretrain {pc.objective}",
                         ["epoch", "loss", "ppl", "lr", "tokens_per_s", "eval_loss", "eval_ppl", "elapsed_s"], engine)
    log.print(f"pretrain {pc.objective}: {prepared.n_docs:,} documents ({n_eval:,} held out for the eval loss), "
              f"{prepared.n_tokens:,} tokens in {folder}, {len(train_w):,} training windows of {pc.seq_len} "
              f"({per_epoch:,} global batches of {plan.global_batch}/epoch), "
              f"{total:,} steps, world {info.world_size}, ZeRO {engine.zero_optimization_stage()}, "  # the engine's
              f"{eng.precision_of(ds)}"
              + (f", resumed at step {state.step}" if resume_tag else ""))

    t0 = time.perf_counter()
    cadence = loop.Cadence(total, monitor.log_interval(cfg.engine.log_every, total), cfg.engine.checkpoint_every,
                           eval_every=pc.eval_every,
                           stop_at=opts.stop_at)
    run = loop.LoopRun(engine, cadence, plan, info, cfg.seed, log, ckpt_dir, cfg.engine.keep_checkpoints,
                       {"stage": "pretrain", "objective": pc.objective}, auto_resume=opts.resume == RESUME_AUTO)
    if not loop.train(run, task, state):
        return None
    lm = loop.final_model(engine, ckpt_dir, state, lambda: LanguageModel(cfg.model))
    if lm is None:
        return None
    final = {"loss": float("nan"), "eval_loss": float("nan"), **(state.history[-1] if state.history else {})}
    out = artifact.save(run_dir / "artifact", lm, cfg, "lm", tok, extra={
        "objective": pc.objective, "steps": state.step, "tokens": state.tokens,
        "train_loss": final.get("loss"), "eval_loss": final.get("eval_loss"), "world_size": info.world_size,
        "corpus": corpus_record, "compute": provenance.compute(info.device, info.world_size, info.local_size,
                                                               time.perf_counter() - t0, state.step - start_step),
    })
    print(f"pretrain {pc.objective}: {state.step} steps, loss {final['loss']:.4f}, eval loss "
          f"{final['eval_loss']:.4f} (perplexity {_ppl(final['eval_loss']):.1f}), "
          f"{time.perf_counter() - t0:.0f} s this session; artifact: {out}", file=sys.stdout)
    return out


@torch.no_grad()
def eval_loss(engine: torch.nn.Module, batcher: WindowBatcher, plan: eng.BatchPlan, info: eng.DistInfo) -> float:
    """Mean loss per predicted token on the held-out windows (each rank scores a share; summed over ranks)."""
    engine.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=info.device), 0  # summed on the device: one sync
    mine = list(range(len(batcher.windows)))[info.rank::info.world_size]
    for a in range(0, len(mine), plan.micro_batch):
        part = mine[a:a + plan.micro_batch]
        total += engine(*loop.to_device(batcher.make(part, EVAL_EPOCH), info.device)).double()
        count += batcher.n_predicted(part)
    engine.train()
    s, n = eng.all_reduce_sum([float(total), count])
    return s / max(1.0, n)


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0)) if loss == loss else float("nan")
