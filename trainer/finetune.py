"""Fine-tune a sentiment classifier with DeepSpeed: from a pretrained LM artifact's encoder (loaded by key, new head)
or from scratch, scoring test accuracy after every epoch.

`--compare` trains both with the same seed, the same initial head and the same data order (the lab's question 4)
and writes compare.csv, compare.md and compare.png (accuracy per epoch, both curves) into the run folder.
With `--pretrained`, the encoder's architecture and the tokenizer come from the artifact (the scratch run of a
comparison uses them too, so only the initial weights differ).

Run folder: RUN/artifact is the classifier to export (the pretrained one when --pretrained is given).
Without --compare: RUN/{metrics.csv, tb/, checkpoints/}. With --compare: RUN/scratch/ and RUN/pretrained/ each hold
{metrics.csv, tb/, checkpoints/}, and the scratch classifier is RUN/scratch/artifact.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainer import artifact, monitor, stage
from trainer import checkpoint as ckpt
from trainer import engine as eng
from trainer.artifact import ArtifactError, write_text_atomic
from trainer.batching import bucket_batches, pad_batch
from trainer.cli import add_config_args, config_from_args
from trainer.config import ConfigError, RunConfig
from trainer.data import read_labeled
from trainer.model import Classifier, load_encoder
from trainer.tokenizer import Tokenizer

EXAMPLES = """examples:
  python -m trainer finetune --preset demo --pretrained runs/demo/pretrain/artifact --compare --out runs/demo/finetune
  python -m trainer finetune --preset demo --pretrained runs/demo/pretrain/artifact --out runs/demo/cls
  deepspeed --num_gpus 2 --bind_cores_to_rank launch/finetune.sh --preset tiny --out runs/tiny-cls
"""

EVAL_BATCH = 64  # test-set batch (no gradients, so larger than training batches)
ARCH = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions", "pad_id")  # from the artifact


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, default_preset="demo")
    stage.add_run_arguments(parser)
    parser.add_argument("--pretrained", metavar="ARTIFACT", help="pretraining artifact (task lm) whose encoder to load")
    parser.add_argument("--compare", action="store_true",
                        help="train from scratch and from --pretrained (same seed, data order); write compare.*")
    parser.add_argument("--tokenizer", metavar="DIR", help="without --pretrained: use this tokenizer folder")


def main(args: argparse.Namespace) -> int:
    return stage.entry(run, args)


class ClassifierObjective(Classifier):
    """The classifier with its loss inside forward (DeepSpeed's engine runs both); same parameter names."""

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor,  # type: ignore[override]
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T), (B, T) [, (B,) labels] -> (B, C) logits, or the summed cross-entropy when labels are given."""
        logits = super().forward(input_ids, padding_mask)
        return logits if labels is None else F.cross_entropy(logits.float(), labels, reduction="sum")


@dataclasses.dataclass
class Split:
    ids: list[list[int]]  # [<sos>] + pieces + [<eos>] per example
    labels: np.ndarray  # (N,) int64

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(x) for x in self.ids), dtype=np.int64, count=len(self.ids))

    def batch(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, pad = pad_batch([self.ids[i] for i in idx], Tokenizer.PAD)
        return ids, pad, torch.from_numpy(self.labels[np.asarray(idx, dtype=np.int64)])


def load_split(cfg: RunConfig, name: str, tok: Tokenizer, limit: int) -> Split:
    """A labeled file encoded with `tok`; with `limit`, the first N examples after a seeded shuffle."""
    examples = read_labeled(cfg.data.path(name), cfg.data.labels, cfg.data.text_field, cfg.data.label_field)
    examples = [examples[i] for i in _pick(cfg.seed, len(examples), limit)]
    return Split([tok.encode_example(ex) for ex in examples], np.array([ex.label for ex in examples], np.int64))


def sample_split(split: Split, seed: int, limit: int) -> Split:
    """The examples `load_split(..., limit)` would keep, taken from the whole file's already encoded split."""
    keep = _pick(seed, len(split.ids), limit)
    return Split([split.ids[i] for i in keep], split.labels[keep])


def _pick(seed: int, n: int, limit: int) -> np.ndarray:
    """Indices (ascending) of the first `limit` of n examples after a seeded shuffle; all of them when limit is 0."""
    return np.sort(np.random.default_rng([seed, n]).permutation(n)[:limit]) if limit else np.arange(n)


def adopt_pretrained(cfg: RunConfig, pre: artifact.Artifact) -> RunConfig:
    """The encoder's architecture and tokenizer come from the artifact; the rest of `cfg` stays."""
    if pre.task != "lm":
        raise ArtifactError(f"{pre.path}: task {pre.task!r}; --pretrained needs a pretraining artifact (task 'lm')")
    model = dataclasses.replace(cfg.model, **{k: getattr(pre.cfg.model, k) for k in ARCH})
    return dataclasses.replace(cfg, model=model, tokenizer=pre.cfg.tokenizer)


# ---------------------------------------------------------------------------------------------- entry


def run(args: argparse.Namespace) -> None:
    cfg = config_from_args(args)
    run_dir = Path(args.out)
    info = eng.init_distributed()
    pre = artifact.load(args.pretrained) if args.pretrained else None
    if args.compare and pre is None:
        raise ConfigError("--compare needs --pretrained ARTIFACT (the encoder to compare with scratch)")
    if pre is not None:
        cfg = adopt_pretrained(cfg, pre)
    if cfg.finetune.dropout is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=cfg.finetune.dropout))
    if cfg.model.num_classes != len(cfg.data.labels):
        raise ConfigError(f"model.num_classes={cfg.model.num_classes} but data.labels has {len(cfg.data.labels)} "
                          f"classes {cfg.data.labels}")
    runs = [("scratch", None), ("pretrained", pre)] if args.compare else [("pretrained" if pre else "scratch", pre)]
    sub = {name: run_dir / name if args.compare else run_dir for name, _ in runs}
    if args.resume:
        if not (run_dir / "config.json").is_file():
            raise ckpt.CheckpointError(f"nothing to resume: {run_dir / 'config.json'} not found")
        monitor.check_resume_config(run_dir, cfg)
        found = [ckpt.find(sub[n] / "checkpoints", args.resume) for n, _ in runs if (sub[n] / "checkpoints").is_dir()]
        if not found:  # names the folder that should have held them
            ckpt.find(sub[runs[0][0]] / "checkpoints", args.resume)
    else:
        for name, _ in runs:
            ckpt.refuse_overwrite(sub[name] / "checkpoints")
    ds, plan = eng.ds_config(cfg, "finetune", info.world_size, args.deepspeed_config or cfg.engine.deepspeed_config)

    if pre is not None:
        if eng.is_main() and not (run_dir / "tokenizer").exists():
            Tokenizer.load(pre.tokenizer_dir).save(run_dir / "tokenizer")
        eng.barrier()
    tok = stage.obtain_tokenizer(cfg, run_dir, args.tokenizer)
    if cfg.model.max_positions < tok.max_len:
        raise ConfigError(f"tokenizer max_len {tok.max_len} exceeds model.max_positions={cfg.model.max_positions}")
    train = load_split(cfg, cfg.data.train, tok, cfg.data.max_train_examples)
    extra = {name: load_split(cfg, name, tok, 0) for name in cfg.data.extra_test}
    # The per-epoch test set is often a sample of one of the extra sets (the english preset): encode that file once.
    test = sample_split(extra[cfg.data.test], cfg.seed, cfg.data.max_test_examples) if cfg.data.test in extra \
        else load_split(cfg, cfg.data.test, tok, cfg.data.max_test_examples)
    monitor.write_run_info(run_dir, cfg, ds, {"stage": "finetune", "pretrained": str(args.pretrained or ""),
                                              "train_examples": len(train.ids), "test_examples": len(test.ids)})
    if pre is not None and pre.meta.get("objective") == "mlm" and cfg.model.classifier_causal:
        monitor.note(f"note: {pre.path} was pretrained without a causal mask (mlm) but "
                     "model.classifier_causal=true; consider --set model.classifier_causal=false")

    t0 = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {}
    for name, src in runs:
        art = run_dir / "artifact" if (src is not None or not args.compare) else run_dir / "scratch" / "artifact"
        resume = args.resume if args.resume and (sub[name] / "checkpoints").is_dir() else None
        results[name] = train_classifier(cfg, name, src, tok, train, test, extra, plan, ds, sub[name], art,
                                         resume, args.stop_at, info)
        if results[name] is None:
            return  # --stop_at
    if eng.is_main():
        if args.compare:
            write_compare(run_dir, results, cfg, pre)
        for name, hist in results.items():
            accs = " ".join(f"{h['test_accuracy']:.2f}" for h in hist)
            print(f"finetune {name}: test accuracy per epoch {accs}")
            for file, acc in hist[-1].get("extra_accuracy", {}).items():
                print(f"finetune {name}: accuracy on {file} {acc:.2f}")
        print(f"finetune: {time.perf_counter() - t0:.0f} s this session; classifier artifact: {run_dir / 'artifact'}")


# ---------------------------------------------------------------------------------------------- loop


def train_classifier(cfg: RunConfig, name: str, pre: artifact.Artifact | None, tok: Tokenizer, train: Split,
                     test: Split, extra: dict[str, Split], plan: eng.BatchPlan, ds: dict[str, Any], run_dir: Path,
                     art_dir: Path, resume: str | None, stop_at: int,
                     info: eng.DistInfo) -> list[dict[str, Any]] | None:
    """Train one classifier; returns its per-epoch history (None when stopped by --stop_at)."""
    fc, ckpt_dir = cfg.finetune, run_dir / "checkpoints"

    def epoch_batches(epoch: int) -> list[list[int]]:
        return stage.usable(bucket_batches(train.lengths, plan.global_batch, cfg.seed, epoch), plan)

    per_epoch = len(epoch_batches(0))
    if per_epoch == 0:
        raise ConfigError(f"{len(train.ids)} training examples cannot fill one global batch of {plan.global_batch}")
    total = fc.max_steps or fc.epochs * per_epoch

    torch.manual_seed(cfg.seed)  # scratch and pretrained start from the same head (and scratch encoder) weights
    model = ClassifierObjective(cfg.model)
    if pre is not None:
        load_encoder(model, pre.state)
    engine = eng.initialize(model, ds, fc.optim, total)
    state = ckpt.LoopState()
    if resume:
        state, _ = ckpt.load(engine, ckpt_dir, ckpt.find(ckpt_dir, resume))
    log = monitor.Metrics(run_dir, total, state.step, f"finetune {name}",
                          ["epoch", "loss", "lr", "examples_per_s", "test_accuracy", "elapsed_s"])
    log.print(f"finetune {name}: {len(train.ids):,} train / {len(test.ids):,} test examples, {per_epoch} steps of "
              f"{plan.global_batch}/epoch, {total} steps, world {info.world_size}"
              + (f", resumed at step {state.step}" if resume else ""))

    t0 = t_log = time.perf_counter()
    loss_acc, n_acc, ex_log = torch.zeros((), device=info.device), 0, 0
    epoch_loss, epoch_n = 0.0, 0
    batches = epoch_batches(state.epoch)
    while state.step < total and not state.done:
        batch = batches[state.batch]
        for micro, part in enumerate(stage.slots(batch, plan)[info.rank::plan.world_size]):
            ids, pad, labels = stage.to_device(train.batch(part), info.device)
            stage.seed_micro_step(cfg.seed, state.step, micro, info.rank)
            loss = engine(ids, pad, labels)
            engine.backward(loss * (plan.world_size / len(batch)), scale_wrt_gas=False)  # grad of the global mean
            engine.step()
            loss_acc += loss.detach()
            ex_log += len(part)
        n_acc += len(batch)
        epoch_n += len(batch)
        state.step, state.batch, state.tokens = state.step + 1, state.batch + 1, state.tokens + len(batch)
        log.advance()
        last = state.step == total
        epoch_end = state.batch == len(batches) or last
        if state.step % cfg.engine.log_every == 0 or epoch_end:
            (loss_sum,) = eng.all_reduce_sum([float(loss_acc)])  # the one host-device sync, at log intervals
            epoch_loss += loss_sum
            now = time.perf_counter()
            row: dict[str, Any] = {"epoch": state.epoch, "loss": loss_sum / max(1, n_acc),
                                   "lr": eng.current_lr(engine), "examples_per_s": ex_log / max(1e-9, now - t_log),
                                   "elapsed_s": now - t0}
            if epoch_end:
                acc = accuracy(engine, test, info)
                row["test_accuracy"] = acc
                state.history.append({"epoch": state.epoch + 1, "step": state.step, "test_accuracy": acc,
                                      "train_loss": epoch_loss / max(1, epoch_n)})
                log.print(f"finetune {name}: epoch {state.epoch + 1} train loss "
                          f"{state.history[-1]['train_loss']:.4f}, test accuracy {acc:.2f}%")
                if last and extra:  # the other test sets: once, on the final weights
                    state.history[-1]["extra_accuracy"] = {f: accuracy(engine, sp, info) for f, sp in extra.items()}
                    log.print(f"finetune {name}: " + ", ".join(
                        f"{f} {a:.2f}%" for f, a in state.history[-1]["extra_accuracy"].items()))
                epoch_loss, epoch_n = 0.0, 0
            log.log(state.step, **row)
            loss_acc.zero_()
            n_acc, ex_log, t_log = 0, 0, time.perf_counter()
        if state.batch == len(batches):
            state.epoch, state.batch = state.epoch + 1, 0
            batches = epoch_batches(state.epoch)
        state.done = last
        if last or (cfg.engine.checkpoint_every and state.step % cfg.engine.checkpoint_every == 0) \
                or state.step == stop_at:
            ckpt.save(engine, ckpt_dir, state, cfg.engine.keep_checkpoints, {"stage": "finetune", "run": name})
        if state.step == stop_at and not last:
            log.close()
            log.print(f"stopped at step {state.step} (--stop_at); resume with --resume")
            return None
    log.close()

    tag = ckpt.read_latest(ckpt_dir) or ckpt.tag_for(state.step)
    weights = eng.fp32_state_dict(engine, ckpt_dir, tag)
    if eng.is_main():
        clf = Classifier(cfg.model)
        clf.load_state_dict(weights, strict=True)
        final = state.history[-1] if state.history else {}
        artifact.save(art_dir, clf, cfg, "classifier", tok, extra={
            "objective": None, "run": name, "steps": state.step, "epochs": len(state.history),
            "test_accuracy": final.get("test_accuracy"), "extra_accuracy": final.get("extra_accuracy"),
            "history": state.history,
            "pretrained_from": None if pre is None else {"path": str(pre.path),
                                                           "weights_sha256": pre.meta.get("weights_sha256"),
                                                           "objective": pre.meta.get("objective")},
        })
    return state.history


@torch.no_grad()
def accuracy(engine: torch.nn.Module, split: Split, info: eng.DistInfo) -> float:
    """Test accuracy in percent; each rank scores a share of the batches, counts are summed over ranks."""
    engine.eval()
    correct = torch.zeros((), dtype=torch.int64, device=info.device)
    count = 0
    batches = bucket_batches(split.lengths, EVAL_BATCH, 0, 0, shuffle=False)
    for idx in batches[info.rank::info.world_size]:
        ids, pad, labels = stage.to_device(split.batch(idx), info.device)
        correct += (engine(ids, pad).argmax(dim=-1) == labels).sum()
        count += len(idx)
    engine.train()
    c, n = eng.all_reduce_sum([float(correct), count])
    return 100.0 * c / max(1.0, n)


# ---------------------------------------------------------------------------------------------- comparison


def write_compare(run_dir: Path, results: dict[str, list[dict[str, Any]]], cfg: RunConfig,
                  pre: artifact.Artifact | None) -> None:
    """compare.csv, compare.md and compare.png: test accuracy per epoch, scratch vs pretrained."""
    s, p = results["scratch"], results["pretrained"]
    rows = [(a["epoch"], a["test_accuracy"], b["test_accuracy"]) for a, b in zip(s, p, strict=True)]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["epoch", "scratch_accuracy", "pretrained_accuracy", "difference"])
    w.writerows([e, f"{a:.2f}", f"{b:.2f}", f"{b - a:+.2f}"] for e, a, b in rows)
    write_text_atomic(run_dir / "compare.csv", buf.getvalue())
    objective = pre.meta.get("objective") if pre else None
    md = [f"Test accuracy (%) per epoch on `{cfg.data.test}`, preset `{cfg.preset}`, seed {cfg.seed}; "
          f"pretrained encoder: `{pre.path if pre else ''}` (objective {objective}).", "",
          "| epoch | from scratch | pretrained | difference |", "|---:|---:|---:|---:|"]
    md += [f"| {e} | {a:.2f} | {b:.2f} | {b - a:+.2f} |" for e, a, b in rows]
    best_s, best_p = max(r[1] for r in rows), max(r[2] for r in rows)
    wins = sum(b > a for _, a, b in rows)
    md += ["", f"Best: scratch {best_s:.2f}, pretrained {best_p:.2f}. "
           f"Pretrained ahead at {wins} of {len(rows)} epochs.", ""]
    extra_s, extra_p = s[-1].get("extra_accuracy", {}), p[-1].get("extra_accuracy", {})
    if extra_s:
        md += ["Accuracy (%) of the final weights on the other test sets (`data.extra_test`):", "",
               "| test set | from scratch | pretrained | difference |", "|---|---:|---:|---:|"]
        md += [f"| `{f}` | {a:.2f} | {extra_p[f]:.2f} | {extra_p[f] - a:+.2f} |" for f, a in extra_s.items()]
        md += [""]
    write_text_atomic(run_dir / "compare.md", "\n".join(md))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    epochs = [r[0] for r in rows]
    ax.plot(epochs, [r[1] for r in rows], marker="o", label="from scratch")
    ax.plot(epochs, [r[2] for r in rows], marker="s", label=f"pretrained ({objective})")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_xticks(epochs)
    ax.set_title(f"{Path(cfg.data.test).parent.name or cfg.data.test}: pretrained vs scratch ({cfg.preset})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = run_dir / ".compare.png.tmp"
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(run_dir / "compare.png")
    print(f"comparison: {run_dir / 'compare.md'}, {run_dir / 'compare.png'}", file=sys.stdout)
