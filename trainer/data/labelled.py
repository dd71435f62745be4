"""The labelled data of a fine-tuning run: its files read, the label values settled, validation and test split off
the training file when the user has no such file (seeded, stratified), caps applied, and a summary for the log.

Layers: trainer/data/readers.py reads the files, this module decides which examples each split holds,
trainer/data/tokenizer.py encodes them (`Split`). Torch is imported for the batch tensors only.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from trainer.config.schema import ConfigError, RunConfig, override
from trainer.data.batching import pad_batch
from trainer.data.crops import add_crops
from trainer.data.readers import SHOWN_LINES, DataError, Example, Occurrences, label_occurrences, read_labeled
from trainer.data.tokenizer import Tokenizer

SALT = {"test": 1, "valid": 2}  # seeds the two splits apart
# Fewest examples of a class found in a training file (without data.labels): below it, a stratified 10% validation
# split holds at most one of them, and a class of a few rows is more often a typo than a class.
MIN_CLASS_EXAMPLES = 10


@dataclasses.dataclass
class Part:
    """The examples of one split and where they came from."""

    examples: list[Example]
    source: str  # the file, or "10% of FILE split off (stratified, seed 0)"
    cap: str = ""  # the config key that capped it, with its value ("" when none applied)
    total: int = 0  # examples before the cap
    split_off: bool = False  # held out of data.train
    blank: list[str] = dataclasses.field(default_factory=list)  # "file:line" of the blank texts skipped
    crops: int = 0  # the last N examples are data.crops' sentences of the others (the model trains on them)

    @property
    def originals(self) -> list[Example]:
        """The split's own examples, without crops: what the TF-IDF baseline fits and a tokenizer trains on."""
        return self.examples[:len(self.examples) - self.crops]


@dataclasses.dataclass
class Labelled:
    train: Part
    valid: Part
    test: Part  # whole: the kept weights are scored on all of it
    extra: dict[str, Part]

    def summary(self, cfg: RunConfig) -> list[str]:
        """The log's first lines: every file, its example and label counts, every cap."""
        d, names = cfg.data, cfg.data.names
        lines = []
        for name, part in [("train", self.train), ("valid", self.valid), ("test", self.test), *self.extra.items()]:
            counts = Counter(ex.label for ex in part.examples)
            per = ", ".join(f"{names[i]} {counts.get(i, 0)}" for i in range(len(names)))
            cap = f" (of {part.total}: {part.cap})" if part.cap else ""
            crops = f" + {part.crops} crops (data.crops={','.join(d.crops)})" if part.crops else ""
            lines.append(f"data: {name}: {part.source}{crops}: {len(part.examples)} examples{cap}; {per}"
                         + (f"; {blank_note(part.blank)}" if part.blank else ""))
        pairs = ", ".join(f"{v!r} -> {n!r}" for v, n in zip(d.labels, names, strict=True))
        lines.append(f"data: labels (value in the file -> name served, head order): {pairs}")
        caps = [f"data.max_train_examples={d.max_train_examples}", f"data.max_valid_examples={d.max_valid_examples}",
                f"data.max_test_examples={d.max_test_examples} (per epoch; the kept weights score the whole test set)"]
        lines.append(f"data: caps (0 = all): {', '.join(caps)}; tokenizer.max_len={cfg.tokenizer.max_len} ids")
        return lines


def blank_note(where: list[str]) -> str:
    """"3 blank texts skipped (FILE:4, FILE:9, FILE:12)": what a log or report says of them."""
    shown = ", ".join(where[:SHOWN_LINES]) + (", ..." if len(where) > SHOWN_LINES else "")
    return f"{len(where)} blank text{'s' * (len(where) != 1)} skipped ({shown})"


def settle_labels(cfg: RunConfig, num_classes_set: bool) -> RunConfig:
    """data.labels = [] means the distinct values of the training file, sorted; the head gets one logit each. What
    would silently become a class of its own is an error instead (`check_values`)."""
    if cfg.data.labels:
        return cfg
    if not cfg.data.train:
        raise ConfigError("data.train is not set: name your labelled training file (--set data.train=FILE)")
    found = label_occurrences(cfg.data.path(cfg.data.train), cfg.data.text_field, cfg.data.label_field)
    check_values(cfg.data.path(cfg.data.train), found)
    values = list(found)
    if num_classes_set and cfg.model.num_classes != len(values):
        raise ConfigError(f"model.num_classes={cfg.model.num_classes} but {cfg.data.train} holds {len(values)} label "
                          f"values {values}; set data.labels to the ones to keep, or drop model.num_classes")
    return override(cfg, {"data.labels": values, "model.num_classes": len(values)})


def check_values(path: Path, found: dict[str, Occurrences]) -> None:
    """The label values of a training file, when data.labels does not list them: an empty value, two spellings of
    one value (`Positive`/`positive`, `1`/`true`/`1.0`) and a class of fewer than MIN_CLASS_EXAMPLES examples are
    errors naming the value and its lines, since each would silently become a class of its own."""
    def lines(value: str) -> str:
        o = found[value]
        return ", ".join(o.where) + (", ..." if o.count > len(o.where) else "")

    if "" in found:
        raise DataError(f"{path}: {found[''].count} example{'s' * (found[''].count != 1)} with an empty label "
                        f"({lines('')}); fill in or drop those rows (or list the classes in data.labels)")
    spellings: dict[str, list[str]] = {}
    for value in found:
        spellings.setdefault(canonical(value), []).append(value)
    for same in spellings.values():
        if len(same) > 1:
            shown = " and ".join(f"{v!r} ({found[v].count} example{'s' * (found[v].count != 1)}: {lines(v)})"
                                 for v in same)
            raise DataError(f"{path}: the label values {shown} differ only by case or type: write one spelling "
                            "(or list the classes in data.labels)")
    if len(found) < 2:
        raise DataError(f"{path}: every example has label {next(iter(found))!r}; a classifier needs at least 2 "
                        "classes")
    for value, o in found.items():
        if o.count < MIN_CLASS_EXAMPLES:
            raise DataError(f"{path}: label {value!r} has {o.count} example{'s' * (o.count != 1)} ({lines(value)}), "
                            f"fewer than {MIN_CLASS_EXAMPLES}: too few to learn or score a class; fix or drop those "
                            f"rows, or list the classes to train in data.labels (e.g. data.labels="
                            f"{','.join(v for v in found if v != value)},{value})")


def canonical(value: str) -> str:
    """One spelling per value: case folded; true/false as 1/0; a number as its float ("1.0" -> "1")."""
    v = value.strip().casefold()
    v = {"true": "1", "false": "0"}.get(v, v)
    try:
        number = float(v)
    except ValueError:
        return v
    return repr(number) if np.isfinite(number) else v


def load(cfg: RunConfig) -> Labelled:
    """Every split of the run, as Examples (labels are indices into data.labels)."""
    d = cfg.data
    if not d.train:
        raise ConfigError("data.train is not set: name your labelled training file (--set data.train=FILE)")

    def read(name: str, blank: list[str]) -> list[Example]:
        return read_labeled(d.path(name), d.labels, d.text_field, d.label_field, blank)

    train_blank: list[str] = []
    rest = read(d.train, train_blank)
    file = str(d.path(d.train))
    parts: dict[str, Part] = {}
    for split, name, share in (("test", d.test, d.test_split), ("valid", d.valid, d.valid_split)):
        if name:
            blank: list[str] = []
            parts[split] = Part(read(name, blank), str(d.path(name)), blank=blank)
        elif share > 0:
            held, rest = stratified_split(rest, share, cfg.seed, SALT[split])
            whole = f"{file} less its test split" if "test" in parts and parts["test"].split_off else file
            parts[split] = Part(held, f"{share:.0%} of {whole}, split off (stratified, seed {cfg.seed})",
                                split_off=True)
        else:
            raise ConfigError(f"no {split} set: name a labelled file with data.{split}=FILE, or hold out a share of "
                              f"data.train with data.{split}_split=0.1")
        if not parts[split].examples:
            raise ConfigError(f"the {split} set is empty ({parts[split].source}): data.train has too few examples "
                              f"to split; name a file with data.{split}=FILE")
    held_out = [s for s, p in parts.items() if p.split_off]
    train_src = f"{file} less its {' and '.join(held_out)} split{'s' * (len(held_out) > 1)}" if held_out else file
    train = capped(Part(rest, train_src, blank=train_blank), d.max_train_examples, "data.max_train_examples",
                   cfg.seed)
    if d.crops:
        train.examples, train.crops = add_crops(train.examples, d.crops)
    valid = capped(parts["valid"], d.max_valid_examples, "data.max_valid_examples", cfg.seed)
    extra = {}
    for name in d.extra_test:
        blank = []
        extra[name] = Part(read(name, blank), str(d.path(name)), blank=blank)
    return Labelled(train, valid, parts["test"], extra)


def stratified_split(examples: list[Example], share: float, seed: int,
                     salt: int) -> tuple[list[Example], list[Example]]:
    """(held out, rest): round(share x n_c) examples of each class c, seeded; each keeps the file's order. A class
    of two or more examples has at least one on each side."""
    labels = np.array([ex.label for ex in examples], dtype=np.int64)
    rng = np.random.default_rng([seed, salt, len(examples)])
    held: list[int] = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        k = int(round(share * len(idx)))
        if len(idx) >= 2:
            k = min(max(k, 1), len(idx) - 1)
        held += rng.permutation(idx)[:k].tolist()
    mask = np.zeros(len(examples), dtype=bool)
    mask[held] = True
    return [ex for ex, m in zip(examples, mask, strict=True) if m], \
        [ex for ex, m in zip(examples, mask, strict=True) if not m]


def capped(part: Part, limit: int, key: str, seed: int) -> Part:
    """At most `limit` examples (a seeded sample, file order kept); 0: all."""
    if not limit or limit >= len(part.examples):
        return dataclasses.replace(part, total=len(part.examples))
    keep = pick(seed, len(part.examples), limit)
    return Part([part.examples[i] for i in keep], part.source, f"{key}={limit}", len(part.examples),
                blank=part.blank)


def pick(seed: int, n: int, limit: int) -> np.ndarray:
    """Indices (ascending) of the first `limit` of n examples after a seeded shuffle; all of them when limit is 0."""
    return np.sort(np.random.default_rng([seed, n]).permutation(n)[:limit]) if limit else np.arange(n)


# ---------------------------------------------------------------------------------------------- encoded


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


def encode(examples: list[Example], tok: Tokenizer) -> Split:
    return Split([tok.encode_example(ex) for ex in examples], np.array([ex.label for ex in examples], np.int64))


def load_split(cfg: RunConfig, name: str, tok: Tokenizer, limit: int) -> Split:
    """A labeled file encoded with `tok`; with `limit`, the first N examples after a seeded shuffle."""
    examples = read_labeled(cfg.data.path(name), cfg.data.labels, cfg.data.text_field, cfg.data.label_field)
    return encode([examples[i] for i in pick(cfg.seed, len(examples), limit)], tok)


def sample_split(split: Split, seed: int, limit: int) -> Split:
    """The examples `load_split(..., limit)` would keep, taken from the whole file's already encoded split."""
    keep = pick(seed, len(split.ids), limit)
    return Split([split.ids[i] for i in keep], split.labels[keep])


def texts(examples: list[Example]) -> list[str]:
    """The texts of examples (a .spm file's pieces joined back into text), to train a tokenizer on."""
    from trainer.data.readers import detokenize

    return [ex.text if ex.text is not None else detokenize(ex.pieces or []) for ex in examples]


def cut_share(split: Split, max_len: int) -> float:
    """Share (%) of a split's examples cut at max_len ids."""
    return 100.0 * float((split.lengths >= max_len).mean()) if split.ids else 0.0


def path_of(part: Part) -> Path:
    return Path(part.source)
