"""Fine-tune a sentiment classifier with DeepSpeed: from a pretrained LM artifact's encoder (loaded by key, new head)
or from scratch.

Every epoch scores the validation set, which picks the epoch whose weights the artifact keeps (finetune.select_metric;
finetune.patience stops early), and the test set: a per-epoch test curve, never used to choose. The kept weights are
then scored on the whole test set and on every data.extra_test file: those are the numbers reported (the log,
metrics.json, artifact.json, compare.md). Validation and test are the user's files, or shares of the training file
split off (data.valid_split, data.test_split). trainer/data/labelled.py reads and splits; trainer/metrics.py scores.

Beside every result, a TF-IDF + logistic regression baseline fitted on the same training split, its C chosen on the
same validation split (trainer/baseline.py, finetune.tfidf_baseline), scored on the same sets, with a one-line
verdict per run (the log, metrics.json, compare.*).

`--compare` trains both with the same seed, the same initial head and the same data order (the lab's question 4)
and writes compare.csv, compare.md and compare.png into the run folder (trainer/tasks/report.py); with `--seeds N`,
N seeds of both, their means and spreads and a paired test of the gain (trainer/tasks/seeds.py).
A pretrained run may first continue the LM on the training texts (finetune.task_lm: trainer/tasks/task_lm.py), and
train its layers at decayed rates or unfreeze them one by one (trainer/tasks/lr_groups.py).
With `--pretrained`, the encoder's architecture and the tokenizer come from the artifact (the scratch run of a
comparison uses them too, so only the initial weights differ).

Run folder: RUN/artifact is the classifier to export (the pretrained one when --pretrained is given).
Without --compare: RUN/{metrics.json, metrics.csv, tb/, checkpoints/, best.safetensors}. With --compare: RUN/scratch/
and RUN/pretrained/ each hold those, and the scratch classifier is RUN/scratch/artifact. With --seeds N > 1:
RUN/seed<S>/{scratch,pretrained}/ (each with its artifact/), and RUN/artifact is the pretrained classifier of the seed
with the best validation score.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainer import artifact, baseline, calibration, cli
from trainer.artifact import ArtifactError
from trainer.config import presets
from trainer.config import schema as config_mod
from trainer.config.choice import RESUME_AUTO, Choice, add_config_args, config_choice
from trainer.config.schema import ConfigError, ModelConfig, RunConfig
from trainer.data import labelled
from trainer.data.labelled import Split, encode, load_split, sample_split  # noqa: F401 (load_split: tests, bench)
from trainer.data.tokenizer import Tokenizer
from trainer.engine import checkpoint as ckpt
from trainer.engine import deepspeed_engine as eng
from trainer.engine import loop, monitor, trackers
from trainer.engine.stage import on_every_rank
from trainer.metrics import balanced_weights, summarize, summary_line, warning
from trainer.model.encoder import Classifier, load_encoder
from trainer.tasks import lr_groups, provenance, report, seeds, task_lm
from trainer.tasks.classifier_task import KEPT, ClassifierTask, Sets, confusion, kept_step, logits_of
from trainer.tasks.tokenizer_folder import run_tokenizer

EXAMPLES = """examples:
  python -m trainer finetune --preset demo --pretrained runs/demo/pretrain/artifact --compare --out runs/demo/finetune
  python -m trainer finetune --preset tiny --set data.train=reviews.jsonl --set data.text_field=review \\
      --set data.label_field=sentiment --out runs/mine          # labels, valid and test come from reviews.jsonl
  python -m trainer finetune --out runs/mine --resume           # after Ctrl-C: the run's own config and options
  deepspeed --num_gpus 2 --bind_cores_to_rank launch/finetune.sh --preset tiny --out runs/tiny-cls
"""

RELIABILITY = "reliability.png"  # in each run folder: the kept weights' reliability diagram on the test set
MAX_SEEDS = 20  # --seeds: more is a sweep, not a comparison
ARCH = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions", "pad_id")  # from the artifact


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, default_preset="demo", resumable=True)
    cli.add_run_arguments(parser, tokenizer_help="without --pretrained: use this tokenizer folder")
    parser.add_argument("--pretrained", metavar="ARTIFACT",
                        help="pretraining artifact (task lm) whose encoder and tokenizer to use (with --resume: "
                             "the run's own, by default)")
    parser.add_argument("--compare", action="store_true",
                        help="train from scratch and from --pretrained (same seed, data order); write compare.*")
    parser.add_argument("--seeds", type=int, default=None, metavar="N",
                        help="with --compare: N seeds per arm (seed, seed+1, ...: head initialisation, data order, "
                             "dropout; the same splits and pretrained encoder), reported per seed, as mean and spread, "
                             "with a paired test of the gain (default 1; with --resume: the run's own)")


def main(args: argparse.Namespace) -> int:
    def stage() -> None:
        pretrained, compare, seeds = args.pretrained, args.compare, args.seeds
        if args.resume and pretrained is None:  # --resume alone: the run's own --pretrained, --compare, --seeds
            pretrained, compare, seeds = previous_options(Path(args.out), compare, seeds)
        opts = cli.run_options(args, FinetuneOptions, pretrained=Path(pretrained) if pretrained else None,
                               compare=compare, seeds=seeds or 1)
        opts = dataclasses.replace(opts, command=provenance.command_line(
            args, opts.out, opts.pretrained, opts.compare, opts.seeds))
        run(resolve_config(config_choice(args), opts.pretrained), opts)

    on_every_rank(stage)


def previous_options(run_dir: Path, compare: bool, seeds: int | None) -> tuple[str | None, bool, int | None]:
    """--pretrained, --compare and --seeds of the run being resumed, from its env.json."""
    try:
        info = json.loads((run_dir / "env.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, compare, seeds
    return info.get("pretrained") or None, compare or bool(info.get("compare")), seeds or info.get("seeds")


class ClassifierObjective(Classifier):
    """The classifier with its loss inside forward (DeepSpeed's engine runs both); same parameter names."""

    def __init__(self, cfg: ModelConfig, class_weight: torch.Tensor | None = None) -> None:
        super().__init__(cfg)
        # (C,) loss weight per class; not persistent: the artifact's weights stay those of a Classifier
        self.register_buffer("class_weight", class_weight, persistent=False)

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor,  # type: ignore[override]
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T), (B, T) [, (B,) labels] -> (B, C) logits, or the summed cross-entropy when labels are given."""
        logits = super().forward(input_ids, padding_mask)
        if labels is None:
            return logits
        weight = None if self.class_weight is None else self.class_weight.float()
        return F.cross_entropy(logits.float(), labels, weight=weight, reduction="sum")


def pretrained_fields(pre_cfg: RunConfig) -> dict[str, Any]:
    """The keys a pretrained artifact decides: the encoder's architecture and the whole tokenizer section."""
    return {**{f"model.{k}": getattr(pre_cfg.model, k) for k in ARCH},
            **{f"tokenizer.{k}": v for k, v in dataclasses.asdict(pre_cfg.tokenizer).items()}}


def resolve_config(choice: Choice, pretrained: Path | None) -> RunConfig:
    """The run's config: with --pretrained, the artifact's encoder architecture and tokenizer (a --set or --config
    key that would change them is an error); finetune.dropout, when set, replaces model.dropout; data.labels, when
    empty, are the training file's label values."""
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
    return labelled.settle_labels(cfg, "model.num_classes" in choice.settings())


# ---------------------------------------------------------------------------------------------- entry


@dataclasses.dataclass(frozen=True)
class FinetuneOptions(loop.RunOptions):
    """RunOptions plus what fine-tuning starts from."""

    pretrained: Path | None = None  # a pretraining artifact (task lm) whose encoder and tokenizer to use
    compare: bool = False  # train from scratch and from `pretrained` (same seed and data order); write compare.*
    seeds: int = 1  # with compare: training seeds per arm, cfg.seed, cfg.seed + 1, ...
    command: str = ""  # the command line that runs it again (artifact.json, the model card)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compare and self.pretrained is None:
            raise ConfigError("--compare needs --pretrained ARTIFACT (the encoder to compare with scratch)")
        if not 1 <= self.seeds <= MAX_SEEDS:
            raise ConfigError(f"--seeds {self.seeds}: must be between 1 and {MAX_SEEDS}")
        if self.seeds > 1 and not self.compare:
            raise ConfigError(f"--seeds {self.seeds} goes with --compare (the seeds' gains are what it measures)")

    def folder(self, seed: int, name: str) -> Path:
        """A run's folder: RUN (one run), RUN/NAME (--compare), RUN/seedS/NAME (--compare --seeds N > 1)."""
        base = self.out / f"seed{seed}" if self.seeds > 1 else self.out
        return base / name if self.compare else base


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
    arms = [("scratch", None), ("pretrained", pretrained)] if opts.compare \
        else [("pretrained" if pretrained else "scratch", pretrained)]
    runs = [(seed, name, src) for seed in range(cfg.seed, cfg.seed + opts.seeds) for name, src in arms]
    run_dirs = {(seed, name): opts.folder(seed, name) for seed, name, _ in runs}
    tags = dict(zip(run_dirs, loop.resume_tags(run_dir, cfg, [d / "checkpoints" for d in run_dirs.values()],
                                               opts.resume), strict=True))
    ds, plan = eng.ds_config(cfg, "finetune", info.world_size, opts.deepspeed_config or cfg.engine.deepspeed_config)
    cli.check_out(run_dir)  # every rank writes its checkpoint shards there
    problem = eng.agree(eng.hold_run(run_dir) if eng.is_main() else "")  # one run at a time in a folder
    if problem:
        raise ConfigError(problem)
    data = labelled.load(cfg)

    if pretrained is not None:
        if eng.is_main() and not (run_dir / "tokenizer").exists():
            pretrained.tokenizer().save(run_dir / "tokenizer")
        eng.barrier()
    tok = run_tokenizer(cfg, run_dir, opts.tokenizer, labelled.texts(data.train.originals))
    encoded: dict[str, Split] = {}  # by file: a test file also among extra_test is encoded once
    test = encode(data.test.examples, tok)
    encoded[data.test.source] = test
    sets = Sets(encode(data.train.examples, tok), encode(data.valid.examples, tok), test,
                sample_split(test, cfg.seed, cfg.data.max_test_examples),
                {name: encoded.get(p.source) or encode(p.examples, tok) for name, p in data.extra.items()})
    files = [cfg.data.path(f) for f in (cfg.data.train, cfg.data.valid, cfg.data.test, *cfg.data.extra_test) if f]
    facts = trackers.run_facts(list(dict.fromkeys(files))) if eng.is_main() else {}
    monitor.write_run_info(run_dir, cfg, ds, {
        "stage": "finetune", "pretrained": str(opts.pretrained or ""), "compare": opts.compare, "seeds": opts.seeds,
        "command": opts.command,
        "train_examples": len(sets.train.ids), "valid_examples": len(sets.valid.ids),
        "test_examples": len(sets.test.ids), **facts})
    for line in data.summary(cfg):
        monitor.note(line)
    monitor.note(f"data: {labelled.cut_share(sets.train, tok.max_len):.1f}% of the training examples reach "
                 f"tokenizer.max_len={tok.max_len} ids (longer ones are cut)")
    tfidf = None
    if eng.is_main():  # the bar to beat, in the log before training starts
        tfidf = baseline.on_splits(cfg, data.train.originals, data.valid.examples,
                                   {"test": data.test.examples, **{f: p.examples for f, p in data.extra.items()}})
        monitor.note(baseline.summary_line(tfidf))
    if pretrained is not None and pretrained.meta.get("objective") == "mlm" and cfg.model.classifier_causal:
        monitor.note(f"note: {pretrained.path} was pretrained without a causal mask (mlm) but "
                     "model.classifier_causal=true; consider --set model.classifier_causal=false")

    about = {"command": opts.command, "data_files": provenance.data_files(cfg, data) if eng.is_main() else {},
             "truncated_train_share": labelled.cut_share(sets.train, tok.max_len)}
    t0 = time.perf_counter()
    results: dict[int, dict[str, dict[str, Any]]] = {}
    for seed, name, src in runs:
        where = run_dirs[(seed, name)]
        artifact_dir = where / "artifact" if opts.seeds > 1 or (opts.compare and src is None) \
            else run_dir / "artifact"
        result = train_classifier(cfg, name, src, tok, sets, plan, ds, where, artifact_dir, tags[(seed, name)],
                                  opts, info, tfidf, seed, about, facts)
        if result is None:
            return None  # stop_at
        results.setdefault(seed, {})[name] = result
    if not eng.is_main():
        return None
    exported = opts.folder(seeds.exported(results, cfg) if opts.seeds > 1 else cfg.seed, "pretrained")
    if opts.compare:  # the exported classifier's reliability diagram beside compare.png
        shutil.copyfile(exported / RELIABILITY, run_dir / RELIABILITY)
    if opts.seeds > 1:
        summary = seeds.finish(run_dir, results, cfg, pretrained, tfidf, exported)
        for arm in seeds.ARMS:
            m, f1 = summary["test_accuracy_stats"][arm], summary["test_macro_f1_stats"][arm]
            print(f"finetune {arm}: test accuracy over {opts.seeds} seeds: mean {m['mean']:.2f}%, sd {m['sd']:.2f} "
                  f"(macro-F1 mean {f1['mean']:.2f}%, sd {f1['sd']:.2f})")
        print(f"finetune: {seeds.verdict(summary['paired'])}")
        print(f"finetune: {time.perf_counter() - t0:.0f} s this session; classifier artifact: {run_dir / 'artifact'} "
              f"(seed {summary['exported_seed']}, best validation {cfg.finetune.select_metric})")
        return run_dir / "artifact"
    if opts.compare:
        report.write_compare(run_dir, results[cfg.seed], cfg, pretrained, tfidf)
    for name, r in results[cfg.seed].items():
        print(f"finetune {name}: kept epoch {r['kept']['epoch']} of {len(r['history'])} (best validation "
              f"{cfg.finetune.select_metric}); test {summary_line(r['final']['test'])}")
        for file, m in r["final"]["extra"].items():
            print(f"finetune {name}: {file}: {summary_line(m)}")
        for line in report.verdicts(f"finetune {name}", r["final"], tfidf):
            print(line)
    print(f"finetune: {time.perf_counter() - t0:.0f} s this session; classifier artifact: {run_dir / 'artifact'}")
    return run_dir / "artifact"


# ---------------------------------------------------------------------------------------------- loop


def train_classifier(cfg: RunConfig, name: str, pretrained: artifact.Artifact | None, tok: Tokenizer, sets: Sets,
                     plan: eng.BatchPlan, ds: dict[str, Any], run_dir: Path, artifact_dir: Path,
                     resume_tag: str | None, opts: FinetuneOptions, info: eng.DistInfo,
                     tfidf: dict[str, Any] | None = None, seed: int | None = None,
                     about: dict[str, Any] | None = None,
                     facts: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Train one classifier, keep the epoch its validation score picks, score those weights; returns {history,
    kept, final} (None when stopped by opts.stop_at). `tfidf`: the baseline's scores (rank 0), reported beside.
    `seed` (default cfg.seed) sets the initial weights, the data order, dropout and the task-text stage; the splits
    are the caller's (`sets`, made with cfg.seed). `about`: more for artifact.json (the command, the data's files).
    `facts`: the run's commit and data digests, given to its trackers (trainer/engine/trackers.py) with its config."""
    fc, ckpt_dir = cfg.finetune, run_dir / "checkpoints"
    seed = cfg.seed if seed is None else seed
    task = ClassifierTask(cfg, name, sets, plan, info, run_dir / KEPT, seed)
    per_epoch, task.total = loop.steps_of(task, fc.epochs, fc.max_steps, f"{len(sets.train.ids)} training examples",
                                          plan.global_batch)
    names = cfg.data.names
    weight = torch.from_numpy(balanced_weights(sets.train.labels, len(names))) \
        if fc.class_weights == "balanced" else None

    encoder = None
    if pretrained is not None:
        encoder = pretrained.state
        if fc.task_lm.epochs and not resume_tag:  # resumed: the classifier's checkpoint holds the adapted encoder
            encoder = task_lm.adapt(dataclasses.replace(cfg, seed=seed), pretrained, sets.train, tok, run_dir, info,
                                    opts.deepspeed_config or cfg.engine.deepspeed_config)
    torch.manual_seed(seed)  # scratch and pretrained start from the same head (and scratch encoder) weights
    model = ClassifierObjective(cfg.model, weight)
    if encoder is not None:
        load_encoder(model, encoder)
    groups = lr_groups.lr_groups(model, fc, per_epoch, pretrained is not None)
    ds = trackers.with_monitor(ds, cfg.monitor, run_dir)  # its own trackers' folder (--compare: one per run)
    trackers.prepare(ds, run_dir)
    engine = eng.initialize(model, ds, fc.optim, task.total, cfg.engine, groups)
    trackers.log_run(engine, {"config": cfg.to_dict(), **(facts or {})})
    state, t0 = ckpt.LoopState(), time.perf_counter()
    if resume_tag:
        state, _ = ckpt.load(engine, ckpt_dir, resume_tag)
        best_step = state.history[task.best(state)]["step"] if state.history else None
        if best_step == state.step and kept_step(task.kept_path) != state.step:  # killed between the two
            task.store_best(engine, ckpt_dir, resume_tag, state)
    start_step = state.step
    task.log = log = monitor.RunLog(run_dir, task.total, state.step, f"finetune {name}",
                                    ["epoch", "loss", "lr", "examples_per_s", "valid_accuracy", "valid_macro_f1",
                                     "test_accuracy", "elapsed_s"], engine)
    weights_note = f", class weights {np.round(weight.numpy(), 3).tolist()}" if weight is not None else ""
    log.print(f"finetune {name}: {len(sets.train.ids):,} train / {len(sets.valid.ids):,} valid / "
              f"{len(sets.test_epoch.ids):,} test examples per epoch, {per_epoch} steps of {plan.global_batch}/epoch, "
              f"{task.total} steps, world {info.world_size}; keeps the epoch of best validation {fc.select_metric}"
              + (f", patience {fc.patience}" if fc.patience else "") + weights_note + f", seed {seed}"
              + (f", resumed at step {state.step}" if resume_tag else ""))
    if groups is not None:
        log.print(f"finetune {name}: learning rates, top down (finetune.layer_lr_decay={fc.layer_lr_decay:g}, "
                  f"finetune.unfreeze_epochs={fc.unfreeze_epochs:g}): {lr_groups.describe(groups, fc.optim.lr)}")
    elif pretrained is None and (fc.layer_lr_decay != 1.0 or fc.unfreeze_epochs or fc.task_lm.epochs):
        log.print(f"finetune {name}: finetune.layer_lr_decay, unfreeze_epochs and task_lm act on a pretrained "
                  f"encoder; from scratch every layer trains at lr {fc.optim.lr:g} from the first step")

    cadence = loop.Cadence(task.total, monitor.log_interval(cfg.engine.log_every, task.total),
                           cfg.engine.checkpoint_every, eval_epochs=True, stop_at=opts.stop_at)
    run = loop.LoopRun(engine, cadence, plan, info, seed, log, ckpt_dir, cfg.engine.keep_checkpoints,
                       {"stage": "finetune", "run": name}, auto_resume=opts.resume == RESUME_AUTO)
    if not loop.train(run, task, state):
        return None

    # The kept weights, exactly as the artifact will hold them (fp32), scored on every set on every rank's share;
    # their validation logits fit the temperature (trainer/calibration.py), which the test set then measures.
    clf = Classifier(cfg.model)
    clf.load_state_dict(task.kept_weights(state), strict=True)
    clf.to(info.device)
    raw, final = final_scores(clf, sets, info, names)
    cal = calibration.report(raw, calibration.fit_temperature(*raw["valid"]),
                             f"the validation split ({len(sets.valid.ids)} examples)")
    kept = state.history[task.best(state)]
    result = {"history": state.history, "kept": kept, "final": final, "calibration": cal}
    if eng.is_main():
        for where, m in [("the test set", final["test"]), *final["extra"].items()]:
            if (text := warning(m, where)) is not None:
                log.print(f"finetune {name}: {text}")
        log.print(f"finetune {name}: calibration: {calibration.summary_line(cal)}")
        calibration.plot(run_dir / RELIABILITY, *raw["test"], cal["temperature"],
                         f"{name}, test set, kept weights (epoch {kept['epoch']})")
        summary = report.run_metrics(cfg, name, result, tfidf)
        report.write_metrics(run_dir, summary)
        artifact.save(artifact_dir, clf.cpu(), cfg, "classifier", tok, extra={
            "objective": None, "run": name, "seed": seed, "steps": state.step, "epochs": len(state.history),
            "kept_epoch": kept["epoch"], "kept_step": kept["step"], "selected_on": summary["selected_on"],
            "test_accuracy": final["test"]["accuracy"], "test_macro_f1": final["test"]["macro_f1"],
            "valid_accuracy": final["valid"]["accuracy"],
            "extra_accuracy": {f: m["accuracy"] for f, m in final["extra"].items()},
            "metrics": final, "history": state.history, "tfidf_baseline": summary["tfidf_baseline"],
            "calibration": cal,
            "compute": provenance.compute(info.device, info.world_size, info.local_size, time.perf_counter() - t0,
                                          state.step - start_step),
            **(about or {}),
            "pretrained_from": None if pretrained is None else {
                "path": str(pretrained.path), "weights_sha256": pretrained.meta.get("weights_sha256"),
                "objective": pretrained.meta.get("objective"), "preset": pretrained.cfg.preset,
                "overrides": presets.overrides(pretrained.cfg), "steps": pretrained.meta.get("steps"),
                "tokens": pretrained.meta.get("tokens"), "eval_loss": pretrained.meta.get("eval_loss"),
                "corpus": pretrained.meta.get("corpus"), "compute": pretrained.meta.get("compute"),
                "task_lm": str(run_dir / task_lm.FOLDER / "artifact") if fc.task_lm.epochs else None},
        })
    eng.barrier()
    return result


def final_scores(clf: Classifier, sets: Sets, info: eng.DistInfo,
                 names: list[str]) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, Any]]:
    """The kept weights' (N, C) logits and labels of valid and test, and the metrics of those and of every extra
    set. An extra set that is the test file, encoded once (the `english` preset names all of IMDB test among its
    extra sets), takes the test set's scores: 25,000 reviews scored once, not twice."""
    raw = {"valid": logits_of(clf, sets.valid, info), "test": logits_of(clf, sets.test, info)}
    final: dict[str, Any] = {k: summarize(confusion(*raw[k], len(names)), names) for k in ("valid", "test")}
    final["extra"] = {f: copy.deepcopy(final["test"]) if sp is sets.test
                      else summarize(confusion(*logits_of(clf, sp, info), len(names)), names)
                      for f, sp in sets.extra.items()}
    return raw, final
