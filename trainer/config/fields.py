"""The building blocks of trainer/config/schema.py: field types with their ranges, the `section` decorator (a pydantic
dataclass), and a bad config as one line: pydantic's multi-line ValidationError, and unknown keys with the closest
valid one. Imports nothing of trainer/."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

HELP = "every key, with its type and meaning: python -m trainer config"


class ConfigError(ValueError):
    """A config value or key is invalid; the message names it and what is allowed."""


def comma_list(value: Any) -> Any:
    """`--set data.labels=neg,pos`: a string becomes the list of its comma-separated items."""
    return [v for v in value.split(",") if v != ""] if isinstance(value, str) else value


def none_word(value: Any) -> Any:
    """`--set finetune.dropout=none` (or null): no value."""
    return None if isinstance(value, str) and value.lower() in ("none", "null") else value


# Field types with their ranges. Floats are finite (inf and nan are refused wherever a float is read).
Float = Annotated[float, Field(allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]  # [0, 1)
Count = Annotated[int, Field(ge=0)]  # 0 allowed (0 usually means "off" or "all": see the field's comment)
Size = Annotated[int, Field(ge=1)]
StrList = Annotated[list[str], BeforeValidator(comma_list)]

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


def keys_of(cls: type, prefix: str = "") -> list[str]:
    """Every key of a config class, nested sections dotted ("pretrain.optim.lr")."""
    keys: list[str] = []
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        keys += keys_of(tp, f"{prefix}{f.name}.") if dataclasses.is_dataclass(tp) else [prefix + f.name]
    return keys


# What other tools call some of our keys (HF TrainingArguments and model configs, PyTorch, scikit-learn), by leaf
# name without underscores: a user who types theirs is pointed to ours.
ALIASES = {
    "learningrate": "lr", "lrschedulertype": "schedule", "scheduler": "schedule", "warmup": "warmup_steps",
    "numtrainepochs": "epochs", "numepochs": "epochs", "batchsize": "micro_batch", "trainbatchsize": "micro_batch",
    "perdevicetrainbatchsize": "micro_batch", "gradientaccumulationsteps": "grad_accum", "maxgradnorm": "grad_clip",
    "clipgradnorm": "grad_clip", "numlabels": "num_classes", "maxlength": "max_len", "maxseqlength": "max_len",
    "optimizer": "name", "loggingsteps": "log_every", "savesteps": "checkpoint_every", "evalsteps": "eval_every",
    "hiddensize": "d_model", "numhiddenlayers": "n_layers", "numattentionheads": "n_heads",
    "intermediatesize": "d_ff", "earlystoppingpatience": "patience", "savetotallimit": "keep_checkpoints",
    "textcolumn": "text_field", "labelcolumn": "label_field", "hiddendropoutprob": "dropout",
}


def _leaf(key: str) -> str:
    return key.rpartition(".")[2]


def closest_keys(key: str, valid: list[str]) -> list[str]:
    """At most two valid keys a mistyped one most likely meant, searched among every key (nested sections too): the
    same name or another tool's name for it (ALIASES), or a close spelling; those under the same section first."""
    parent, top, leaf = key.rpartition(".")[0], key.split(".")[0], _leaf(key)
    leaves = sorted({_leaf(k) for k in valid})
    alias = ALIASES.get(leaf.replace("_", "").lower())
    exact = {leaf} | ({alias} if alias else set())
    near = set(difflib.get_close_matches(leaf, leaves, n=3, cutoff=0.6))
    whole = difflib.get_close_matches(key, valid, n=2, cutoff=0.8)
    if whole and not any(k.startswith(top + ".") for k in valid):  # a mistyped section: "pretrian.max_steps"
        return whole
    hits = [k for k in valid if _leaf(k) in exact | near]
    hits += [k for k in whole if k not in hits]
    same_top = [k for k in hits if k.split(".")[0] == top and "." in key]
    ranked = sorted(same_top or hits, key=lambda k: (k.rpartition(".")[0] != parent, _leaf(k) not in exact,
                                                     -difflib.SequenceMatcher(None, leaf, _leaf(k)).ratio()))
    # A name found at several depths: the shallowest (finetune.optim.lr, not finetune.task_lm.optim.lr)
    depth = {_leaf(k): min(h.count(".") for h in ranked if _leaf(h) == _leaf(k)) for k in ranked}
    return [k for k in ranked if k.count(".") == depth[_leaf(k)]][:2]


def unknown_key(key: str, valid: list[str]) -> ConfigError:
    """The error for a key no section has: the closest valid keys (`closest_keys`), then every key of that section,
    nested ones included (or the sections), and where every key is described."""
    parent = key.rpartition(".")[0]
    close = closest_keys(key, valid)
    hint = f" (did you mean {' or '.join(repr(k) for k in close)}?)" if close else ""
    sections = f"sections: {', '.join(dict.fromkeys(k.split('.')[0] for k in valid if '.' in k))}"
    inside = [k for k in valid if k.startswith(parent + ".")] if parent else []
    if inside:
        listed = f"keys of {parent!r}: {', '.join(inside)}"
    else:
        listed = f"top-level keys: {', '.join(k for k in valid if '.' not in k)}; {sections}"
    return ConfigError(f"unknown config key {key!r}{hint}; {listed} ({HELP})")


def _shown(value: Any) -> str:
    """A value as the user typed it: numbers bare ("-5"), other strings quoted."""
    if isinstance(value, str):
        try:
            float(value)
            return value
        except ValueError:
            pass
    return repr(value)


RULES = {
    "greater_than": "must be > {gt}", "greater_than_equal": "must be >= {ge}", "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}", "finite_number": "must be a finite number",
    "literal_error": "must be {expected}", "int_parsing": "must be an integer", "int_from_float": "must be an integer",
    "int_type": "must be an integer", "float_parsing": "must be a number", "float_type": "must be a number",
    "bool_parsing": "must be true or false", "bool_type": "must be true or false", "string_type": "must be a string",
    "list_type": "must be a list (a,b,c on the command line)", "too_short": "must have {min_length} values",
    "too_long": "must have {max_length} values", "dataclass_type": "must be a section (a mapping of keys)",
}


def explain(e: ValidationError, cls: type, prefix: str = "") -> str:
    """pydantic's errors as one line: "pretrain.optim.lr must be > 0, got -1" (several are joined by "; ")."""
    lines = []
    for err in e.errors():
        key = ".".join([prefix] * bool(prefix) + [str(x) for x in err["loc"]])
        kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
        if kind == "value_error":  # our own rule (a __post_init__): its message names the keys already
            lines.append(str(ctx.get("error", err["msg"])))
            continue
        if kind in ("unexpected_keyword_argument", "extra_forbidden"):
            lines.append(str(unknown_key(key, keys_of(cls, f"{prefix}." if prefix else ""))))
            continue
        rule = RULES[kind].format(**ctx) if kind in RULES else err["msg"]
        lines.append(f"{key} {rule}, got {_shown(got)}")
    return "; ".join(lines)
