"""A config dataclass's field comments as its documentation: the comments beside and around a field are the one place
its meaning is written; `python -m trainer config` and the server's --help print them. Read from the source with the
tokenize module (the installed package ships its .py files).

A field's meaning is written in one of two places, never both:

    port: int = 50051  # beside the field: the comment at the end of its line,
    # continued by the full-line comments right below it, whatever letter they start with.

    # Above the field, when its line has no comment: the full-line comments right above it.
    max_len: int = 512

So a block of full-line comments between two fields continues the field above when the field below has a comment of
its own, and describes the field below when it has none. A blank line ends a continuation; a full-line comment of one
or two words without punctuation is a heading ("# Network"), which ends one too and describes no field. A comment
that fits neither place (above a field that has its own, or below one that has none) is an error: its field cannot
be told, and a guess would print one option's words as another's help.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass

BODY = 4  # the class body's indentation once dedented: full-line comments deeper than this are inside methods


@dataclass
class _Line:
    """One row of the class body, as far as comments are concerned."""

    kind: str  # "field", "comment", "heading", "blank" or "code" (anything else: docstring, def, decorator)
    row: int  # 1-based row in the class's source
    name: str = ""  # kind field: the field's name
    text: str = ""  # kind comment: its text; kind field: the comment at the end of its line(s) ("" if none)


def comments(cls: type) -> dict[str, str]:
    """field -> its meaning (module docstring: where it is written). Raises ValueError for a comment that belongs
    to no field, naming the class, the row and the comment."""
    lines = _lines(cls)
    out: dict[str, str] = {ln.name: ln.text for ln in lines if ln.kind == "field" and ln.text}
    i = 0
    while i < len(lines):
        if lines[i].kind != "comment":
            i += 1
            continue
        j = i
        while j < len(lines) and lines[j].kind == "comment":
            j += 1
        block = " ".join(ln.text for ln in lines[i:j])
        before = lines[i - 1] if i else None
        after = lines[j] if j < len(lines) else None
        if after is not None and after.kind == "field" and not after.text:
            out[after.name] = block  # above a field without a comment of its own
        elif before is not None and before.kind == "field" and before.text:
            out[before.name] += " " + block  # continues the comment beside the field above
        elif after is None or after.kind == "code":
            pass  # after the fields (a method's or the class's own remark), not a field's meaning
        else:
            raise ValueError(f"{cls.__name__}, row {lines[i].row} of its source: the comment {block[:60]!r}... belongs "
                             "to no field: above a field it must be the field's only comment, below one it must "
                             "continue the comment at the end of that field's line (contract/comments.py)")
        i = j
    return out


def _lines(cls: type) -> list[_Line]:
    """The class body's rows in order: fields (with the comment at the end of their logical line), full-line comments
    at the body's indentation, headings, blank rows and other code."""
    src = textwrap.dedent(inspect.getsource(cls))
    rows = src.splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    out: list[_Line] = []
    start, trailing = None, []  # the logical line in progress: its first row, the comments on its rows
    for t in tokenize.generate_tokens(io.StringIO(src).readline):
        if t.type == tokenize.COMMENT:
            text = t.string.lstrip("#").strip()
            if start is not None:
                trailing.append(text)
            elif t.start[1] == BODY:
                heading = len(text.split()) <= 2 and not re.search(r"[.,:;=()]", text)
                out.append(_Line("heading" if heading else "comment", t.start[0], text=text))
        elif t.type == tokenize.NEWLINE and start is not None:
            m = re.match(rf" {{{BODY}}}(\w+)\s*:", rows[start - 1])  # an annotated name of the class body
            if m and m.group(1) in names:
                out.append(_Line("field", start, name=m.group(1), text=" ".join(trailing)))
            else:
                out.append(_Line("code", start))
            start, trailing = None, []
        elif t.type == tokenize.NL and start is None and not t.line.strip():
            out.append(_Line("blank", t.start[0]))
        elif t.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING) and start is None:
            start = t.start[0]
    return out
