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

from trainer import artifact, cli, loop, monitor
from trainer import checkpoint as ckpt
from trainer import config as config_mod
from trainer import engine as eng
from trainer.artifact import ArtifactError, write_text_atomic
from trainer.batching import bucket_batches, pad_batch
from trainer.config import Choice, ConfigError, RunConfig
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
    cli.add_config_args(parser, default_preset="demo")
    cli.add_run_arguments(parser, tokenizer_help="without --pretrained: use this tokenizer folder")
    parser.add_argument("--pretrained", metavar="ARTIFACT",
                        help="pretraining artifact (task lm) whose encoder and tokenizer to use")
    parser.add_argument("--compare", action="store_true",
                        help="train from scratch and from --pretrained (same seed, data order); write compare.*")


def main(args: argparse.Namespace) -> int:
    def stage() -> None:
        opts = cli.run_options(args, FinetuneOptions, pretrained=Path(args.pretrained) if args.pretrained else None,
                               compare=args.compare)
        run(resolve_config(cli.config_choice(args), opts.pretrained), opts)

    cli.on_every_rank(stage)


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


def pretrained_fields(pre_cfg: RunConfig) -> dict[str, Any]:
    """The keys a pretrained artifact decides: the encoder's architecture and the whole tokenizer section."""
    return {**{f"model.{k}": getattr(pre_cfg.model, k) for k in ARCH},
            **{f"tokenizer.{k}": v for k, v in dataclasses.asdict(pre_cfg.tokenizer).items()}}


def resolve_config(choice: Choice, pretrained: Path | None) -> RunConfig:
    """The run's config: with --pretrained, the artifact's encoder architecture and tokenizer (a --set or --config
    key that would change them is an error); finetune.dropout, when set, replaces model.dropout."""
    if pretrained is None:
        cfg = choice.resolve()
    else:
        pre_cfg = config_mod.load(artifact.config_path(pretrained))
        cfg = choice.resolve(pretrained_fields(pre_cfg), f"--pretrained {pretrained}")
    if cfg.finetune.dropout is not None:
        # A config file may hold both (model.dropout is pretraining's); a --set of model.dropout here is a mistake.
        if any(a.split("=", 1)[0].strip() == "model.dropout" for a in choice.assignments) \
                and cfg.model.dropout != cfg.finetune.dropout:
            raise ConfigError(f"--set model.dropout={cfg.model.dropout} would be ignored: finetune.dropout="
                              f"{cfg.finetune.dropout} replaces it while fine-tuning; set finetune.dropout instead")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=cfg.finetune.dropout))
    return cfg


# ---------------------------------------------------------------------------------------------- entry


@dataclasses.dataclass(frozen=True)
class FinetuneOptions(loop.RunOptions):
    """RunOptions plus what fine-tuning starts from."""

    pretrained: Path | None = None  # a pretraining artifact (task lm) whose encoder and tokenizer to use
    compare: bool = False  # train from scratch and from `pretrained` (same seed and data order); write compare.*

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compare and self.pretrained is None:
            raise ConfigError("--compare needs --pretrained ARTIFACT (the encoder to compare with scratch)")


def run(cfg: RunConfig, opts: FinetuneOptions) -> Path | None:
    """Fine-tune into `opts.out` (`cfg` from `resolve_config`); returns the classifier artifact (None on ranks > 0,
    or when stopped by stop_at)."""
    run_dir = opts.out
    info = eng.init_distributed()
    pretrained = artifact.load(opts.pretrained) if opts.pretrained else None
    if pretrained is not None:
        if pretrained.task != "lm":
            raise ArtifactError(f"{pretrained.path}: task {pretrained.task!r}; --pretrained needs a pretraining "
                                "artifact (task 'lm')")
        flat, want = config_mod.flatten(cfg.to_dict()), pretrained_fields(pretrained.cfg)
        differ = [k for k in want if flat[k] != want[k]]
        if differ:
            raise ConfigError(f"the config differs from {pretrained.path} at {', '.join(differ)}: build it with "
                              "finetune.resolve_config")
    runs = [("scratch", None), ("pretrained", pretrained)] if opts.compare \
        else [("pretrained" if pretrained else "scratch", pretrained)]
    run_dirs = {name: run_dir / name if opts.compare else run_dir for name, _ in runs}
    tags = dict(zip(run_dirs, loop.resume_tags(run_dir, cfg, [d / "checkpoints" for d in run_dirs.values()],
                                               opts.resume), strict=True))
    ds, plan = eng.ds_config(cfg, "finetune", info.world_size, opts.deepspeed_config or cfg.engine.deepspeed_config)
    cli.check_out(run_dir)  # every rank writes its checkpoint shards there

    if pretrained is not None:
        if eng.is_main() and not (run_dir / "tokenizer").exists():
            Tokenizer.load(pretrained.tokenizer_dir).save(run_dir / "tokenizer")
        eng.barrier()
    tok = loop.run_tokenizer(cfg, run_dir, opts.tokenizer)
    train = load_split(cfg, cfg.data.train, tok, cfg.data.max_train_examples)
    extra = {name: load_split(cfg, name, tok, 0) for name in cfg.data.extra_test}
    # The per-epoch test set is often a sample of one of the extra sets (the english preset): encode that file once.
    test = sample_split(extra[cfg.data.test], cfg.seed, cfg.data.max_test_examples) if cfg.data.test in extra \
        else load_split(cfg, cfg.data.test, tok, cfg.data.max_test_examples)
    monitor.write_run_info(run_dir, cfg, ds, {"stage": "finetune", "pretrained": str(opts.pretrained or ""),
                                              "train_examples": len(train.ids), "test_examples": len(test.ids)})
    if pretrained is not None and pretrained.meta.get("objective") == "mlm" and cfg.model.classifier_causal:
        monitor.note(f"note: {pretrained.path} was pretrained without a causal mask (mlm) but "
                     "model.classifier_causal=true; consider --set model.classifier_causal=false")

    t0 = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {}
    for name, src in runs:
        artifact_dir = run_dir / "scratch" / "artifact" if opts.compare and src is None else run_dir / "artifact"
        history = train_classifier(cfg, name, src, tok, train, test, extra, plan, ds, run_dirs[name], artifact_dir,
                                   tags[name], opts.stop_at, info)
        if history is None:
            return None  # stop_at
        results[name] = history
    if not eng.is_main():
        return None
    if opts.compare:
        write_compare(run_dir, results, cfg, pretrained)
    for name, hist in results.items():
        accs = " ".join(f"{h['test_accuracy']:.2f}" for h in hist)
        print(f"finetune {name}: test accuracy per epoch {accs}")
        for file, acc in hist[-1].get("extra_accuracy", {}).items():
            print(f"finetune {name}: accuracy on {file} {acc:.2f}")
    print(f"finetune: {time.perf_counter() - t0:.0f} s this session; classifier artifact: {run_dir / 'artifact'}")
    return run_dir / "artifact"


# ---------------------------------------------------------------------------------------------- loop


@dataclasses.dataclass
class ClassifierTask:
    """The loop's view of fine-tuning (trainer/loop.py's Task): labelled examples in, mean cross-entropy out."""

    cfg: RunConfig
    name: str  # "scratch" | "pretrained"
    train: Split
    test: Split  # scored at the end of every epoch
    extra: dict[str, Split]  # scored once, with the final weights
    plan: eng.BatchPlan
    info: eng.DistInfo
    total: int = 0  # optimizer steps of the run
    log: monitor.RunLog | None = None  # where the per-epoch lines go (set once the run's log is open)
    epoch_loss: float = 0.0  # summed loss of the epoch's log intervals (all ranks)
    epoch_n: int = 0  # examples of those intervals

    def batches(self, epoch: int) -> list[list[int]]:
        return loop.full_batches(bucket_batches(self.train.lengths, self.plan.global_batch, self.cfg.seed, epoch),
                                 self.plan)

    def inputs(self, part: list[int], epoch: int) -> tuple[torch.Tensor, ...]:
        return self.train.batch(part)

    def denominator(self, batch: list[int]) -> int:
        return len(batch)

    def seen(self, batch: list[int]) -> int:
        return len(batch)

    def report(self, engine: Any, state: ckpt.LoopState, interval: loop.Interval, evaluate: bool) -> dict[str, Any]:
        self.epoch_loss += interval.loss_sum
        self.epoch_n += interval.count
        row: dict[str, Any] = {"epoch": state.epoch, "loss": interval.loss, "lr": eng.current_lr(engine),
                               "examples_per_s": interval.examples_per_s, "elapsed_s": interval.elapsed_s}
        if evaluate:  # the end of an epoch
            acc = eval_accuracy(engine, self.test, self.info)
            row["test_accuracy"] = acc
            state.history.append({"epoch": state.epoch + 1, "step": state.step, "test_accuracy": acc,
                                  "train_loss": self.epoch_loss / max(1, self.epoch_n),
                                  "data_order_sha256": loop.order_digest(self.batches(state.epoch))})
            assert self.log is not None
            self.log.print(f"finetune {self.name}: epoch {state.epoch + 1} train loss "
                           f"{state.history[-1]['train_loss']:.4f}, test accuracy {acc:.2f}%")
            if state.step == self.total and self.extra:  # the other test sets: once, on the final weights
                state.history[-1]["extra_accuracy"] = {f: eval_accuracy(engine, sp, self.info)
                                                       for f, sp in self.extra.items()}
                self.log.print(f"finetune {self.name}: " + ", ".join(
                    f"{f} {a:.2f}%" for f, a in state.history[-1]["extra_accuracy"].items()))
            self.epoch_loss, self.epoch_n = 0.0, 0
        return row


def train_classifier(cfg: RunConfig, name: str, pretrained: artifact.Artifact | None, tok: Tokenizer, train: Split,
                     test: Split, extra: dict[str, Split], plan: eng.BatchPlan, ds: dict[str, Any], run_dir: Path,
                     artifact_dir: Path, resume_tag: str | None, stop_at: int,
                     info: eng.DistInfo) -> list[dict[str, Any]] | None:
    """Train one classifier; returns its per-epoch history (None when stopped by stop_at)."""
    fc, ckpt_dir = cfg.finetune, run_dir / "checkpoints"
    task = ClassifierTask(cfg, name, train, test, extra, plan, info)
    per_epoch, task.total = loop.steps_of(task, fc.epochs, fc.max_steps, f"{len(train.ids)} training examples",
                                          plan.global_batch)

    torch.manual_seed(cfg.seed)  # scratch and pretrained start from the same head (and scratch encoder) weights
    model = ClassifierObjective(cfg.model)
    if pretrained is not None:
        load_encoder(model, pretrained.state)
    engine = eng.initialize(model, ds, fc.optim, task.total)
    state = ckpt.LoopState()
    if resume_tag:
        state, _ = ckpt.load(engine, ckpt_dir, resume_tag)
    task.log = log = monitor.RunLog(run_dir, task.total, state.step, f"finetune {name}",
                                    ["epoch", "loss", "lr", "examples_per_s", "test_accuracy", "elapsed_s"])
    log.print(f"finetune {name}: {len(train.ids):,} train / {len(test.ids):,} test examples, {per_epoch} steps of "
              f"{plan.global_batch}/epoch, {task.total} steps, world {info.world_size}"
              + (f", resumed at step {state.step}" if resume_tag else ""))

    cadence = loop.Cadence(task.total, cfg.engine.log_every, cfg.engine.checkpoint_every, eval_epochs=True,
                           stop_at=stop_at)
    if not loop.train(engine, task, state, cadence, plan, info, cfg.seed, log, ckpt_dir, cfg.engine.keep_checkpoints,
                      {"stage": "finetune", "run": name}):
        return None
    clf = loop.final_model(engine, ckpt_dir, state, lambda: Classifier(cfg.model))
    if clf is not None:
        final = state.history[-1] if state.history else {}
        artifact.save(artifact_dir, clf, cfg, "classifier", tok, extra={
            "objective": None, "run": name, "steps": state.step, "epochs": len(state.history),
            "test_accuracy": final.get("test_accuracy"), "extra_accuracy": final.get("extra_accuracy"),
            "history": state.history,
            "pretrained_from": None if pretrained is None else {
                "path": str(pretrained.path), "weights_sha256": pretrained.meta.get("weights_sha256"),
                "objective": pretrained.meta.get("objective")},
        })
    return state.history


@torch.no_grad()
def eval_accuracy(engine: torch.nn.Module, split: Split, info: eng.DistInfo) -> float:
    """Test accuracy in percent; each rank scores a share of the batches, counts are summed over ranks."""
    engine.eval()
    correct = torch.zeros((), dtype=torch.int64, device=info.device)
    count = 0
    batches = bucket_batches(split.lengths, EVAL_BATCH, 0, 0, shuffle=False)
    for idx in batches[info.rank::info.world_size]:
        ids, pad, labels = loop.to_device(split.batch(idx), info.device)
        correct += (engine(ids, pad).argmax(dim=-1) == labels).sum()
        count += len(idx)
    engine.train()
    c, n = eng.all_reduce_sum([float(correct), count])
    return 100.0 * c / max(1.0, n)


# ---------------------------------------------------------------------------------------------- comparison


def write_compare(run_dir: Path, results: dict[str, list[dict[str, Any]]], cfg: RunConfig,
                  pretrained: artifact.Artifact | None) -> None:
    """compare.csv, compare.md and compare.png: test accuracy per epoch, scratch vs pretrained."""
    s, p = results["scratch"], results["pretrained"]
    rows = [(a["epoch"], a["test_accuracy"], b["test_accuracy"]) for a, b in zip(s, p, strict=True)]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["epoch", "scratch_accuracy", "pretrained_accuracy", "difference"])
    w.writerows([e, f"{a:.2f}", f"{b:.2f}", f"{b - a:+.2f}"] for e, a, b in rows)
    write_text_atomic(run_dir / "compare.csv", buf.getvalue())
    objective = pretrained.meta.get("objective") if pretrained else None
    md = [f"Test accuracy (%) per epoch on `{cfg.data.test}`, preset `{cfg.preset}`, seed {cfg.seed}; "
          f"pretrained encoder: `{pretrained.path if pretrained else ''}` (objective {objective}).", "",
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
