"""Typed configuration: one dataclass per component, explicit overrides (presets: trainer/config/presets.py).

A run is described by a `RunConfig`; `--set section.field=value` overrides a field by name, and the resolved config
is written as `config.json` into every run folder and artifact. Every stage reads a config that passed every rule
below: ranges are declared next to their field, rules between fields of a section in its `__post_init__`, rules
across sections in RunConfig's. A bad value or an unknown key is a ConfigError: one line naming the key, the value
and what is allowed (trainer/config/fields.py). Each field's comment is its description (`python -m trainer config`
prints them: trainer/config/cli.py), so every field has one.

Why pydantic (its dataclasses; installed with DeepSpeed, which validates its own JSON with it): it coerces the
strings of `--set` and the values of a JSON file to the declared types (int, float, bool, Literal, nested
sections), refuses unknown keys, and checks ranges declared on the field (`Field(gt=0, allow_inf_nan=False)`).
What stays ours: `--set` parsing (comma lists, "none") and the one-line errors.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from contract.tokens import N_SPECIALS, check_max_len
from trainer.config.fields import (
    ConfigError,
    Count,
    NonNegative,
    Positive,
    Probability,
    Size,
    StrList,
    comma_list,
    keys_of,
    none_word,
    section,
    unknown_key,
)


@section("model")
class ModelConfig:
    """The lab's encoder and its two heads (README.md: 21,018,401 and 10,968,602 parameters at its size)."""

    vocab_size: Size = 50_001  # token ids, specials included (<sos>=0 <pad>=1 <eos>=2 <oov>=3)
    d_model: Size = 200  # embedding and hidden width ("nhid")
    n_layers: Size = 4  # nn.TransformerEncoderLayer count
    n_heads: Size = 2  # attention heads; must divide d_model
    d_ff: Size = 200  # feed-forward width (the lab uses nhid)
    dropout: Probability = 0.0  # on positions and inside every layer
    max_positions: Size = 5000  # rows of the fixed sinusoidal table: the longest sequence the model accepts
    num_classes: Annotated[int, Field(ge=2)] = 2  # classification head width (= len(data.labels))
    classifier_causal: bool = True  # keep the causal mask when classifying (the lab's choice)
    pooling: Literal["last", "mean"] = "last"  # classifier input: last real token (<eos>) or mean of real tokens
    pad_id: Count = 1  # id of <pad>: never attended to

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}")
        if self.pad_id >= self.vocab_size:
            raise ConfigError(f"model.pad_id={self.pad_id} is outside the vocabulary (size {self.vocab_size})")


@section("tokenizer")
class TokenizerConfig:
    """Sentencepiece pieces mapped to ids: the lab's model + dict.txt, or a model trained on the user's corpus."""

    kind: Literal["lab", "train"] = "lab"  # lab: load `model` + `vocab`; train: learn a model on the pretraining text
    model: str = "cls-books-fr/sentencepiece.french.model"  # kind=lab: sentencepiece model (relative to data.root)
    vocab: str = "cls-books-fr/dict.txt"  # kind=lab: fairseq "piece count" lines; piece on line i gets id i + 4
    vocab_size: Annotated[int, Field(ge=8)] = 8000  # kind=train: pieces learned (ids add the 4 specials)
    train_lines: Size = 200_000  # kind=train: at most this many corpus lines are sampled for learning
    # kind=train: fold case in the model's own normalizer (sentencepiece's nmt_nfkc_cf rule), so "Ennuyeux" and
    # "ennuyeux" get the same pieces; spm.model carries the rule, so the server folds what it is sent alike
    case_fold: bool = False
    # A sequence is <sos> + pieces + <eos>, cut to this many ids (>= 3: <sos>, one piece, <eos>). Kept in the
    # artifact's config.json; export copies it to the bundle's manifest.json (max_len), or `export --max-len`'s
    max_len: Annotated[int, AfterValidator(lambda n: check_max_len(n, "tokenizer.max_len", ConfigError))] = 512

    def __post_init__(self) -> None:
        if self.case_fold and self.kind != "train":  # the lab's model has cased pieces: folded text would miss them
            raise ConfigError("tokenizer.case_fold needs tokenizer.kind=train (the lab's model keeps case)")


@section("data")
class DataConfig:
    """The data files of a run; any file may be gzipped. Relative paths start at `root`."""

    root: str = ""  # folder relative data paths start from ("": the working directory); presets: $TS_DATA
    # Unlabelled text: pretraining, and the tokenizer (else the training texts): .txt, .jsonl, .tsv, .csv,
    # .parquet, .spm; globs too (part-*.txt.gz: matches sorted)
    pretrain: StrList = field(default_factory=list)
    pretrain_eval_lines: Count = 500  # last documents of data.pretrain held out for the eval loss (at most 10%)
    # A folder written by `python -m trainer prepare` (absolute, or relative to the working directory like --out):
    # pretraining reads it instead of tokenizing data.pretrain. Empty: the run prepares RUN/prepared itself.
    prepared: str = ""
    # How each node checks its copy of the prepared folder at start: sha256 of every file (a share per local rank),
    # or size only (instant; for copies already checked).
    verify: Literal["sha256", "size"] = "sha256"
    train: str = ""  # labelled training file: .jsonl, .tsv, .csv, .parquet, or .txt/.spm with a sibling .label file
    valid: str = ""  # labelled file that picks the epoch kept ("": data.valid_split of data.train)
    test: str = ""  # labelled file scored every epoch and with the kept weights ("": data.test_split of data.train)
    valid_split: Probability = 0.1  # share of data.train held out (stratified) when data.valid is "" (0: refuse)
    test_split: Probability = 0.1  # share of data.train held out (stratified) when data.test is "" (0: refuse)
    extra_test: StrList = field(default_factory=list)  # more labelled files, scored once with the kept weights
    labels: StrList = field(default_factory=list)  # label values in head order ([]: those of data.train, sorted)
    # Served name of each of data.labels, in its order, or value:name pairs (pos:positive,neg:negative); []: the values
    label_names: StrList = field(default_factory=list)
    text_field: str = "text"  # .jsonl key / .tsv, .csv or .parquet column of the text
    label_field: str = "label"  # .jsonl key / .tsv, .csv or .parquet column of the label
    max_train_examples: Count = 0  # 0 = all; else N training examples, seeded sample (quick runs)
    # Short examples added to the training split only (after max_train_examples): each training text's first and/or
    # last sentence of 3-25 words, with its text's label (trainer/data/crops.py); []: none. The TF-IDF baseline fits
    # the texts alone. The demo's long reviews alone leave one-line reviews misread: docs/RESULTS.md, Behaviour.
    crops: StrList = field(default_factory=list)
    max_valid_examples: Count = 0  # 0 = all; else a seeded sample of N validation examples
    max_test_examples: Count = 0  # 0 = all; else a seeded sample of N test examples per epoch (all once at the end)
    language: str = ""  # the texts' language as a BCP 47 tag (fr, en): the model card states it ("": not stated)
    domain: str = ""  # what the texts are (book reviews, tweets): the model card states it ("": not stated)

    def __post_init__(self) -> None:
        if self.labels and (len(self.labels) < 2 or len(set(self.labels)) != len(self.labels)):
            raise ConfigError(f"data.labels must list at least 2 distinct classes, got {self.labels}")
        if not set(self.crops) <= {"first", "last"} or len(set(self.crops)) != len(self.crops):
            raise ConfigError(f"data.crops takes first, last or both, each once (none: data.crops=), "
                              f"got {self.crops}")
        names = self.label_names
        if names and all(":" in n for n in names) and self.labels:  # value:name pairs, in any order
            pairs = dict(n.split(":", 1) for n in names)
            if len(pairs) != len(names) or set(pairs) != set(self.labels):
                raise ConfigError(f"data.label_names pairs {names} must name each of data.labels {self.labels} "
                                  "once (value:name)")
            self.label_names = names = [pairs[v] for v in self.labels]
        if names and all(":" not in n for n in names) and self.labels and len(names) != len(self.labels):
            raise ConfigError(f"data.label_names has {len(names)} names for {len(self.labels)} labels "
                              f"{self.labels}; or pair them: data.label_names=VALUE:NAME,...")
        if names and (len(set(names)) != len(names) or not all(n.strip() for n in names)):
            raise ConfigError(f"data.label_names must be distinct and non-empty, got {names}")

    @property
    def names(self) -> list[str]:
        """What the server answers for each of `labels`: label_names, else the values themselves."""
        return list(self.label_names or self.labels)

    def path(self, name: str) -> Path:
        p = Path(name).expanduser()
        if p.is_absolute():
            return p
        if self.root and not Path(self.root).is_dir():
            raise ConfigError(f"data.root {self.root}: folder not found (it holds {name}); the presets read their "
                              "data sets from $TS_DATA, else the user's cache: fetch them with `python -m trainer "
                              "data fetch --preset NAME`, or set TS_DATA or --set data.root=FOLDER")
        return Path(self.root) / p


@section("optim")
class OptimConfig:
    """Optimizer and schedule for one training stage."""

    name: Literal["adam", "adamw"] = "adam"  # adamw: weight decay decoupled from the gradient
    lr: Positive = 3e-4  # peak learning rate
    weight_decay: NonNegative = 0.0  # L2 penalty (adam) or decoupled decay (adamw)
    betas: Annotated[list[Probability], BeforeValidator(comma_list), Field(min_length=2, max_length=2)] = field(
        default_factory=lambda: [0.9, 0.999])  # Adam's moment decays
    grad_clip: Positive = 0.5  # max global gradient norm (the lab's 0.5); a large value effectively turns it off
    warmup_steps: Count = 0  # linear warm-up from lr / warmup_steps
    schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warmup; decay ends at lr * 0.1


@section("engine")
class EngineConfig:
    """How DeepSpeed runs the model (trainer/engine/ds_config.py derives its JSON from this)."""

    # ZeRO 0-3: 1 partitions the optimizer state over the ranks, 2 the gradients too, 3 the weights too (each rank
    # then holds a share of every weight and gathers a layer's whole for its forward and backward)
    zero_stage: Annotated[int, Field(ge=0, le=3)] = 0
    # Number format: fp32; bf16 (torch.autocast over fp32 weights: bf16 matrix multiplies, fp32 weights, gradients
    # and optimizer); auto: bf16 where the device has native bf16 units (trainer/engine/precision.py), fp32 elsewhere
    precision: Literal["fp32", "bf16", "auto"] = "fp32"
    grad_accum: Size = 1  # micro-batches per optimizer step
    deepspeed_config: str = ""  # a user's DeepSpeed JSON whose keys override the derived ones
    checkpoint_every: Count = 0  # steps between resumable checkpoints (0 = only at the end)
    keep_checkpoints: Size = 2  # older engine checkpoints are deleted; 0 would delete the one --resume needs
    # Steps between log rows (metrics.csv, TensorBoard, a line when stderr is no terminal; each is the loop's one
    # host-device sync); 0: about 50 rows per run, a round number (trainer/engine/monitor.py, log_interval)
    log_every: Count = 0
    # torch.compile of the model inside the engine (DeepSpeed's engine.compile(): inductor, in place, the same
    # parameter names): on, off, or auto: on with CUDA, off on a CPU (it pays there on long LM runs only:
    # docs/BENCHMARKS.md)
    compile: Literal["off", "on", "auto"] = "auto"
    # Deterministic kernels (torch.use_deterministic_algorithms, cuDNN's deterministic mode, a fixed cuBLAS
    # workspace): two runs of one config, or a resumed run and an uninterrupted one, then agree bit for bit on a GPU,
    # and with engine.compile on a CPU too (eager CPU runs do without it); slower
    deterministic: bool = False


@section("monitor")
class MonitorConfig:
    """Where a run's metrics go besides metrics.csv: the trackers of DeepSpeed's monitor, which trainer/engine turns
    on through its DeepSpeed JSON (sections tensorboard, csv_monitor, wandb; a user's JSON may add comet)."""

    tensorboard: bool = True  # TensorBoard event files in RUN/tb/
    csv: bool = False  # DeepSpeed's CSV monitor: one CSV file per series in RUN/csv/
    # Weights & Biases (pip's `trackers` extra); WANDB_MODE=offline keeps the run in RUN/wandb/ for `wandb sync`
    wandb: bool = False
    wandb_project: str = "transfer-sentiment"  # W&B project
    wandb_team: str = ""  # W&B entity, a team or a user ("" = the account's default)
    wandb_group: str = ""  # W&B group, e.g. one per experiment ("" = none)


@section("pretrain")
class PretrainConfig:
    """Language-model pretraining."""

    objective: Literal["clm", "mlm"] = "clm"  # clm: next token (the lab); mlm: BERT-style masking, no causal mask
    mask_prob: Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)] = 0.15  # mlm: share of real tokens predicted
    micro_batch: Size = 16  # sequences per rank per micro-step
    seq_len: Annotated[int, Field(ge=2)] = 128  # pretraining window in ids
    epochs: Size = 2  # passes over the pretraining windows
    max_steps: Count = 0  # 0 = run the epochs; else stop after this many optimizer steps
    eval_every: Count = 0  # steps between eval-loss passes (0 = at the end only)
    optim: OptimConfig = field(default_factory=OptimConfig)


@section("task_lm")
class TaskLMConfig:
    """A language-model stage on the training split's texts before the head is fitted (ULMFiT's second stage; TAPT in
    "Don't Stop Pretraining"): the pretrained LM continues with its own objective on the labelled training texts,
    packed into windows; validation and test texts are never read. Runs from a pretrained encoder only."""

    epochs: Count = 0  # passes over the training texts' windows (0: no stage)
    micro_batch: Count = 0  # windows per rank per micro-step (0: pretrain.micro_batch)
    seq_len: Annotated[int, Field(ge=0)] = 0  # window length in ids, 0 or >= 2 (0: pretrain.seq_len)

    def __post_init__(self) -> None:
        if self.seq_len == 1:
            raise ConfigError("finetune.task_lm.seq_len must be 0 (pretrain.seq_len) or >= 2, got 1")
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-4))


@section("finetune")
class FinetuneConfig:
    """Classification fine-tuning (a new head on the encoder)."""

    micro_batch: Size = 8  # labelled examples per rank per micro-step
    epochs: Size = 15  # passes over the training split (each ends with validation and test scores)
    max_steps: Count = 0  # 0 = run the epochs
    # Dropout while fine-tuning only (None: model.dropout). A pretrained encoder fits a small labeled set in a few
    # epochs; dropout here regularises it without changing how it was pretrained.
    dropout: Annotated[Probability | None, BeforeValidator(none_word)] = None
    select_metric: Literal["accuracy", "macro_f1"] = "accuracy"  # validation score that picks the epoch kept
    patience: Count = 0  # stop after this many epochs without a better validation score (0: run every epoch)
    class_weights: Literal["none", "balanced"] = "none"  # balanced: loss weight n / (classes x n_class) per class
    # TF-IDF + logistic regression scored on the same splits beside the model (trainer/baseline.py): word 1-2-grams
    # and character 2-5-grams, word n-grams only (far cheaper on long texts: docs/RESULTS.md), or none
    tfidf_baseline: Literal["word+char", "word", "none"] = "word+char"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    # Layer-wise learning-rate decay, pretrained encoder only: the head trains at optim.lr, the layer below it at
    # lr x decay, the next at lr x decay^2, ..., the embedding at lr x decay^(n_layers + 1); 1: one rate for all
    layer_lr_decay: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    # Gradual unfreezing, pretrained encoder only: the head trains alone, then every this many epochs the next group
    # down (top layer first, the embedding last) joins it at its rate; 0: every group trains from the first step
    unfreeze_epochs: NonNegative = 0.0
    task_lm: TaskLMConfig = field(default_factory=TaskLMConfig)


@section("")
class RunConfig:
    """Everything one run needs; `config.json` in a run folder is this, resolved."""

    preset: str = "lab"  # the preset the run started from (its data section is replaced when you name a data file)
    seed: Count = 0  # data order, initial weights, dropout and MLM masks all derive from it
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    def __post_init__(self) -> None:
        """The rules across sections, checked once here: every stage reads a config that passed them."""
        m, tc = self.model, self.tokenizer
        if tc.kind == "train":  # kind=lab: dict.txt decides, checked when the tokenizer is read (check_tokenizer)
            check_vocab(tc.vocab_size + N_SPECIALS, m,
                        f"tokenizer.vocab_size={tc.vocab_size} plus the {N_SPECIALS} specials give")
        if self.data.labels and m.num_classes != len(self.data.labels):  # []: set from the training file
            raise ConfigError(f"model.num_classes={m.num_classes} but data.labels has {len(self.data.labels)} "
                              f"classes {self.data.labels}")
        check_positions(tc.max_len, m, "tokenizer.max_len")
        check_positions(self.pretrain.seq_len, m, "pretrain.seq_len")
        if self.finetune.task_lm.seq_len:
            check_positions(self.finetune.task_lm.seq_len, m, "finetune.task_lm.seq_len")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"


# ---------------------------------------------------------------------------------------------- the rules between a
# tokenizer and the model, each written once: the config's own sections, a built or loaded tokenizer, an artifact and
# an export all call these


def check_vocab(ids: int, model: ModelConfig, what: str) -> None:
    """`ids` token ids (what gives them: `what`) must be the model's embedding rows, model.vocab_size."""
    if ids != model.vocab_size:
        raise ConfigError(f"{what} {ids} ids, but model.vocab_size={model.vocab_size}; set model.vocab_size={ids}")


def check_positions(length: int, model: ModelConfig, what: str) -> None:
    """A sequence length (`what`: tokenizer.max_len, pretrain.seq_len, an export's --max-len) fits the model's
    positional table, model.max_positions."""
    if length > model.max_positions:
        raise ConfigError(f"{what}={length} exceeds model.max_positions={model.max_positions} (the longest sequence "
                          "the model accepts)")


def check_tokenizer(vocab_size: int, cfg: RunConfig, where: str) -> None:
    """A tokenizer (read at `where`) has the ids of the run's model, model.vocab_size."""
    check_vocab(vocab_size, cfg.model, f"{where}: the tokenizer has")


# ---------------------------------------------------------------------------------------------- overrides


def valid_keys() -> list[str]:
    """Every key `--set` takes, e.g. "pretrain.optim.lr"."""
    return keys_of(RunConfig)


def override(cfg: RunConfig, assignments: list[str] | dict[str, Any]) -> RunConfig:
    """Apply `section.field=value` overrides (values are coerced to the field's type); a new, validated config."""
    data = cfg.to_dict()
    assign(data, assignments)
    return from_dict(data)


def assign(data: dict[str, Any], assignments: list[str] | dict[str, Any]) -> None:
    """Set `section.field=value` items in a config's nested dict, unvalidated (`from_dict` checks it); an unknown key
    is an error with the closest valid one."""
    items = assignments.items() if isinstance(assignments, dict) else [split_assignment(a) for a in assignments]
    valid = valid_keys()
    for key, value in items:
        if key not in valid:
            raise unknown_key(key, valid)
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            node = node[p]
        node[leaf] = value


def derive(data: dict[str, Any], given: set[str]) -> None:
    """The keys that follow from others unless the user gave them (`given`), set in a config's nested dict:
    model.vocab_size from a trained tokenizer's vocab_size (plus the specials), model.num_classes from data.labels.
    A value that does not parse is left for validation to name."""
    model, tok = data["model"], data["tokenizer"]
    if "model.vocab_size" not in given and tok.get("kind") == "train":
        try:
            model["vocab_size"] = int(tok["vocab_size"]) + N_SPECIALS
        except (TypeError, ValueError):
            pass
    labels = comma_list(data["data"].get("labels"))
    if "model.num_classes" not in given and isinstance(labels, list) and len(labels) >= 2:
        model["num_classes"] = len(labels)


def split_assignment(assignment: str) -> tuple[str, str]:
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like section.field=value")
    key, value = assignment.split("=", 1)
    return key.strip(), value.strip()


def from_dict(data: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from a (possibly partial) mapping; unknown keys are an error."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    return RunConfig(**data)


def read_json(path: str | Path, what: str = "config") -> dict[str, Any]:
    """A JSON object from a file (`what` it is: a config, a DeepSpeed config); a missing or unreadable file, bad JSON
    or a non-object is a ConfigError naming the file. The one reader of a user's JSON files."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a {what} must be a JSON object, got {type(data).__name__}")
    return data


def load(path: str | Path) -> RunConfig:
    """Read a resolved `config.json` (from a run folder or an artifact)."""
    path = Path(path)
    data = read_json(path)
    try:
        return from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: the keys `--set` takes."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out
