"""Short training examples cut from long ones (`data.crops`): each training text's first and/or last sentence,
with the text's label.

Why: the demo's training reviews run to hundreds of words, and a classifier fine-tuned only on them misreads the
one-line reviews users type first ("Ennuyeux du début à la fin."). A review's opening and closing sentences carry
its verdict more often than its middle (the summary, the recommendation), so they are the crops that keep the label
true most often. Only the training split gets them: validation and test stay the files the user named.
"""

from __future__ import annotations

import re

from trainer.data.readers import Example, detokenize

MIN_WORDS, MAX_WORDS = 3, 25  # a crop shorter says too little to keep its label; longer is not a short review
# A sentence ends at . ! ? or … (a run of them: "?!", "...") followed by white space.
SENTENCE_END = re.compile(r"(?<=[.!?\u2026])\s+")


def sentences(text: str) -> list[str]:
    """A text's sentences, in order, without empty ones."""
    return [s for s in (part.strip() for part in SENTENCE_END.split(text.strip())) if s]


def crops_of(ex: Example, where: list[str]) -> list[Example]:
    """The crops of one example: for each of `where`, that sentence when it has MIN_WORDS-MAX_WORDS words. A text
    of one sentence gives none (the crop would be the example again)."""
    text = ex.text if ex.text is not None else detokenize(ex.pieces or [])
    parts = sentences(text)
    if len(parts) < 2:
        return []
    picked = {"first": 0, "last": len(parts) - 1}
    out = []
    for w in where:
        s = parts[picked[w]]
        if MIN_WORDS <= len(s.split()) <= MAX_WORDS:
            out.append(Example(s, None, ex.label, f"{ex.source} ({w} sentence)"))
    return out


def add_crops(examples: list[Example], where: list[str]) -> tuple[list[Example], int]:
    """(examples followed by their crops, number of crops); the examples unchanged when `where` is empty."""
    extra = [c for ex in examples for c in crops_of(ex, where)] if where else []
    return examples + extra, len(extra)
