"""Help that reads right: every option of every command line has help of its own that neither stops mid-sentence nor
starts in the middle of another option's; the config comments that become help (contract/comments.py: the
server's --help, `python -m trainer config`) go to the field they were written for; and every console script (and its
`python -m` form) answers --version at once."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import os
import re
import subprocess
import sys
import textwrap
import tokenize
import tomllib
import typing
from pathlib import Path

import pytest
from clis import all_clis
from procs import REPO

import contract.version
from contract.comments import comments
from serving.config import ServerConfig
from trainer.config.schema import RunConfig

# A help that ends on one of these words (or on , ; : ( - ...) stops mid-sentence: "...the probes should: what".
DANGLING = frozenset("a an the and or but nor of by for from than as which whose what when where while if because "
                     "so then its their our your is are be per via every these those not".split())
# A help that starts with one of these continues a sentence that began elsewhere: "...and is disconnected".
CONTINUES = frozenset("and or but nor then so while whereas because else otherwise and/or".split())
DEFAULT = re.compile(r"\s*\(default[: ][^()]*\)$")  # the "(default: X)" that the server and the client append


def meaning(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help as --help prints it (%(default)s expanded), without an appended "(default: X)"."""
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    return DEFAULT.sub("", " ".join(text.split())).strip()


def help_problems(parser: argparse.ArgumentParser) -> list[str]:
    """One line per option whose help is missing, stops mid-sentence, starts mid-sentence, or is about another
    option (starts with its name)."""
    actions = [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
    names = {a: {a.dest, *(s.lstrip("-").replace("-", "_") for s in a.option_strings)} for a in actions}
    out = []
    for action in actions:
        label = "/".join(action.option_strings) or action.dest
        text = meaning(parser, action)
        if not text:
            out.append(f"{label}: no help")
            continue
        words = text.split()
        last = re.sub(r"^\W+|\W+$", "", words[-1]).lower()
        if re.search(r"([,;:(\-]|\.\.\.|…)$", text) or (text[-1].isalpha() and last in DANGLING):
            out.append(f"{label}: stops mid-sentence: ...{text[-60:]!r}")
        first = words[0].strip("`'\"").lstrip("-").replace("-", "_")
        if text.startswith(("...", "…")) or first.lower() in CONTINUES:
            out.append(f"{label}: starts mid-sentence: {text[:60]!r}...")
        # Named as an option is written (--flag, snake_case, `name`), another option is the help's subject.
        others = set().union(*(names[a] for a in actions if a is not action)) - names[action] - {""}
        if first in others and re.match(r"--|`|\w+_", words[0]):
            out.append(f"{label}: starts with another option's name: {text[:60]!r}...")
    return out


CLIS = all_clis()


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_every_option_has_help_of_its_own_that_reads_as_a_whole(cli: str) -> None:
    problems = help_problems(CLIS[cli])
    assert not problems, f"{cli} --help:\n" + "\n".join(problems)


def test_the_checks_catch_help_that_stops_or_starts_mid_sentence() -> None:
    """What the old comment parser printed for --health-port, --max-ping-strikes and --drain-delay-s, and a help
    that speaks of another option."""
    p = argparse.ArgumentParser()
    p.add_argument("--health-port", help="a plain-text listener for probes: what (default: none)")
    p.add_argument("--max-ping-strikes", help="...and is disconnected after this many faster pings")
    p.add_argument("--drain-delay-s", help="requests are still served this long; then:")
    p.add_argument("--workers", help="health_port listens in the parent")
    p.add_argument("--grace-s", help="in-flight requests get this long to finish (default: 10.0)")
    assert [line.split(":")[0] for line in help_problems(p)] == [
        "--health-port", "--max-ping-strikes", "--drain-delay-s", "--workers"]


# ------------------------------------------------------------------------------------------------- --version

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
# What --version must not load: the training stack, the inference runtime.
HEAVY = ("torch", "deepspeed", "onnxruntime", "onnx")


@pytest.mark.parametrize("form", ["console script", "python -m"])
@pytest.mark.parametrize("script", sorted(PROJECT["scripts"]))
def test_every_command_line_prints_its_version_without_loading_torch_or_onnxruntime(script: str, form: str) -> None:
    """`sentiment-server --version` prints "sentiment-server VERSION" (the package's, as installed) and exits 0
    with neither torch nor onnxruntime imported: PYTHONPROFILEIMPORTTIME lists every module the process imported."""
    module = PROJECT["scripts"][script].split(":")[0].removesuffix(".__main__")
    cmd = [str(Path(sys.executable).parent / script)] if form == "console script" else [sys.executable, "-m", module]
    out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    assert (out.returncode, out.stdout) == (0, f"{script} {PROJECT['version']}\n"), out.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "argparse" in imported  # the import log is there to read
    assert not sorted(m for m in imported if m.split(".")[0] in HEAVY)


def test_a_source_tree_that_was_never_installed_says_so_instead_of_a_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contract.version, "DISTRIBUTION", "transfer-sentiment-never-installed")
    assert contract.version.version_line("sentiment-client") == \
        "sentiment-client (not installed: no version; `pip install .` gives it one)"


# ------------------------------------------------------------------------------------------- config comments


def config_classes() -> list[type]:
    """ServerConfig and every section of RunConfig: the classes whose comments are help."""
    out, todo = [ServerConfig], [RunConfig]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += [t for t in typing.get_type_hints(cls).values() if dataclasses.is_dataclass(t) and t not in out]
    return out


def layout(cls: type) -> list[tuple[str, str, str]]:
    """The class body read row by row, apart from contract/comments.py: ("field", name, its own comment),
    ("comment", row, text) for a full-line comment of the body, ("break", "", "") for anything else (a blank row, a
    heading, code)."""
    src = textwrap.dedent(inspect.getsource(cls))
    fields = {f.name for f in dataclasses.fields(cls)}
    own: dict[int, list[str]] = {}
    full: dict[int, str] = {}
    for t in tokenize.generate_tokens(io.StringIO(src).readline):
        if t.type == tokenize.COMMENT:
            text = t.string.lstrip("#").strip()
            (full.__setitem__(t.start[0], text) if t.line.strip().startswith("#") else
             own.setdefault(t.start[0], []).append(text))
    rows, out, field_row = src.splitlines(), [], None
    for n, row in enumerate(rows, 1):
        m = re.match(r" {4}(\w+)\s*:", row)
        if m and m.group(1) in fields:
            field_row = n
            out.append(("field", m.group(1), " ".join(own.get(n, []))))
        elif n in full and row.startswith("    #") and not row.startswith("     "):
            heading = len(full[n].split()) <= 2 and not re.search(r"[.,:;=()]", full[n])
            out.append(("break", "", "") if heading else ("comment", str(n), full[n]))
        elif field_row and n in own and out and out[-1][0] == "field" and row.startswith("     "):
            out[-1] = ("field", out[-1][1], (out[-1][2] + " " + " ".join(own[n])).strip())  # a field's later row
        else:
            out.append(("break", "", ""))
    return out


@pytest.mark.parametrize("cls", config_classes(), ids=lambda c: c.__name__)
def test_each_comment_is_the_help_of_the_field_it_was_written_for(cls: type) -> None:
    """A field's help starts with the comment on its own line; a block of comment lines between two fields is one
    field's, whole (it continues the field above or describes the field below), never split or lost."""
    notes = comments(cls)
    rows = layout(cls)
    problems = []
    for kind, name, own in rows:
        if kind == "field" and own and not notes.get(name, "").startswith(own):
            problems.append(f"{name}: its help does not start with its own comment {own[:40]!r}: "
                            f"{notes.get(name, '')[:80]!r}")
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j][0] == "comment":
            j += 1
        if j > i:
            block = " ".join(text for _, _, text in rows[i:j])
            holders = [f for f, text in notes.items() if block in text]
            if len(holders) != 1:
                problems.append(f"comment rows {rows[i][1]}-{rows[j - 1][1]} ({block[:50]!r}...) are split between "
                                f"fields or lost: whole in {holders or 'none'}")
        i = max(j, i + 1)
    assert not problems, f"{cls.__name__}:\n" + "\n".join(problems)


# The parser's rules on classes written for them (inspect reads their source from this file).


@dataclasses.dataclass
class _Beside:
    host: str = ""  # bind address; loopback unless asked otherwise
    health_port: int = 0  # a second listener: what Kubernetes'
    # Probes should target. It speaks no TLS, so
    # the probes need none
    # Processes
    workers: int = 1  # server processes
    # Every limit is per worker

    # A comment above a field that has none of its own, after a blank row.
    max_len: int = 512


@dataclasses.dataclass
class _Above:
    train_lines: int = 10  # lines sampled
    # A sequence is cut to this many ids. The one setting
    # of the cut.
    max_len: int = 512


@dataclasses.dataclass
class _Orphan:
    host: str = ""

    # A comment above a field that has its own: which one is meant?
    port: int = 0  # gRPC port


def test_a_continuation_that_starts_with_a_capital_stays_with_its_field() -> None:
    assert comments(_Beside) == {
        "host": "bind address; loopback unless asked otherwise",
        "health_port": "a second listener: what Kubernetes' Probes should target. It speaks no TLS, so the probes "
                       "need none",
        "workers": "server processes Every limit is per worker",
        "max_len": "A comment above a field that has none of its own, after a blank row."}


def test_comments_above_a_field_without_its_own_describe_it() -> None:
    assert comments(_Above) == {"train_lines": "lines sampled",
                                "max_len": "A sequence is cut to this many ids. The one setting of the cut."}


def test_a_comment_that_belongs_to_no_field_is_an_error_naming_its_row() -> None:
    with pytest.raises(ValueError, match=r"_Orphan, row 5 of its source: the comment 'A comment above a field"):
        comments(_Orphan)
