"""The project describes itself, never how it was built: no talk of sessions, of what was "tried and not kept", of
"main at abc1234", of machines lent for a check or of what was carried to them, no times to the minute. A day stays
where a figure needs one.

Read: README.md, docs/, launch/, deploy/, bench/ and the Makefile whole; the comments and docstrings of the product
code (trainer/, serving/, contract/), whose strings (log lines, messages) are the product's own words; the comments,
docstrings and strings of tests/ (a test's strings are fixtures and expected messages, written by us), this file
aside: its examples are the talk it catches."""

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
    # "is not kept" says what the code does with something (a partial download), not what the work dropped
    r"\b(?:tried and )?(?<!is )(?<!are )not kept\b":
        "what was tried: a 'Tried, and why not' list says why, or git keeps it",
    r"\bmain at [0-9a-f]{7,40}\b": "the commit a measurement was made on",
    r"\bcalls on it\b": "how a machine was used",
    r"\blent\b": "a machine lent for a check",
    r"\bdevice tool\b": "the tool that lent a machine",
    r"\bwe (?:found|tried|measured)\b": "narration of the work",
    r"\bfound since\b": "narration of the work",
    r"\b(?:second|third|fourth) pass\b": "the rounds of the work",
    r"\bno script kept\b|\bscripts? not kept\b": "a measurement nothing reproduces",
    r"\b\d{1,2}:\d{2}(?::\d{2})?(?:-\d{1,2}:\d{2}(?::\d{2})?)? UTC\b": "a time to the minute (a day is enough)",
    # A node without internet is said in those words: what it needs is prepared on a machine with a network and
    # copied to it. Bare "carry" stays allowed (headers carry a trace; `--carry DIR` names a folder).
    r"\bgpu(?:-serve)?-carry\b": "the offline targets' old names (gpu-offline, gpu-serve-offline)",
    r"\b\d+ MiB cop(?:y|ies)\b|\bcopies of (?:at most )?\d+ MiB\b": "the size limit of a copy to a lent machine",
    r"\bcarr(?:y|ied) (?:both|every part|it with|(?:the )?(?:wheels|data|folders?|files))\b":
        "files carried to a lent machine",
    r"\bdevice image\b": "the image of a lent machine",
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


def comments_and_strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every string literal (docstrings and f-strings included) of a Python source."""
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    return [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type in kinds]


def findings(name: str, text: str, code: bool = False, strings: bool = False) -> list[str]:
    """'name:line: phrase' for each phrase of PROCESS_TALK in `text`: in its comments and docstrings when `code`, in
    its comments and all its strings when `strings`, else in the whole text."""
    if strings:
        pieces = comments_and_strings(text)
    elif code:
        pieces = comments_and_docstrings(text)
    else:
        pieces = list(enumerate(text.splitlines(), 1))
    out = []
    for line, piece in pieces:
        for k, row in enumerate(piece.splitlines() if code or strings else [piece]):
            out += [f"{name}:{line + k}: {m.group(0)!r}" for m in PATTERN.finditer(row)]
    return out


def read_whole() -> list[Path]:
    files = [REPO / "README.md", REPO / "Makefile"]
    for folder in ("docs", "launch", "deploy", "bench"):
        files += sorted(p for p in (REPO / folder).rglob("*")
                        if p.is_file() and (p.suffix in WHOLE or p.suffix == "") and "__pycache__" not in p.parts)
    return files


def read_code() -> list[Path]:
    """The product's Python sources, generated protobuf code aside (their comments and docstrings are read)."""
    return [p for folder in PRODUCT for p in sorted((REPO / folder).rglob("*.py"))
            if "gen" not in p.relative_to(REPO / folder).parts]


def read_tests() -> list[Path]:
    """The tests' Python sources but this one (their comments, docstrings and strings are read)."""
    return [p for p in sorted((REPO / "tests").rglob("*.py"))
            if "__pycache__" not in p.parts and p.resolve() != Path(__file__).resolve()]


def test_each_place_is_read() -> None:
    """The Makefile, every script and module of bench/, the product and the tests are in the scan."""
    read = {str(p.relative_to(REPO)) for p in [*read_whole(), *read_code(), *read_tests()]}
    for name in ("README.md", "Makefile", "docs/RESULTS.md", "bench/gpu_check.sh", "bench/gpu_serve_check.sh",
                 "bench/tfidf_baseline.py", "launch/demo.sh", "trainer/tasks/report.py", "tests/test_gpu_check.py",
                 "tests/test_gpu_serve_check.py", "tests/conftest.py"):
        assert name in read, name
    assert "tests/test_doc_wording.py" not in read


def test_docs_scripts_and_comments_hold_no_process_talk() -> None:
    problems = []
    for path in read_whole():
        problems += findings(str(path.relative_to(REPO)), path.read_text(encoding="utf-8", errors="replace"))
    for path in read_code():
        problems += findings(str(path.relative_to(REPO)), path.read_text(encoding="utf-8"), code=True)
    for path in read_tests():
        problems += findings(str(path.relative_to(REPO)), path.read_text(encoding="utf-8"), strings=True)
    assert not problems, "process talk (" + "; ".join(sorted(set(PROCESS_TALK.values()))) + "):\n" + "\n".join(problems)


@pytest.mark.parametrize("text", [
    "Measured in this session on the GPU.", "Tried and not kept: a latch.", "before: main at ff8ddae",
    "Four calls on it, the machine otherwise idle", "the H200 lent for the check", "the device tool's machines",
    "We found that the queue grew.", "Found since: an answer before the body", "### Overload, third pass",
    "by hand, no script kept", "2026-11-27 13:42-13:44 UTC", "at 04:31 UTC on the next commit",
    "run make gpu-carry first", "`make gpu-serve-carry` writes it", "each part fits a 64 MiB copy",
    "files reach it in copies of at most 64 MiB", "carry both folders there", "install the carried wheels",
    "carry it with the parts", "an arch the device image sets",
])
def test_each_kind_of_process_talk_is_caught(text: str) -> None:
    assert findings("doc.md", text)


def test_a_day_a_commit_command_and_code_strings_are_not_process_talk() -> None:
    prose = ("2026-11-27, load average 1.2; `git archive COMMIT | tar -x`; the log line ends 'N s this run'; the "
             "headers carry one, probes carry none; `--carry DIR`; 64 MiB in flight, +0.64 MiB; make gpu-offline; a "
             "file that is not the pinned one is not kept; lines that are not kept.")
    assert findings("doc.md", prose) == []
    code = ('"""Times a step."""\nprint(f"{s} s this session")  # the ETA from the mean step time\n'
            "# measured in this session\n")
    assert findings("x.py", code, code=True) == ["x.py:3: 'this session'"]


def test_a_tests_strings_are_read_as_well_as_its_comments() -> None:
    source = ('"""Checks the joined parts."""\nrun("--only", "setup")  # the wheels, as make gpu-offline writes them\n'
              'expected = f"{out}: install the carried wheels"\nLIMIT = 540  # one run on a lent machine\n')
    assert findings("t.py", source, strings=True) == ["t.py:3: 'carried wheels'", "t.py:4: 'lent'"]
    assert findings("t.py", source, code=True) == ["t.py:4: 'lent'"]  # the product's strings are its own words
