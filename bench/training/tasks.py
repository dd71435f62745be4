"""bench/train_throughput.py's tasks: what both loops train on (the batches, how a micro-batch is made, the loss
denominator, the model), built from the config as pretrain.py and finetune.py build theirs."""

from __future__ import annotations

import atexit
import io
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.config.schema import ModelConfig, OptimConfig, RunConfig, check_tokenizer
from trainer.data.batching import bucket_batches
from trainer.data.corpus import PreparedCorpus
from trainer.data.prepare import prepare
from trainer.data.tokenizer import Tokenizer, build_tokenizer
from trainer.data.windows import EpochOrder, Windows
from trainer.engine import deepspeed_engine as eng
from trainer.engine import loop
from trainer.model.encoder import forward_flops_per_token
from trainer.tasks.finetune import ClassifierObjective, load_split
from trainer.tasks.pretrain import LMObjective, WindowBatcher


@dataclass
class Task:
    """What both loops need for one task: batches, how to make a micro-batch, the loss denominator, the model."""

    name: str  # "lm" | "classifier"
    stage: str  # "pretrain" | "finetune": which config section (micro-batch, optimizer) and ds_config stage
    batches: list[list[int]]  # global batches of example/window indices, in training order
    make: Callable[[list[int]], tuple[torch.Tensor, ...]]  # (input_ids (B, T), padding_mask (B, T), ...) on CPU
    denominator: Callable[[list[int]], int]  # the global batch's summed loss is divided by this (as in our loops)
    tokens: Callable[[list[int]], int]  # the real (non-pad) input tokens of these examples, from the data
    new_model: Callable[[], torch.nn.Module]  # the objective module (loss inside forward), fresh weights per seed
    optim: OptimConfig
    flops_per_token: float


def model_flops_per_token(m: ModelConfig, task: str, seq_len: int) -> float:
    """Training FLOPs per token: forward + backward = 3 x forward (module docstring says what is counted)."""
    return 3 * forward_flops_per_token(m, task, seq_len)


def global_batches(lengths: np.ndarray, plan: eng.BatchPlan, seed: int, need: int) -> list[list[int]]:
    """The first `need` global batches in our loops' order (bucketed, seeded per epoch), over enough epochs."""
    out: list[list[int]] = []
    epoch = 0
    while len(out) < need:
        got = loop.full_batches(bucket_batches(lengths, plan.global_batch, seed, epoch), plan)
        if not got:
            raise ValueError(f"{len(lengths)} examples cannot fill one global batch of {plan.global_batch}")
        out += got
        epoch += 1
    return out[:need]


def tokenizer(cfg: RunConfig, folder: str | None) -> Tokenizer:
    """The config's tokenizer (built: a trained one learns data.pretrain), or the one saved in `folder`
    (--tokenizer), cut at tokenizer.max_len (= --seq-len) and checked against the model's ids."""
    if folder is None:
        return build_tokenizer(cfg)
    tok = Tokenizer.load(folder, cfg.tokenizer.max_len)
    check_tokenizer(tok.vocab_size, cfg, f"--tokenizer {folder}")
    return tok


def lm_task(cfg: RunConfig, plan: eng.BatchPlan, need: int, tok_folder: str | None = None) -> Task:
    """Next-token windows as pretrain.py reads them: the reviews prepared (trainer/data/prepare.py, one worker) into a
    temporary folder, packed windows of seq_len + 1 ids (trainer/data/windows.py) in the order of its epochs."""
    tok = tokenizer(cfg, tok_folder)
    folder = Path(tempfile.mkdtemp(prefix="train-throughput-prepared-"))
    atexit.register(shutil.rmtree, folder, True)
    prepare([cfg.data.path(cfg.data.train)], tok, folder, workers=1, log=io.StringIO())
    corpus = PreparedCorpus(folder, tok.fingerprint)
    windows = Windows(corpus, 0, corpus.n_tokens, cfg.pretrain.seq_len, overlap=1)  # clm windows
    batcher = WindowBatcher(windows, "clm", cfg.pretrain.mask_prob, tok.vocab_size, cfg.seed)
    batches: list[list[int]] = []
    for epoch in range(need):  # as many epochs as it takes
        order = EpochOrder(windows, epoch, plan.global_batch, cfg.seed)
        if not len(order):
            raise ValueError(f"{len(windows)} windows cannot fill one global batch of {plan.global_batch}")
        batches += [order[b] for b in range(min(len(order), need - len(batches)))]
        if len(batches) == need:
            break
    return Task("lm", "pretrain", batches, make=lambda part: batcher.make(part, 0), denominator=batcher.n_predicted,
                tokens=lambda part: len(part) * windows.seq_len,  # full windows: no padding
                new_model=lambda: LMObjective(cfg.model, causal=True), optim=cfg.pretrain.optim,
                flops_per_token=model_flops_per_token(cfg.model, "lm", cfg.pretrain.seq_len))


def classifier_task(cfg: RunConfig, plan: eng.BatchPlan, need: int, tok_folder: str | None = None) -> Task:
    tok = tokenizer(cfg, tok_folder)  # max_len = --seq-len: reviews are cut there
    split = load_split(cfg, cfg.data.train, tok, 0)
    lengths = split.lengths  # (N,) ids per review, cut at --seq-len
    return Task("classifier", "finetune", global_batches(lengths, plan, cfg.seed, need),
                make=split.batch, denominator=len, tokens=lambda part: int(lengths[part].sum()),
                new_model=lambda: ClassifierObjective(cfg.model),
                optim=cfg.finetune.optim,
                flops_per_token=model_flops_per_token(cfg.model, "classifier", cfg.tokenizer.max_len))

