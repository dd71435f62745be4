"""Fine-tuning as the training loop sees it (trainer/engine/loop.py's Task): the splits of a run, the per-epoch
validation and test scores, the epoch kept (the first with the best validation score), its weights on disk
(RUN/best.safetensors, rank 0 writes, every rank reads), and the confusion matrix every score comes from.
"""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trainer.config.schema import RunConfig
from trainer.data.batching import bucket_batches
from trainer.data.labelled import Split
from trainer.engine import checkpoint as ckpt
from trainer.engine import deepspeed_engine as eng
from trainer.engine import loop, monitor
from trainer.engine.distributed import all_gather_bytes
from trainer.metrics import summarize, summary_line

EVAL_BATCH = 64  # evaluation batch (no gradients, so larger than training batches)
KEPT = "best.safetensors"  # in each run folder: the weights of the epoch kept so far


@dataclasses.dataclass
class Sets:
    """The encoded splits of a run."""

    train: Split
    valid: Split  # picks the epoch kept
    test: Split  # whole: scored with the kept weights
    test_epoch: Split  # test, or its seeded sample of data.max_test_examples: the per-epoch curve
    extra: dict[str, Split]  # data.extra_test, scored with the kept weights


@dataclasses.dataclass
class ClassifierTask:
    """The loop's view of fine-tuning (trainer/engine/loop.py's Task): labelled examples in, mean cross-entropy out."""

    cfg: RunConfig
    name: str  # "scratch" | "pretrained"
    sets: Sets
    plan: eng.BatchPlan
    info: eng.DistInfo
    kept_path: Path  # RUN/best.safetensors
    seed: int  # the data order's (the run's training seed)
    total: int = 0  # optimizer steps of the run
    log: monitor.RunLog | None = None  # where the per-epoch lines go (set once the run's log is open)
    epoch_loss: float = 0.0  # summed loss of the epoch's log intervals (all ranks)
    epoch_n: int = 0  # examples of those intervals

    def batches(self, epoch: int) -> list[list[int]]:
        return loop.full_batches(bucket_batches(self.sets.train.lengths, self.plan.global_batch, self.seed,
                                                epoch), self.plan)

    def inputs(self, part: list[int], epoch: int) -> tuple[torch.Tensor, ...]:
        return self.sets.train.batch(part)

    def denominator(self, batch: list[int]) -> int:
        return len(batch)

    def tokens(self, batch: list[int]) -> int:
        return sum(len(self.sets.train.ids[i]) for i in batch)

    def report(self, engine: Any, state: ckpt.LoopState, interval: loop.Interval, evaluate: bool) -> dict[str, Any]:
        self.epoch_loss += interval.loss_sum
        self.epoch_n += interval.count
        row: dict[str, Any] = {"epoch": state.epoch, "loss": interval.loss, "lr": eng.current_lr(engine),
                               "examples_per_s": interval.examples_per_s, "elapsed_s": interval.elapsed_s}
        if evaluate:  # the end of an epoch
            names, metric = self.cfg.data.names, self.cfg.finetune.select_metric
            with eng.whole_weights(engine):  # each rank scores its share of the batches
                valid = summarize(confusion_of(engine, self.sets.valid, self.info, len(names)), names)
                test = summarize(confusion_of(engine, self.sets.test_epoch, self.info, len(names)), names)
            row.update(valid_accuracy=valid["accuracy"], valid_macro_f1=valid["macro_f1"],
                       test_accuracy=test["accuracy"])
            state.history.append({"epoch": state.epoch + 1, "step": state.step, "valid": valid, "test": test,
                                  "valid_score": valid[metric], "test_accuracy": test["accuracy"],
                                  "train_loss": self.epoch_loss / max(1, self.epoch_n),
                                  "data_order_sha256": loop.order_digest(self.batches(state.epoch))})
            kept = " (best so far: kept)" if self.improved(state) else ""
            assert self.log is not None
            self.log.print(f"finetune {self.name}: epoch {state.epoch + 1} train loss "
                           f"{state.history[-1]['train_loss']:.4f}; valid {summary_line(valid)}{kept}; test accuracy "
                           f"{test['accuracy']:.2f}% (curve only)")
            self.epoch_loss, self.epoch_n = 0.0, 0
        return row

    def best(self, state: ckpt.LoopState) -> int:
        """Index in history of the epoch kept: the first with the highest validation score."""
        scores = [h["valid_score"] for h in state.history]
        return int(np.argmax(scores)) if scores else -1

    def improved(self, state: ckpt.LoopState) -> bool:
        return bool(state.history) and self.best(state) == len(state.history) - 1

    def stop_early(self, state: ckpt.LoopState) -> str | None:
        patience = self.cfg.finetune.patience
        if patience > 0 and len(state.history) - 1 - self.best(state) >= patience:
            return f"no better validation score in {patience} epochs (finetune.patience)"
        return None

    def store_best(self, engine: Any, ckpt_dir: Path, tag: str, state: ckpt.LoopState) -> None:
        weights = eng.fp32_state_dict(engine, ckpt_dir, tag)  # every rank (bf16 under ZeRO reads the checkpoint)
        if eng.is_main():
            tmp = self.kept_path.with_name(f".{KEPT}.{os.getpid()}.tmp")
            save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp), metadata={"step": str(state.step)})
            os.replace(tmp, self.kept_path)
        eng.barrier()

    def kept_weights(self, state: ckpt.LoopState) -> dict[str, torch.Tensor]:
        """The weights of the kept epoch (every rank reads the file rank 0 wrote)."""
        record = state.history[self.best(state)]
        step = kept_step(self.kept_path)
        if step != record["step"]:
            raise ckpt.CheckpointError(f"{self.kept_path} holds the weights of step {step}, but the run keeps those "
                                       f"of step {record['step']} (epoch {record['epoch']}): it was replaced or "
                                       "removed; fine-tune again into a new --out")
        with safe_open(str(self.kept_path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}


def kept_step(path: Path) -> int | None:
    """The step whose weights the kept file holds (None: no file)."""
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        return int((f.metadata() or {}).get("step", -1))


@torch.no_grad()
def confusion_of(model: torch.nn.Module, split: Split, info: eng.DistInfo, classes: int) -> np.ndarray:
    """(C, C) confusion matrix (rows true, columns predicted); each rank scores a share, counts summed over ranks.
    `model(ids, pad)` gives (B, C) logits: the DeepSpeed engine or a plain Classifier."""
    was_training = model.training
    model.eval()
    cm = torch.zeros(classes * classes, dtype=torch.int64, device=info.device)
    batches = bucket_batches(split.lengths, EVAL_BATCH, 0, 0, shuffle=False)
    for idx in batches[info.rank::info.world_size]:
        ids, pad, labels = loop.to_device(split.batch(idx), info.device)
        cm += torch.bincount(labels * classes + model(ids, pad).argmax(dim=-1), minlength=classes * classes)
    model.train(was_training)
    return np.rint(eng.all_reduce_sum(cm.cpu().tolist())).astype(np.int64).reshape(classes, classes)


def confusion(logits: np.ndarray, labels: np.ndarray, classes: int) -> np.ndarray:
    """(C, C) confusion matrix (rows true, columns predicted) of (N, C) logits."""
    return np.bincount(labels * classes + logits.argmax(axis=1), minlength=classes * classes).reshape(classes, classes)


@torch.no_grad()
def logits_of(model: torch.nn.Module, split: Split, info: eng.DistInfo) -> tuple[np.ndarray, np.ndarray]:
    """(N, C) float32 logits and (N,) labels of a split, on every rank: each rank scores a share (as confusion_of),
    then the shares are gathered (np.save'd, no pickle). Rows in batch order, not the split's."""
    was_training = model.training
    model.eval()
    batches = bucket_batches(split.lengths, EVAL_BATCH, 0, 0, shuffle=False)
    rows, labels = [], []
    for idx in batches[info.rank::info.world_size]:
        ids, pad, lab = loop.to_device(split.batch(idx), info.device)
        rows.append(model(ids, pad).float().cpu().numpy())
        labels.append(lab.cpu().numpy())
    model.train(was_training)
    buf = io.BytesIO()
    np.save(buf, np.concatenate(rows) if rows else np.empty((0, 0), np.float32))
    np.save(buf, np.concatenate(labels) if labels else np.empty(0, np.int64))
    sizes = [int(n) for n in eng.all_reduce_sum([buf.tell() if r == info.rank else 0
                                                  for r in range(info.world_size)])]
    parts = [io.BytesIO(b) for b in all_gather_bytes(buf.getvalue(), max(sizes))]
    got = [(np.load(b, allow_pickle=False), np.load(b, allow_pickle=False)) for b in parts]
    got = [(z, y) for z, y in got if len(y)]
    return np.concatenate([z for z, _ in got]), np.concatenate([y for _, y in got])
