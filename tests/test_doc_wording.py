"""The project describes itself, never how it was built: no talk of sessions, of what was "tried and not kept", of
"main at abc1234", of machines lent for a check, no times to the minute. A day stays where a figure needs one.

Read: README.md, docs/, launch/, deploy/, bench/ and the Makefile whole; the comments and docstrings of the product
code (trainer/, serving/, contract/), whose strings (log lines, messages) are the product's own words."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest
from procs import REPO

# Each phrase and why it is process talk; case-insensitive.
PROCESS_TALK = {
    r"\bthis session\b": "the session that wrote it",
    r"\b(?:tried and )?not kept\b": "what was tried: a 'Tried, and why not' list says why, or git keeps it",
    r"\bmain at [0-9a-f]{7,40}\b": "the commit a measurement was made on",
    r"\bcalls on it\b": "how a machine was used",
    r"\blent\b": "a machine lent for a check",
    r"\bdevice tool\b": "the tool that lent a machine",
    r"\bwe (?:found|tried|measured)\b": "narration of the work",
    r"\bfound since\b": "narration of the work",
    r"\b(?:second|third|fourth) pass\b": "the rounds of the work",
    r"\bno script kept\b|\bscripts? not kept\b": "a measurement nothing reproduces",
    r"\b\d{1,2}:\d{2}(?::\d{2})?(?:-\d{1,2}:\d{2}(?::\d{2})?)? UTC\b": "a time to the minute (a day is enough)",
}
PATTERN = re.compile("|".join(f"(?:{p})" for p in PROCESS_TALK), re.IGNORECASE)
WHOLE = (".md", ".sh", ".py", ".yaml", ".yml", ".cfg", ".http", ".sbatch", ".example", ".toml", ".txt")
PRODUCT = ("trainer", "serving", "contract")


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python source."""
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.append((first.lineno, value.value))
    return out


def findings(name: str, text: str, code: bool = False) -> list[str]:
    """'name:line: phrase' for each phrase of PROCESS_TALK in `text` (in its comments and docstrings when `code`)."""
    pieces = comments_and_docstrings(text) if code else list(enumerate(text.splitlines(), 1))
    out = []
    for line, piece in pieces:
        for k, row in enumerate(piece.splitlines() if code else [piece]):
            out += [f"{name}:{line + k}: {m.group(0)!r}" for m in PATTERN.finditer(row)]
    return out


def read_whole() -> list[Path]:
    files = [REPO / "README.md", REPO / "Makefile"]
    for folder in ("docs", "launch", "deploy", "bench"):
        files += sorted(p for p in (REPO / folder).rglob("*")
                        if p.is_file() and (p.suffix in WHOLE or p.suffix == "") and "__pycache__" not in p.parts)
    return files


def test_docs_scripts_and_comments_hold_no_process_talk() -> None:
    problems = []
    for path in read_whole():
        problems += findings(str(path.relative_to(REPO)), path.read_text(encoding="utf-8", errors="replace"))
    for folder in PRODUCT:
        for path in sorted((REPO / folder).rglob("*.py")):
            if "gen" in path.relative_to(REPO / folder).parts:
                continue  # generated protobuf code
            problems += findings(str(path.relative_to(REPO)), path.read_text(encoding="utf-8"), code=True)
    assert not problems, "process talk (" + "; ".join(sorted(set(PROCESS_TALK.values()))) + "):\n" + "\n".join(problems)


@pytest.mark.parametrize("text", [
    "Measured in this session on the GPU.", "Tried and not kept: a latch.", "before: main at ff8ddae",
    "Four calls on it, the machine otherwise idle", "the H200 lent for the check", "the device tool's machines",
    "We found that the queue grew.", "Found since: an answer before the body", "### Overload, third pass",
    "by hand, no script kept", "2026-11-27 13:42-13:44 UTC", "at 04:31 UTC on the next commit",
])
def test_each_kind_of_process_talk_is_caught(text: str) -> None:
    assert findings("doc.md", text)


def test_a_day_a_commit_command_and_code_strings_are_not_process_talk() -> None:
    prose = "2026-11-27, load average 1.2; `git archive COMMIT | tar -x`; the log line ends 'N s this run'."
    assert findings("doc.md", prose) == []
    code = ('"""Times a step."""\nprint(f"{s} s this session")  # the ETA from the mean step time\n'
            "# measured in this session\n")
    assert findings("x.py", code, code=True) == ["x.py:3: 'this session'"]
