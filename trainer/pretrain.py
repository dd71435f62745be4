"""Pretrain the encoder as a language model with DeepSpeed: next-token (the lab) or masked LM (BERT-style).

Documents of `data.pretrain` become [<sos>] + pieces + [<eos>] and are cut into windows of `pretrain.seq_len`
tokens; the last `data.pretrain_eval_lines` documents (at most a tenth) are held out for the eval loss. The loss is
the mean over predicted tokens (padding never counts) of the whole global batch, so 2 ranks x B equal 1 rank x 2B.
  clm: input window[:-1] predicts window[1:] under the causal mask (windows overlap by one token, so every token
       but a document's <sos> is predicted once).
  mlm: 15% of the real tokens of a window (at least one; never <sos>/<eos>) are predicted, no causal mask;
       of those 80% become <oov> (id 3, the mask token), 10% a random piece, 10% stay.
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

from trainer import artifact, cli, loop, monitor
from trainer import checkpoint as ckpt
from trainer import engine as eng
from trainer.batching import bucket_batches, pad_batch
from trainer.config import ConfigError, ModelConfig, RunConfig
from trainer.corpus import Corpus, encode_corpus
from trainer.model import LanguageModel
from trainer.tokenizer import Tokenizer

EXAMPLES = """examples:
  python -m trainer pretrain --preset demo --out runs/demo/pretrain
  python -m trainer pretrain --preset demo --set pretrain.objective=mlm --out runs/demo/pretrain-mlm
  deepspeed --num_gpus 2 --bind_cores_to_rank launch/pretrain.sh --preset tiny --out runs/tiny
  python -m trainer pretrain --preset demo --out runs/demo/pretrain --resume      # after an interruption
"""

MASK = Tokenizer.OOV  # the mask token is <oov> (id 3): the served vocabulary has no <mask> row, so none is added
EVAL_EPOCH = 1 << 30  # seeds the eval windows' MLM masks: fixed, so every eval scores the same task


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_config_args(parser, default_preset="demo", resumable=True)
    cli.add_run_arguments(parser, tokenizer_help="use this tokenizer folder instead of building one")


def main(args: argparse.Namespace) -> int:
    cli.on_every_rank(lambda: run(cli.config_choice(args).resolve(), cli.run_options(args, loop.RunOptions)))


class LMObjective(LanguageModel):
    """The language model with its loss inside forward, so DeepSpeed's engine runs both.

    Same parameter names as LanguageModel (a subclass): checkpoints and artifacts load into either."""

    def __init__(self, cfg: ModelConfig, causal: bool) -> None:
        super().__init__(cfg)
        self.causal = causal

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor,  # type: ignore[override]
                positions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(B, T) ids, (B, T) pad mask, (N,) flat indices into B*T of predicted positions, (N,) target ids
        -> summed cross-entropy (scalar). The head runs on the N predicted positions only (it is most FLOPs)."""
        h = self.encoder(input_ids, padding_mask, self.causal)  # (B, T, d)
        picked = h.reshape(-1, h.shape[-1]).index_select(0, positions)  # (N, d)
        return F.cross_entropy(self.head(picked).float(), targets, reduction="sum")


# ---------------------------------------------------------------------------------------------- data


@dataclass
class Windows:
    """Window w is tokens [start[w], start[w] + length[w]) of document doc[w]'s sequence [<sos>] + pieces + [<eos>]."""

    doc: np.ndarray  # (W,) int64
    start: np.ndarray  # (W,) int64
    length: np.ndarray  # (W,) int64


def cut_windows(docs: np.ndarray, full_len: np.ndarray, seq_len: int, overlap: int) -> Windows:
    """Cut each document's sequence (length full_len[doc]) into windows of seq_len + overlap tokens, stepping by
    seq_len: with overlap 1 (clm) each window's last token is the next one's first, so every target appears once."""
    f = full_len[docs]
    n = np.maximum(1, -(-(f - overlap) // seq_len))  # (D,) windows per document
    doc = np.repeat(docs, n)
    first = np.repeat(np.cumsum(n) - n, n)
    start = (np.arange(len(doc)) - first) * seq_len
    length = np.minimum(seq_len + overlap, full_len[doc] - start)
    return Windows(doc, start, length)


class WindowBatcher:
    """Window ids -> padded model inputs, targets, and the count of predicted tokens (known before the forward)."""

    def __init__(self, corpus: Corpus, windows: Windows, objective: str, mask_prob: float, vocab: int, seed: int):
        self.corpus, self.windows, self.objective, self.mask_prob = corpus, windows, objective, mask_prob
        self.vocab, self.seed = vocab, seed
        self.full_len = corpus.lengths() + 2

    def ids(self, w: int) -> np.ndarray:
        d, s, n = int(self.windows.doc[w]), int(self.windows.start[w]), int(self.windows.length[w])
        p = np.arange(s, s + n)  # positions in [<sos>] + pieces + [<eos>]
        f = int(self.full_len[d])
        tokens = self.corpus.tokens
        out = tokens[np.clip(self.corpus.offsets[d] + p - 1, 0, max(0, len(tokens) - 1))].astype(np.int64)
        out[p == 0] = Tokenizer.SOS
        out[p == f - 1] = Tokenizer.EOS
        return out

    def n_predicted(self, batch: list[int]) -> int:
        """Predicted tokens of a set of windows (clm: length - 1; mlm: round(15%) of the non-special tokens)."""
        w = np.asarray(batch, dtype=np.int64)
        n = self.windows.length[w]
        if self.objective == "clm":
            return int((n - 1).sum())
        start = self.windows.start[w]
        real = n - (start == 0) - (start + n == self.full_len[self.windows.doc[w]])
        return int(np.where(real > 0, np.maximum(1, np.rint(real * self.mask_prob)), 0).sum())

    def make(self, batch: list[int], epoch: int) -> tuple[torch.Tensor, ...]:
        """(input_ids (B, T), padding_mask (B, T), positions (N,), targets (N,))."""
        seqs, pos, tgt = [], [], []
        for w in batch:
            x = self.ids(w)
            if self.objective == "clm":
                seqs.append(x[:-1])
                pos.append(np.arange(len(x) - 1))
                tgt.append(x[1:])
            else:
                x, p, t = self.mask(x, w, epoch)
                seqs.append(x)
                pos.append(p)
                tgt.append(t)
        ids, pad = pad_batch(seqs, Tokenizer.PAD)
        T = ids.shape[1]
        flat = np.concatenate([p + row * T for row, p in enumerate(pos)])  # indices into the (B*T) positions
        return ids, pad, torch.from_numpy(flat.astype(np.int64)), torch.from_numpy(np.concatenate(tgt))

    def mask(self, x: np.ndarray, w: int, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """BERT masking of one window, seeded by (seed, epoch, window): the same on any number of ranks."""
        rng = np.random.default_rng([self.seed, epoch, int(w)])
        cand = np.flatnonzero((x != Tokenizer.SOS) & (x != Tokenizer.EOS))
        if len(cand) == 0:
            return x, np.zeros(0, np.int64), np.zeros(0, np.int64)
        k = max(1, int(np.rint(len(cand) * self.mask_prob)))
        chosen = np.sort(rng.choice(cand, size=k, replace=False))
        target = x[chosen].copy()
        x = x.copy()
        r = rng.random(k)
        x[chosen[r < 0.8]] = MASK
        rand = chosen[(r >= 0.8) & (r < 0.9)]
        x[rand] = rng.integers(Tokenizer.OOV + 1, self.vocab, size=len(rand))
        return x, chosen, target


def obtain_corpus(cfg: RunConfig, tok: Tokenizer, run_dir: Path) -> Corpus:
    """RUN_DIR/corpus.npz: the pretraining text tokenized once by rank 0 (a resume reuses it)."""
    path = run_dir / "corpus.npz"
    if eng.is_main() and not path.exists():
        corpus = encode_corpus([cfg.data.path(p) for p in cfg.data.pretrain], tok, progress=True)
        corpus.save(path)
    eng.barrier()
    return Corpus.load(path, fingerprint=tok.fingerprint)


# ---------------------------------------------------------------------------------------------- run


@dataclass
class PretrainTask:
    """The loop's view of pretraining (trainer/loop.py's Task): windows in, next-token or masked-token loss out."""

    cfg: RunConfig
    windows: Windows  # the training windows
    train: WindowBatcher
    held_out: WindowBatcher
    plan: eng.BatchPlan
    info: eng.DistInfo

    def batches(self, epoch: int) -> list[list[int]]:
        return loop.full_batches(bucket_batches(self.windows.length, self.plan.global_batch, self.cfg.seed, epoch),
                                 self.plan)

    def inputs(self, part: list[int], epoch: int) -> tuple[torch.Tensor, ...]:
        return self.train.make(part, epoch)

    def denominator(self, batch: list[int]) -> int:
        return self.train.n_predicted(batch)

    def seen(self, batch: list[int]) -> int:
        return int(self.windows.length[batch].sum())  # window tokens of the global batch (all ranks)

    def report(self, engine: Any, state: ckpt.LoopState, interval: loop.Interval, evaluate: bool) -> dict[str, Any]:
        row: dict[str, Any] = {"epoch": state.epoch, "loss": interval.loss, "ppl": _ppl(interval.loss),
                               "lr": eng.current_lr(engine), "tokens_per_s": interval.tokens_per_s,
                               "elapsed_s": interval.elapsed_s}
        if evaluate:
            row["eval_loss"] = eval_loss(engine, self.held_out, self.plan, self.info)
            row["eval_ppl"] = _ppl(row["eval_loss"])
            state.history.append({"step": state.step, "loss": interval.loss, "eval_loss": row["eval_loss"]})
        return row

    def improved(self, state: ckpt.LoopState) -> bool:
        return False  # the artifact holds the last step's weights

    def keep(self, engine: Any, ckpt_dir: Path, tag: str, state: ckpt.LoopState) -> None:
        raise AssertionError("pretraining keeps the last weights")

    def stop_early(self, state: ckpt.LoopState) -> bool:
        return False


def run(cfg: RunConfig, opts: loop.RunOptions) -> Path | None:
    """Pretrain into `opts.out`; returns the artifact folder (None on ranks > 0, or when stopped by stop_at)."""
    pc = cfg.pretrain
    run_dir, ckpt_dir = opts.out, opts.out / "checkpoints"
    info = eng.init_distributed()
    (resume_tag,) = loop.resume_tags(run_dir, cfg, [ckpt_dir], opts.resume)
    ds, plan = eng.ds_config(cfg, "pretrain", info.world_size, opts.deepspeed_config or cfg.engine.deepspeed_config)
    cli.check_out(run_dir)  # every rank writes its checkpoint shards there
    if not cfg.data.pretrain:
        raise ConfigError("data.pretrain is empty: name your unlabelled text files (--set data.pretrain=FILE,FILE)")
    monitor.note(f"data: pretrain: {', '.join(str(cfg.data.path(p)) for p in cfg.data.pretrain)}")
    tok = loop.run_tokenizer(cfg, run_dir, opts.tokenizer)
    corpus = obtain_corpus(cfg, tok, run_dir)

    # Held-out slice: the last documents (at most a tenth of them). Windows: clm overlaps them by one token (see
    # module docstring).
    n_eval = min(cfg.data.pretrain_eval_lines, max(1, len(corpus) // 10), len(corpus) - 1)
    full_len = corpus.lengths() + 2
    overlap = 1 if pc.objective == "clm" else 0
    train_w = cut_windows(np.arange(len(corpus) - n_eval), full_len, pc.seq_len, overlap)
    eval_w = cut_windows(np.arange(len(corpus) - n_eval, len(corpus)), full_len, pc.seq_len, overlap)
    task = PretrainTask(cfg, train_w, WindowBatcher(corpus, train_w, pc.objective, pc.mask_prob, tok.vocab_size,
                                                    cfg.seed),
                        WindowBatcher(corpus, eval_w, pc.objective, pc.mask_prob, tok.vocab_size, cfg.seed),
                        plan, info)
    per_epoch, total = loop.steps_of(task, pc.epochs, pc.max_steps, f"{len(train_w.doc)} training windows",
                                     plan.global_batch)
    monitor.write_run_info(run_dir, cfg, ds, {"stage": "pretrain", "documents": len(corpus), "tokens": corpus.n_tokens,
                                              "train_windows": len(train_w.doc), "eval_windows": len(eval_w.doc),
                                              "steps": total, "global_batch": plan.global_batch})

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank and for every world size
    engine = eng.initialize(LMObjective(cfg.model, causal=pc.objective == "clm"), ds, pc.optim, total)
    state = ckpt.LoopState()
    if resume_tag:
        state, _ = ckpt.load(engine, ckpt_dir, resume_tag)
    log = monitor.RunLog(run_dir, total, state.step, f"pretrain {pc.objective}",
                         ["epoch", "loss", "ppl", "lr", "tokens_per_s", "eval_loss", "eval_ppl", "elapsed_s"])
    log.print(f"pretrain {pc.objective}: {len(corpus):,} documents ({n_eval:,} held out for the eval loss), "
              f"{corpus.n_tokens:,} pieces, {len(train_w.doc):,} training windows ({per_epoch:,} global batches of "
              f"{plan.global_batch}/epoch), {total:,} steps, "
              f"world {info.world_size}, ZeRO {cfg.engine.zero_stage}, {cfg.engine.precision}"
              + (f", resumed at step {state.step}" if resume_tag else ""))

    t0 = time.perf_counter()
    cadence = loop.Cadence(total, cfg.engine.log_every, cfg.engine.checkpoint_every, eval_every=pc.eval_every,
                           stop_at=opts.stop_at)
    if not loop.train(engine, task, state, cadence, plan, info, cfg.seed, log, ckpt_dir, cfg.engine.keep_checkpoints,
                      {"stage": "pretrain", "objective": pc.objective}):
        return None
    lm = loop.final_model(engine, ckpt_dir, state, lambda: LanguageModel(cfg.model))
    if lm is None:
        return None
    final = {"loss": float("nan"), "eval_loss": float("nan"), **(state.history[-1] if state.history else {})}
    out = artifact.save(run_dir / "artifact", lm, cfg, "lm", tok, extra={
        "objective": pc.objective, "steps": state.step, "tokens": state.tokens,
        "train_loss": final.get("loss"), "eval_loss": final.get("eval_loss"), "world_size": info.world_size,
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
    batches = bucket_batches(batcher.windows.length, plan.micro_batch, batcher.seed, 0, shuffle=False)
    for batch in batches[info.rank::info.world_size]:
        ids, pad, pos, tgt = loop.to_device(batcher.make(batch, EVAL_EPOCH), info.device)
        total += engine(ids, pad, pos, tgt).double()
        count += len(tgt)
    engine.train()
    s, n = eng.all_reduce_sum([float(total), count])
    return s / max(1.0, n)


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0)) if loss == loss else float("nan")
