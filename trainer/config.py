"""Typed configuration: one dataclass per component, named presets, explicit overrides.

A run is described by a `RunConfig`; presets (`tiny`, `demo`, `lab`, ...) are functions that build one, and
`--set section.field=value` overrides a field by name. The resolved config is written as `config.json` into every
run folder and artifact, and every stage reads a config that passed every rule below: ranges are declared next to
their field, rules between fields of a section in its `__post_init__`, rules across sections in RunConfig's.
A bad value or an unknown key is a ConfigError: one line naming the key, the value and what is allowed (for an
unknown key, the closest valid one and the list of valid keys).

Why pydantic (its dataclasses; installed with DeepSpeed, which validates its own JSON with it): it coerces the
strings of `--set` and the values of a JSON file to the declared types (int, float, bool, Literal, nested
sections), refuses unknown keys, and checks ranges declared on the field (`Field(gt=0, allow_inf_nan=False)`),
which replaced ~150 lines of hand-written coercion and scattered checks. What stays ours: `--set` parsing (comma
lists, "none"), and turning pydantic's multi-line ValidationError into the one-line error above.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import typing
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

from contract.tokens import N_SPECIALS

# Where the data sets live: beside the checkout, or wherever TS_DATA points.
DEFAULT_DATA_ROOT = os.environ.get("TS_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "data"))


class ConfigError(ValueError):
    """A config value or key is invalid; the message names it and what is allowed."""


def _comma_list(value: Any) -> Any:
    """`--set data.labels=neg,pos`: a string becomes the list of its comma-separated items."""
    return [v for v in value.split(",") if v != ""] if isinstance(value, str) else value


def _none_word(value: Any) -> Any:
    """`--set finetune.dropout=none` (or null): no value."""
    return None if isinstance(value, str) and value.lower() in ("none", "null") else value


# Field types with their ranges. Floats are finite (inf and nan are refused wherever a float is read).
Float = Annotated[float, Field(allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]  # [0, 1)
Count = Annotated[int, Field(ge=0)]  # 0 allowed (0 usually means "off" or "all": see the field's comment)
Size = Annotated[int, Field(ge=1)]
StrList = Annotated[list[str], BeforeValidator(_comma_list)]

_PYDANTIC = ConfigDict(extra="forbid", validate_assignment=True)


def section(name: str) -> typing.Callable[[type], type]:
    """A config section: a pydantic dataclass whose constructor raises ConfigError (one line, keys under `name`)."""

    def wrap(cls: type) -> type:
        cls = pydantic_dataclass(config=_PYDANTIC)(cls)
        init = cls.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                init(self, *args, **kwargs)
            except ValidationError as e:
                raise ConfigError(explain(e, cls, name)) from None

        cls.__init__ = __init__  # type: ignore[method-assign]
        return cls

    return wrap


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
    # A sequence is <sos> + pieces + <eos>, cut to this many ids (>= 3: <sos>, one piece, <eos>). The one setting
    # of the cut: the run's tokenizer folder (tokenizer.json) is checked to hold the same value.
    max_len: Annotated[int, Field(ge=3)] = 512


@section("data")
class DataConfig:
    """Where the text lives. Relative paths are under `root`; any file may be gzipped."""

    root: str = DEFAULT_DATA_ROOT  # folder of the data sets (../shared/data beside the checkout)
    # Unlabeled text for pretraining: .txt (a document a line), .jsonl, .tsv, .csv, .parquet or the lab's .spm;
    # globs too (part-*.txt.gz: matches sorted).
    pretrain: StrList = field(default_factory=lambda: ["eltec-fr/eltec_fra.txt.gz", "cls-books-fr/train.review.spm"])
    pretrain_eval_lines: Count = 500  # the last lines of the corpus held out for eval loss
    # A folder written by `python -m trainer prepare` (absolute, or relative to the working directory like --out):
    # pretraining reads it instead of tokenizing data.pretrain. Empty: the run prepares RUN/prepared itself.
    prepared: str = ""
    # How each node checks its copy of the prepared folder at start: sha256 of every file (a share per local rank),
    # or size only (instant; for copies already checked).
    verify: Literal["sha256", "size"] = "sha256"
    train: str = "cls-books-fr/train.review.spm"  # labeled training set (.spm + sibling .label, .tsv, .jsonl)
    test: str = "cls-books-fr/test.review.spm"  # labeled set scored after every fine-tuning epoch
    extra_test: StrList = field(default_factory=list)  # more labeled sets, scored once after the last epoch
    labels: StrList = field(default_factory=lambda: ["0", "1"])  # the declared classes, in head order
    label_names: StrList = field(default_factory=lambda: ["negative", "positive"])  # shown by the server
    text_field: str = "text"  # .jsonl / .tsv column with the text
    label_field: str = "label"  # .jsonl / .tsv column with the label
    max_train_examples: Count = 0  # 0 = all; else the first N after shuffling (quick runs)
    max_test_examples: Count = 0  # 0 = all

    def __post_init__(self) -> None:
        if len(self.labels) < 2 or len(set(self.labels)) != len(self.labels):
            raise ConfigError(f"data.labels must list at least 2 distinct classes, got {self.labels}")
        if len(self.label_names) != len(self.labels):
            raise ConfigError(
                f"data.label_names has {len(self.label_names)} names for {len(self.labels)} labels {self.labels}"
            )

    def path(self, name: str) -> Path:
        p = Path(name).expanduser()
        return p if p.is_absolute() else Path(self.root) / p


@section("optim")
class OptimConfig:
    """Optimizer and schedule for one training stage."""

    name: Literal["adam", "adamw"] = "adam"
    lr: Positive = 3e-4
    weight_decay: NonNegative = 0.0
    betas: Annotated[list[Probability], BeforeValidator(_comma_list), Field(min_length=2, max_length=2)] = field(
        default_factory=lambda: [0.9, 0.999])
    grad_clip: Positive = 0.5  # max global gradient norm (the lab's 0.5); a large value effectively turns it off
    warmup_steps: Count = 0  # linear warm-up from lr / warmup_steps
    schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warmup; decay ends at lr * 0.1


@section("engine")
class EngineConfig:
    """How DeepSpeed runs the model (trainer/engine.py derives its JSON from this)."""

    zero_stage: Annotated[int, Field(ge=0, le=2)] = 0  # ZeRO 0, 1 or 2
    # fp32, bf16, or auto: bf16 where the device has native bf16 units (trainer/precision.py), fp32 elsewhere
    precision: Literal["fp32", "bf16", "auto"] = "fp32"
    grad_accum: Size = 1  # micro-batches per optimizer step
    deepspeed_config: str = ""  # a user's DeepSpeed JSON whose keys override the derived ones
    checkpoint_every: Count = 0  # steps between resumable checkpoints (0 = only at the end)
    keep_checkpoints: Size = 2  # older engine checkpoints are deleted; 0 would delete the one --resume needs
    log_every: Size = 10  # steps between log lines (the only host-device syncs in the loop)


@section("pretrain")
class PretrainConfig:
    """Language-model pretraining."""

    objective: Literal["clm", "mlm"] = "clm"  # clm: next token (the lab); mlm: BERT-style masking, no causal mask
    mask_prob: Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)] = 0.15  # mlm: share of real tokens predicted
    micro_batch: Size = 16  # sequences per rank per micro-step
    seq_len: Annotated[int, Field(ge=2)] = 128  # pretraining window in ids
    epochs: Size = 2
    max_steps: Count = 0  # 0 = run the epochs; else stop after this many optimizer steps
    eval_every: Count = 0  # steps between eval-loss passes (0 = at the end only)
    optim: OptimConfig = field(default_factory=OptimConfig)


@section("finetune")
class FinetuneConfig:
    """Classification fine-tuning (a new head on the encoder)."""

    micro_batch: Size = 8
    epochs: Size = 15
    max_steps: Count = 0  # 0 = run the epochs
    # Dropout while fine-tuning only (None: model.dropout). A pretrained encoder fits a small labeled set in a few
    # epochs; dropout here regularises it without changing how it was pretrained.
    dropout: Annotated[Probability | None, BeforeValidator(_none_word)] = None
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))


@section("")
class RunConfig:
    """Everything one run needs; `config.json` in a run folder is this, resolved."""

    preset: str = "lab"
    seed: Count = 0  # data order, initial weights, dropout and MLM masks all derive from it
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    def __post_init__(self) -> None:
        """The rules across sections, checked once here: every stage reads a config that passed them."""
        m, tc = self.model, self.tokenizer
        if tc.kind == "train" and m.vocab_size != tc.vocab_size + N_SPECIALS:  # kind=lab: dict.txt decides
            raise ConfigError(f"tokenizer.vocab_size={tc.vocab_size} gives {tc.vocab_size + N_SPECIALS} ids with the "
                              f"{N_SPECIALS} specials, but model.vocab_size={m.vocab_size}; set "
                              f"model.vocab_size={tc.vocab_size + N_SPECIALS}")
        if m.num_classes != len(self.data.labels):
            raise ConfigError(f"model.num_classes={m.num_classes} but data.labels has {len(self.data.labels)} "
                              f"classes {self.data.labels}")
        if tc.max_len > m.max_positions:
            raise ConfigError(f"tokenizer.max_len={tc.max_len} exceeds model.max_positions={m.max_positions} "
                              "(the longest sequence the model accepts)")
        if self.pretrain.seq_len > m.max_positions:
            raise ConfigError(f"pretrain.seq_len={self.pretrain.seq_len} exceeds model.max_positions="
                              f"{m.max_positions}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"


# ---------------------------------------------------------------------------------------------- presets


def lab() -> RunConfig:
    """The lab's sizes and schedule: its tokenizer (50,001 ids), d=200, 4 layers; meant for a GPU."""
    return RunConfig(
        preset="lab",
        pretrain=PretrainConfig(micro_batch=16, seq_len=512, epochs=2, optim=OptimConfig(lr=3e-4)),
        finetune=FinetuneConfig(micro_batch=8, epochs=15, optim=OptimConfig(lr=1e-4)),
    )


def demo() -> RunConfig:
    """The lab's experiment sized for 2 CPU cores (its wall time, measured and dated: docs/RESULTS.md): a trained 8k
    tokenizer (the 50k-way LM head is most of the lab's FLOPs), next-token LM as in the lab, the lab's fine-tuning
    lr 1e-4.
    Two departures from the lab, each measured (docs/RESULTS.md): the classifier averages the real positions
    instead of reading `<eos>` (whose next-token target is the same for every review), and fine-tuning (only)
    uses dropout 0.1; with both, the pretrained encoder led at every epoch, without them at the first two only.

    Pretraining text: the novels of eltec-fr plus the cls-books train reviews listed 8 times (in-domain text is
    then ~14% of the pieces instead of 2%); the valid reviews come last, so they are the held-out eval slice."""
    return RunConfig(
        preset="demo",
        model=ModelConfig(vocab_size=8004, d_model=128, n_layers=2, n_heads=2, d_ff=256, max_positions=512,
                          pooling="mean"),
        tokenizer=TokenizerConfig(kind="train", vocab_size=8000, max_len=256, train_lines=100_000),
        data=DataConfig(
            pretrain=["eltec-fr/eltec_fra.txt.gz", *["cls-books-fr/train.review.txt"] * 8,
                      "cls-books-fr/valid.review.txt"],
            pretrain_eval_lines=400,
        ),
        pretrain=PretrainConfig(
            micro_batch=32,
            seq_len=128,
            epochs=1,
            max_steps=2000,
            optim=OptimConfig(lr=1e-3, warmup_steps=100, schedule="cosine"),
        ),
        finetune=FinetuneConfig(micro_batch=16, epochs=6, dropout=0.1, optim=OptimConfig(lr=1e-4)),
        engine=EngineConfig(checkpoint_every=500, log_every=25),
    )


def english() -> RunConfig:
    """The English pipeline most users run first: a tokenizer trained on IMDB's 50,000 unlabeled reviews,
    next-token pretraining on them (in-domain text), fine-tuning on IMDB train, accuracy on IMDB test, and SST-2
    dev/test (movie-review sentences) scored once at the end with the whole IMDB test set (each epoch scores a seeded
    5,000-review sample of it). The demo's model size and its fine-tuning recipe (mean pooling, dropout 0.1 while
    fine-tuning). Pretraining is longer than the demo's and its windows are as long as a fine-tuning review (256
    ids, so every position the classifier averages was pretrained): 10,000 steps of 16 windows, 1.8 passes over the
    unlabeled text. Wall times, and the comparison with the demo's 2,000 x 32 x 128 schedule and with masked-LM
    pretraining: docs/RESULTS.md."""
    base = demo()  # the same model, tokenizer size and fine-tuning recipe
    return dataclasses.replace(
        base,
        preset="english",
        data=DataConfig(
            pretrain=["imdb/unsup.txt.gz"],
            pretrain_eval_lines=500,
            train="imdb/train.jsonl.gz",
            test="imdb/test.jsonl.gz",
            max_test_examples=5000,  # per epoch: a seeded sample of the test set; all 25,000 once at the end
            extra_test=["imdb/test.jsonl.gz", "sst2/dev.tsv", "sst2/test.tsv"],
        ),
        # 87,649 windows of <= 256 ids; max_steps ends the run inside the second epoch
        pretrain=dataclasses.replace(base.pretrain, micro_batch=16, seq_len=256, epochs=2, max_steps=10_000),
        finetune=dataclasses.replace(base.finetune, epochs=2),  # 25,000 labeled reviews: 2 epochs are 3,126 steps
        engine=dataclasses.replace(base.engine, checkpoint_every=1000),
    )


def tiny() -> RunConfig:
    """Seconds, for tests: odd sizes so that shape bugs show (vocab 99 after training 95 pieces)."""
    return RunConfig(
        preset="tiny",
        model=ModelConfig(vocab_size=99, d_model=32, n_layers=2, n_heads=2, d_ff=48, max_positions=64),
        tokenizer=TokenizerConfig(kind="train", vocab_size=95, max_len=48, train_lines=2000),
        data=DataConfig(
            pretrain=["cls-books-fr/train.review.txt"],
            pretrain_eval_lines=13,
            max_train_examples=104,
            max_test_examples=39,
        ),
        pretrain=PretrainConfig(micro_batch=13, seq_len=24, epochs=1, max_steps=6, optim=OptimConfig(lr=1e-3)),
        finetune=FinetuneConfig(micro_batch=13, epochs=2, optim=OptimConfig(lr=1e-3)),
        engine=EngineConfig(log_every=2),
    )


PRESETS: dict[str, typing.Callable[[], RunConfig]] = {"tiny": tiny, "demo": demo, "english": english, "lab": lab}


def preset(name: str) -> RunConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


# ---------------------------------------------------------------------------------------------- overrides


def valid_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every key `--set` takes, e.g. "pretrain.optim.lr"."""
    keys: list[str] = []
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        keys += valid_keys(tp, f"{prefix}{f.name}.") if dataclasses.is_dataclass(tp) else [prefix + f.name]
    return keys


def unknown_key(key: str, valid: list[str] | None = None) -> ConfigError:
    """The error for a key no section has: the closest valid key (in the same section first), then all of them."""
    valid = valid or valid_keys()
    parent, _, leaf = key.rpartition(".")
    siblings = [k for k in valid if k.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.8) or difflib.get_close_matches(key, valid, n=1,
                                                                                                   cutoff=0.8)
    if not close:  # the right name in the wrong place ("pretrain.lr" for "pretrain.optim.lr")
        same = [k for k in valid if k.rpartition(".")[2] == leaf]
        close = [k for k in same if k.split(".")[0] == key.split(".")[0]] or same
    hint = f" (did you mean {' or '.join(repr(k) for k in close[:2])}?)" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}; valid keys: {', '.join(valid)}")


def _shown(value: Any) -> str:
    """A value as the user typed it: numbers bare ("-5"), other strings quoted."""
    if isinstance(value, str):
        try:
            float(value)
            return value
        except ValueError:
            pass
    return repr(value)


def explain(e: ValidationError, cls: type = RunConfig, prefix: str = "") -> str:
    """pydantic's errors as one line: "pretrain.optim.lr must be > 0, got -1" (several are joined by "; ")."""
    lines = []
    for err in e.errors():
        key = ".".join([prefix] * bool(prefix) + [str(x) for x in err["loc"]])
        kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
        if kind == "value_error":  # our own rule (a __post_init__): its message names the keys already
            lines.append(str(ctx.get("error", err["msg"])))
            continue
        if kind in ("unexpected_keyword_argument", "extra_forbidden"):
            lines.append(str(unknown_key(key, valid_keys(cls, f"{prefix}." if prefix else ""))))
            continue
        rule = {
            "greater_than": f"must be > {ctx.get('gt')}", "greater_than_equal": f"must be >= {ctx.get('ge')}",
            "less_than": f"must be < {ctx.get('lt')}", "less_than_equal": f"must be <= {ctx.get('le')}",
            "finite_number": "must be a finite number", "literal_error": f"must be {ctx.get('expected')}",
            "int_parsing": "must be an integer", "int_from_float": "must be an integer",
            "int_type": "must be an integer", "float_parsing": "must be a number", "float_type": "must be a number",
            "bool_parsing": "must be true or false", "bool_type": "must be true or false",
            "string_type": "must be a string", "list_type": "must be a list (a,b,c on the command line)",
            "too_short": f"must have {ctx.get('min_length')} values",
            "too_long": f"must have {ctx.get('max_length')} values",
            "dataclass_type": "must be a section (a mapping of keys)",
        }.get(kind, err["msg"])
        lines.append(f"{key} {rule}, got {_shown(got)}")
    return "; ".join(lines)


def override(cfg: RunConfig, assignments: list[str] | dict[str, Any]) -> RunConfig:
    """Apply `section.field=value` overrides (values are coerced to the field's type); a new, validated config."""
    items = assignments.items() if isinstance(assignments, dict) else [_split(a) for a in assignments]
    data = cfg.to_dict()
    valid = valid_keys()
    for key, value in items:
        if key not in valid:
            raise unknown_key(key, valid)
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            node = node[p]
        node[leaf] = value
    return from_dict(data)


def _split(assignment: str) -> tuple[str, str]:
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like section.field=value")
    key, value = assignment.split("=", 1)
    return key.strip(), value.strip()


def from_dict(data: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from a (possibly partial) mapping; unknown keys are an error."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    return RunConfig(**data)


def read_json(path: str | Path) -> dict[str, Any]:
    """A JSON object from a file; a missing file, bad JSON or a non-object is a ConfigError naming the file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load(path: str | Path) -> RunConfig:
    """Read a resolved `config.json` (from a run folder or an artifact)."""
    path = Path(path)
    data = read_json(path)
    try:
        return from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def resolve(preset_name: str, overrides: list[str] | None = None, config_file: str | None = None) -> RunConfig:
    """Preset, then a JSON file's keys, then `--set` overrides: the order the CLI applies them."""
    return Choice(preset_name, config_file, tuple(overrides or ())).resolve()


@dataclasses.dataclass(frozen=True)
class Choice:
    """How the command line chose a config: a preset, then a JSON file of overrides, then `--set` assignments."""

    preset: str
    file: str | None = None  # --config FILE
    assignments: tuple[str, ...] = ()  # --set KEY=VALUE, in order

    def settings(self) -> dict[str, Any]:
        """Every key the user set (file, then --set), with its raw value."""
        out = flatten(read_json(self.file)) if self.file else {}
        out.update(_split(a) for a in self.assignments)
        return out

    def resolve(self, fixed: dict[str, Any] | None = None, fixed_by: str = "") -> RunConfig:
        """The config. `fixed`: keys that something else decides (e.g. `--pretrained ARTIFACT` fixes the tokenizer
        and the encoder's shape): a user setting that would change one is an error, not silently dropped."""
        cfg = preset(self.preset)
        if fixed:
            cfg = override(cfg, fixed)
        if self.file:
            cfg = override(cfg, flatten(read_json(self.file)))
        if self.assignments:
            cfg = override(cfg, list(self.assignments))
        flat = flatten(cfg.to_dict())
        for key in self.settings():
            if fixed and key in fixed and flat[key] != fixed[key]:
                raise ConfigError(f"{key}={flat[key]!r} would be ignored: {fixed_by} fixes it to {fixed[key]!r}; "
                                  "remove the setting")
        return cfg


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: the keys `--set` takes."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out
