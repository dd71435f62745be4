"""The task-text language-model stage of fine-tuning (finetune.task_lm; ULMFiT's second stage, TAPT): before a new
head is fitted, the pretrained language model (encoder and LM head) goes on learning its own objective on the
labelled training split's texts, and the classifier then starts from that encoder.

Only `Sets.train` reaches this module: the validation and test texts are never read. The texts' ids, [<sos>] + pieces
+ [<eos>] as the classifier reads them (cut at tokenizer.max_len), are laid back to back in memory and read as the
pretraining's packed windows (trainer/data/windows.py, trainer/tasks/pretrain.py's batcher and objective), shuffled by
(seed, epoch). Writes RUN/task_lm/{metrics.csv, tb/, checkpoints/, artifact/}; a run that finds its artifact there
(a resumed fine-tuning) reads it instead of training again, and an interrupted stage continues from its checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from trainer import artifact
from trainer.config.schema import ConfigError, RunConfig
from trainer.data.labelled import Split
from trainer.data.tokenizer import Tokenizer
from trainer.data.windows import MemoryStream, Windows
from trainer.engine import checkpoint as ckpt
from trainer.engine import deepspeed_engine as eng
from trainer.engine import loop, monitor
from trainer.model.encoder import LanguageModel
from trainer.tasks.pretrain import LMObjective, PretrainTask, WindowBatcher

FOLDER = "task_lm"


@dataclasses.dataclass
class TaskLMTask(PretrainTask):
    """Pretraining's loop task without a held-out set (the training texts are all there is to read)."""

    def report(self, engine: Any, state: ckpt.LoopState, interval: loop.Interval, evaluate: bool) -> dict[str, Any]:
        row = {"epoch": state.epoch, "loss": interval.loss, "lr": eng.current_lr(engine),
               "tokens_per_s": interval.tokens_per_s, "elapsed_s": interval.elapsed_s}
        if evaluate:
            state.history.append({"step": state.step, "loss": interval.loss})
        return row


def stage_config(cfg: RunConfig, objective: str) -> RunConfig:
    """The run's config with its pretrain section replaced by the stage's: DeepSpeed's JSON and the batcher read it."""
    tl = cfg.finetune.task_lm
    return dataclasses.replace(cfg, pretrain=dataclasses.replace(
        cfg.pretrain, objective=objective, micro_batch=tl.micro_batch or cfg.pretrain.micro_batch,
        seq_len=tl.seq_len or cfg.pretrain.seq_len, epochs=tl.epochs, max_steps=0, eval_every=0, optim=tl.optim))


def adapt(cfg: RunConfig, pretrained: artifact.Artifact, train: Split, tok: Tokenizer, run_dir: Path,
          info: eng.DistInfo, user_json: str | None) -> dict[str, torch.Tensor]:
    """The pretrained LM's weights after finetune.task_lm.epochs passes over the windows of `train`'s texts (call on
    every rank; `cfg.seed` orders the windows and seeds dropout and MLM masks)."""
    out = run_dir / FOLDER
    done = out / "artifact"
    if (done / "artifact.json").is_file():
        return artifact.load(done).state
    objective = pretrained.meta.get("objective") or "clm"
    scfg = stage_config(cfg, objective)
    pc = scfg.pretrain
    ds, plan = eng.ds_config(scfg, "pretrain", info.world_size, user_json)
    overlap = 1 if objective == "clm" else 0
    stream = MemoryStream(train.ids)
    windows = Windows(stream, 0, stream.n_tokens, pc.seq_len, overlap)
    batcher = WindowBatcher(windows, objective, pc.mask_prob, tok.vocab_size, cfg.seed)
    task = TaskLMTask(scfg, windows, batcher, batcher, plan, info)
    if len(task.batches(0)) == 0:
        raise ConfigError(f"finetune.task_lm: the {len(train.ids)} training texts hold {len(windows)} windows of "
                          f"{pc.seq_len} ids, fewer than one global batch of {plan.global_batch}: lower "
                          "finetune.task_lm.micro_batch or finetune.task_lm.seq_len")
    total = pc.epochs * len(task.batches(0))

    torch.manual_seed(cfg.seed)
    model = LMObjective(cfg.model, causal=objective == "clm")
    model.load_state_dict(pretrained.state, strict=True)
    engine = eng.initialize(model, ds, pc.optim, total, cfg.engine)
    ckpt_dir = out / "checkpoints"
    state = ckpt.LoopState()
    if ckpt.complete_tags(ckpt_dir) or ckpt.read_latest(ckpt_dir):  # this stage, interrupted: continue it
        state, _ = ckpt.load(engine, ckpt_dir, ckpt.find(ckpt_dir))
    log = monitor.RunLog(out, total, state.step, f"task-text {objective}",
                         ["epoch", "loss", "lr", "tokens_per_s", "elapsed_s"])
    log.print(f"task-text {objective}: {len(train.ids):,} training texts, {stream.n_tokens:,} ids, "
              f"{len(windows):,} windows of {pc.seq_len}, {total} steps of {plan.global_batch} windows "
              f"(finetune.task_lm), lr {pc.optim.lr:g}" + (f", resumed at step {state.step}" if state.step else ""))
    cadence = loop.Cadence(total, monitor.log_interval(cfg.engine.log_every, total), cfg.engine.checkpoint_every)
    run = loop.LoopRun(engine, cadence, plan, info, cfg.seed, log, ckpt_dir, cfg.engine.keep_checkpoints,
                       {"stage": "finetune", "run": FOLDER, "objective": objective})
    loop.train(run, task, state)
    lm = loop.final_model(engine, ckpt_dir, state, lambda: LanguageModel(cfg.model))
    if lm is not None:
        last = state.history[-1] if state.history else {}
        artifact.save(done, lm, cfg, "lm", tok, extra={
            "objective": objective, "steps": state.step, "tokens": state.tokens, "train_loss": last.get("loss"),
            "trained_on": "the training split's texts (finetune.task_lm)",
            "adapted_from": {"path": str(pretrained.path), "weights_sha256": pretrained.meta.get("weights_sha256")}})
        log.print(f"task-text {objective}: {state.step} steps, loss {last.get('loss', float('nan')):.4f}; "
                  f"artifact: {done}")
    eng.barrier()
    return artifact.load(done).state
