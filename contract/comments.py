"""A config dataclass's field comments as its documentation: the comment beside a field (and the full-line comments
just above it) is the one place a field's meaning is written; `python -m trainer config` and the server's --help
print them. Read from the source with the tokenize module (the installed package ships its .py files).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import textwrap
import tokenize


def comments(cls: type) -> dict[str, str]:
    """field -> its meaning: the full-line comments just above it, then the one at the end of its line(s), then
    full-line comments right below it that continue a sentence (they start in lower case or with a digit).
    A full-line comment of one or two words without punctuation is a heading ("# Network"), not a meaning."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    above: list[str] = []
    start, trailing, last = None, [], ""  # the logical line in progress: its first row, its comments; last field
    for t in tokenize.generate_tokens(io.StringIO(src).readline):
        text = t.string.lstrip("#").strip() if t.type == tokenize.COMMENT else ""
        if t.type == tokenize.COMMENT and start is not None:
            trailing.append(text)
        elif t.type == tokenize.COMMENT:
            if last and not above and re.match(r"[a-z0-9(]", text):  # continues the field above
                out[last] += " " + text
            elif len(text.split()) > 2 or re.search(r"[.,:;=()]", text):
                above.append(text)
                last = ""
        elif t.type == tokenize.NEWLINE and start is not None:
            m = re.match(r"    (\w+)\s*:", lines[start - 1])  # a field of the class body (4 spaces after dedent)
            last = m.group(1) if m and m.group(1) in names else ""
            if last:
                out[last] = " ".join(above + trailing)
            last = last if trailing else ""
            above, start, trailing = [], None, []
        elif t.type == tokenize.NL and start is None and not t.line.strip():
            last = ""  # a blank line ends a field's continuation
        elif t.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING) and start is None:
            start = t.start[0]
    return out
