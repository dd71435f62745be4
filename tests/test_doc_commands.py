"""Every command the docs show is checked against the command line it names, so that a renamed flag, subcommand,
script, make target or config key breaks this test instead of a reader's copy-paste.

Read from README.md, launch/README.md, docs/*.md (fenced blocks, and inline `python -m ...`-style spans) and the
comments and `run:` steps of deploy/: each command is parsed by the real parser (the trainer's subcommands, the
server, the client, the bench and deploy scripts, DeepSpeed's launcher), its `--set` keys and values resolved by
`python -m trainer config`, its make targets and variables looked up in the Makefile, its test paths, launch
scripts and kustomize folders found on disk, and a `kubectl create` run with --dry-run=client. Values may be
placeholders (ARTIFACT, N, "..."): parsing checks names, not types. A fenced block that is only an illustration (a
two-column layout, a scheduler's batch file) is marked by `<!-- illustration: why -->` on the line before it.
What runs for real, where cheap: `python -m trainer params`, `make help`, `python -m trainer config` (every --set).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from clis import deepspeed_parser, module_parser, script_parser, trainer_parser, trainer_subcommands
from procs import REPO

MARKDOWN = [REPO / "README.md", REPO / "launch" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DEPLOY = sorted(p for p in (REPO / "deploy").rglob("*") if p.suffix in (".yaml", ".yml"))
ILLUSTRATION = re.compile(r"<!--\s*illustration\b")
KUBECTL = Path(os.environ.get("TS_DEPLOY_TOOLS", REPO / ".venv-deploy" / "bin")) / "kubectl"
PYTHONS = {"python", "python3", ".venv/bin/python", "$(BIN)/python"}
# A span of prose is a command when it starts with one of these (after VAR=value assignments).
INLINE_HEADS = (*PYTHONS, "deepspeed", "bash", "srun", "make", "transfer-sentiment", "sentiment-server",
                "sentiment-client", "kubectl", "docker", "podman", "podman-compose", "launch/pretrain.sh",
                "launch/finetune.sh",
                "launch/serve.sh", "launch/demo.sh")
# Shell tools a block may use around our commands; nothing of ours to check in them.
UTILITIES = {"grep", "head", "echo", "cd", "du", "mkdir", "rsync", "openssl", "cat", "ls", "export", "done", "fi"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]+$")  # ARTIFACT, BUNDLE, SUBCOMMAND: a value the reader fills in


@dataclass
class Command:
    where: str  # file:line
    text: str  # as written, continuations joined
    in_block: bool  # from a fenced block (an unknown command is then a problem) or inline (then not a command)


# ------------------------------------------------------------------------------------------------ extraction


def segments(line: str) -> list[str]:
    """A shell line cut at unquoted `;`, `&&`, `||` and `|` (not inside quotes or $( )), `for ... do X; done`
    reduced to X."""
    out, cur, quote, depth, i = [], "", "", 0, 0
    while i < len(line):
        c = line[i]
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "(" and i and line[i - 1] in "$<":
            depth += 1
        elif c == ")" and depth:
            depth -= 1
        elif not depth and (line.startswith(("&&", "||"), i) or c in ";|"):
            out.append(cur)
            cur = ""
            i += 2 if line.startswith(("&&", "||"), i) else 1
            continue
        cur += c
        i += 1
    out.append(cur)
    parts = [s.strip() for s in out if s.strip()]
    return [re.sub(r"^(do|then)\s+", "", s) for s in parts if not re.match(r"^(for|while|if)\s", s)]


def shell_lines(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """(line number, command) for a block's lines: comments dropped, `\\` continuations joined."""
    pending, first = "", 0
    for n, raw in lines:
        code = raw.rstrip()
        if not pending and code.lstrip().startswith("#"):
            continue
        first = first or n
        if code.endswith("\\"):
            pending += code[:-1] + " "
            continue
        text = _strip_comment(pending + code)
        pending = ""
        if text.strip():
            yield first, text.strip()
        first = 0


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a # outside quotes, after a space), as the shell reads it."""
    quote = ""
    for i, c in enumerate(line):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def markdown_commands(path: Path) -> Iterator[Command]:
    rows = path.read_text(encoding="utf-8").splitlines()
    name = path.relative_to(REPO)
    i = 0
    while i < len(rows):
        fence = re.match(r"^\s*```(\w*)", rows[i])
        if fence:
            lang, start = fence.group(1), i
            i += 1
            body = []
            while i < len(rows) and not rows[i].strip().startswith("```"):
                body.append((i + 1, rows[i]))
                i += 1
            i += 1
            illustration = start and any(ILLUSTRATION.search(rows[k]) for k in range(max(0, start - 2), start))
            if illustration or lang not in ("", "bash", "sh", "shell"):
                continue
            for n, line in shell_lines(body):
                for seg in segments(line):
                    yield Command(f"{name}:{n}", seg, in_block=lang != "")
            continue
        for span in re.findall(r"`([^`]+)`", rows[i]):
            if _head(span.split()) in INLINE_HEADS:
                for seg in segments(span):
                    yield Command(f"{name}:{i + 1}", seg, in_block=False)
        i += 1


def deploy_commands(path: Path) -> Iterator[Command]:
    """Commands in a manifest's comments (`kubectl ...` lines, inline spans) and a workflow's `run:` steps."""
    name = path.relative_to(REPO)
    rows = path.read_text(encoding="utf-8").splitlines()
    in_run, indent, run_lines = False, 0, []
    for n, row in enumerate(rows, 1):
        comment = re.match(r"^\s*#\s?(.*)$", row)
        if comment:
            text = comment.group(1)
            if _head(text.split()) in INLINE_HEADS:
                yield Command(f"{name}:{n}", text.strip(), in_block=True)
            for span in re.findall(r"`([^`]+)`", text):
                if _head(span.split()) in INLINE_HEADS:
                    yield Command(f"{name}:{n}", span, in_block=False)
            continue
        step = re.match(r"^(\s*)(- )?run:\s*(\|)?\s*(.*)$", row)
        if step:
            if step.group(3):  # a literal block: the rows indented deeper than the `run:` key
                in_run, indent, run_lines = True, len(step.group(1)) + len(step.group(2) or ""), []
            else:
                yield Command(f"{name}:{n}", step.group(4), in_block=True)
            continue
        if in_run and (not row.strip() or len(row) - len(row.lstrip()) > indent):
            run_lines.append((n, row))
            continue
        if in_run:
            in_run = False
            for m, line in shell_lines(run_lines):
                for seg in segments(line):
                    yield Command(f"{name}:{m}", seg, in_block=True)
    if in_run:
        for m, line in shell_lines(run_lines):
            for seg in segments(line):
                yield Command(f"{name}:{m}", seg, in_block=True)


def _head(tokens: list[str]) -> str:
    """The command word after VAR=value assignments; `python -u x` counts as python."""
    for t in tokens:
        if not re.match(r"^[A-Z_][A-Z0-9_]*=", t):
            return t
    return ""


def all_commands() -> dict[str, list[Command]]:
    out = {str(p.relative_to(REPO)): list(markdown_commands(p)) for p in MARKDOWN}
    out.update({str(p.relative_to(REPO)): list(deploy_commands(p)) for p in DEPLOY})
    return out


# --------------------------------------------------------------------------------------------------- checks


def lenient_parse(parser: argparse.ArgumentParser, args: list[str]) -> tuple[argparse.Namespace | None, str]:
    """Parse `args` by `parser` for names only: every option and choice must exist, values are not converted and
    nothing is required (a documented command may leave some out). (namespace, "") or (None, argparse's message)."""
    args = [a for a in args if a not in ("...", "…", "-h", "--help")]  # --help: the rest must still parse
    named = parser._option_string_actions.get(args[-1]) if args else None
    if named is not None and named.nargs is None and named.option_strings[0] != "--set":
        args = args[:-1]  # a flag named at the end without its value: prose naming the option ("`export --check`")
    saved = [(a, a.type, a.required) for a in parser._actions]
    abbrev, parser.allow_abbrev = parser.allow_abbrev, False  # a documented flag is spelled out in full
    for a in parser._actions:
        a.type, a.required = None, False

    def error(message: str) -> None:
        raise ValueError(message)

    parser.error = error  # type: ignore[method-assign]
    try:
        return parser.parse_args(args), ""
    except ValueError as e:
        return None, str(e)
    finally:
        del parser.error
        parser.allow_abbrev = abbrev
        for a, tp, req in saved:
            a.type, a.required = tp, req


def config_problem(ns: argparse.Namespace) -> str:
    """Resolve the command's --preset/--set as `python -m trainer config` does (in-process); "" if it resolves."""
    from trainer.__main__ import main

    if getattr(ns, "config", None) or not getattr(ns, "overrides", None):
        return ""
    argv = ["config", "--preset", ns.preset or ns.default_preset]
    for kv in ns.overrides:
        argv += ["--set", kv]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    return "" if rc == 0 else f"`python -m trainer {' '.join(argv)}` says: {err.getvalue().strip()}"


def check_trainer(sub: str, args: list[str]) -> str:
    if PLACEHOLDER.match(sub):
        return ""
    if sub not in trainer_subcommands():
        return f"no subcommand {sub!r} (python -m trainer has {', '.join(trainer_subcommands())})"
    ns, error = lenient_parse(trainer_parser(sub), args)
    return f"python -m trainer {sub}: {error}" if error else config_problem(ns)


def check_script(path: str, args: list[str]) -> str:
    """A script of ours with its arguments: launch/*.sh (what it runs), bench/ and deploy/ Python scripts."""
    if not (REPO / path).is_file():
        return f"{path}: no such file"
    launched = {"launch/pretrain.sh": "pretrain", "launch/finetune.sh": "finetune"}
    if path in launched:
        return check_trainer(launched[path], args)
    if path == "launch/serve.sh":
        return _parsed(module_parser("serving.server"), args, path)
    if path.endswith(".py"):
        return _parsed(script_parser(REPO / path), args, path)
    if path.startswith("bench/") and path.endswith(".sh"):
        # Our bench shell scripts parse their options in one `case`: each option a doc passes must be a pattern there.
        text = (REPO / path).read_text(encoding="utf-8")
        unknown = [a for a in args if a.startswith("--") and f"{a.split('=')[0]})" not in text
                   and f"{a.split('=')[0]}|" not in text and f"|{a.split('=')[0]}" not in text]
        return f"{path}: unknown option(s) {unknown}" if unknown else ""
    return "" if not args else f"{path} takes no arguments"


def _parsed(parser: argparse.ArgumentParser, args: list[str], name: str) -> str:
    _, error = lenient_parse(parser, args)
    return f"{name}: {error}" if error else ""


def check_python(args: list[str]) -> str:
    while args and args[0] in ("-u", "-X", "-B"):
        args = args[1:]
    if args[:2] == ["-m", "trainer"]:
        return check_trainer(args[2] if len(args) > 2 else "", args[3:])
    if args[:1] == ["-m"] and args[1] in ("serving.server", "serving.client"):
        return _parsed(module_parser(args[1]), args[2:], args[1])
    if args[:2] == ["-m", "pytest"]:
        return check_pytest(args[2:])
    if args and not args[0].startswith("-"):
        return check_script(args[0], args[1:])
    return f"python {' '.join(args[:2])}: not a command of this project"


def check_pytest(args: list[str]) -> str:
    for a in args:
        if a.startswith("tests/"):
            file, _, name = a.partition("::")
            if not (REPO / file).is_file():
                return f"{file}: no such test file"
            if name and f"def {name.split('[')[0]}" not in (REPO / file).read_text(encoding="utf-8"):
                return f"{a}: no such test"
    return ""


def check_deepspeed(args: list[str]) -> str:
    ns, error = lenient_parse(deepspeed_parser(), args)
    if error or ns.user_script is None:  # no script: prose naming the launcher's flags
        return f"deepspeed: {error}" if error else ""
    return check_script(ns.user_script, ns.user_args)


def check_sbatch(args: list[str]) -> str:
    """`sbatch [SBATCH OPTIONS] launch/train.sbatch pretrain|finetune OPTIONS`: the options are the subcommand's."""
    while args and args[0].startswith("-"):
        args = args[1:]
    if args[:1] != ["launch/train.sbatch"]:
        return f"sbatch {args[:1]}: not ours"
    if not (REPO / args[0]).is_file():
        return f"{args[0]}: no such file"
    if len(args) < 2 or args[1] not in ("pretrain", "finetune"):
        return f"{args[0]}: takes pretrain or finetune, then its options"
    return check_trainer(args[1], args[2:])


def makefile() -> tuple[set[str], set[str]]:
    """The Makefile's targets and variables."""
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w.-]+):(?!=)", text, re.M))
    variables = set(re.findall(r"^(?:export\s+)?([A-Z_]+)\s*[?:]?=", text, re.M))
    return targets, variables


def check_make(args: list[str]) -> str:
    targets, variables = makefile()
    for a in args:
        if "=" in a:
            if a.split("=")[0] not in variables:
                return f"make: no variable {a.split('=')[0]} in the Makefile"
        elif a.startswith("-"):
            continue
        elif a not in targets:
            return f"make: no target {a!r} in the Makefile"
    return ""


COMPOSE_COMMANDS = {"up", "down", "start", "stop", "restart", "ps", "logs", "build", "pull", "config"}


def check_compose(args: list[str]) -> str:
    """`docker compose [-f FILE] [-p NAME] COMMAND ...` (or `podman-compose ...`): the file exists (compose.yaml at the
    repository's root unless -f names another) and the command is one of compose's."""
    files, command, i = [], "", 0
    while i < len(args) and not command:
        if args[i] in ("-f", "--file", "-p", "--project-name"):
            files += [args[i + 1]] if args[i] in ("-f", "--file") else []
            i += 2
            continue
        command = args[i] if not args[i].startswith("-") else ""
        i += 1
    missing = [f for f in files or ["compose.yaml"] if not (REPO / f).is_file()]
    if missing:
        return f"{missing[0]}: no such compose file in the repository"
    return "" if command in COMPOSE_COMMANDS else f"compose {command or '(no command)'}: not a compose command"


def check_container_run(args: list[str]) -> str:
    """`docker run ... transfer-sentiment:TAG [BUNDLE SERVER FLAGS]`: the flags after the image are the server's;
    `docker run ... transfer-sentiment-train:TAG SUBCOMMAND ...`: the trainer's (Containerfile.train); `docker
    compose ...`: check_compose."""
    image = next((i for i, a in enumerate(args) if a.startswith("transfer-sentiment:")), None)
    if args[:1] == ["compose"]:
        return check_compose(args[1:])
    if args[:1] == ["push"]:
        return ""  # a registry's business: nothing of ours in it
    train = next((i for i, a in enumerate(args) if a.startswith("transfer-sentiment-train:")), None)
    if args[:1] == ["run"] and train is not None:
        rest = args[train + 1:]
        return check_trainer(rest[0], rest[1:]) if rest else ""
    if args[:1] != ["run"] or image is None:
        return f"not a run of the server's image: {' '.join(args[:3])}"
    return _parsed(module_parser("serving.server"), args[image + 1:], "the image's server") if args[image + 1:] else ""


def check_kubectl(text: str, args: list[str]) -> str:
    if args[:1] == ["-n"]:
        args = args[2:]
    if "#" in args:  # a comment after the command
        args = args[:args.index("#")]
    if args[:2] == ["apply", "-k"]:
        return "" if (REPO / args[2] / "kustomization.yaml").is_file() else f"{args[2]}: no kustomization.yaml"
    if args[:2] == ["rollout", "restart"]:
        kind, _, name = args[2].partition("/")
        found = any(re.search(rf"kind: {kind.capitalize()}\b[\s\S]*?name: {re.escape(name)}\b", p.read_text())
                    for p in (REPO / "deploy").glob("*.yaml"))
        return "" if found else f"no {kind} named {name} in deploy/"
    if args[:1] == ["create"]:
        if not KUBECTL.exists():
            return ""  # run where the deployment tools are (make deploy-venv); the other checks need none
        with tempfile.TemporaryDirectory() as folder:
            _files_for(args, Path(folder))
            out = subprocess.run(["bash", "-c", f"{text.replace('kubectl', str(KUBECTL), 1)} --dry-run=client -o name"],
                                 cwd=folder, capture_output=True, text=True, timeout=60)
        return "" if out.returncode == 0 else f"kubectl: {out.stderr.strip()}"
    if args[:1] in (["cp"], ["exec"]) and (len(args) == 1 or args[1] == "…"):
        return ""  # the verb named in prose, not a command
    if args[:1] == ["cp"] and len(args) == 3:  # a version copied to the loader under a name no server reads
        pod, _, dest = args[2].partition(":")
        return "" if dest.startswith("/models/") and Path(dest).name.startswith(".") else \
            f"kubectl cp to {args[2]}: not a temporary name under the loader's /models"
    if args[:1] == ["exec"] and args[2:5] == ["--", "mv", "-T"] and len(args) == 7:  # then renamed into place
        source, target = Path(args[5]), Path(args[6])
        ok = source.parent == target.parent and str(source).startswith("/models/") and target.name.isdigit()
        return "" if ok else f"kubectl exec … mv -T {source} {target}: not a rename into a version of one model"
    if args[:1] == ["logs"] and args[1:2] and args[1].startswith("deployment/"):
        name = args[1].partition("/")[2]
        found = any(re.search(rf"kind: Deployment\b[\s\S]*?name: {re.escape(name)}\b", p.read_text())
                    for p in (REPO / "deploy").rglob("*.yaml"))
        return "" if found else f"no Deployment named {name} in deploy/"
    if args[:2] == ["apply", "-f"]:
        return "" if (REPO / args[2]).is_file() else f"{args[2]}: no such file"
    return f"kubectl {' '.join(args[:2])}: not a command this test checks"


def _files_for(args: list[str], folder: Path) -> None:
    """The files a `kubectl create secret` names (--cert/--key: a self-signed pair; --from-file: a token)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    named = dict(a[2:].split("=", 1) for a in args if re.match(r"--(cert|key|from-file)=", a))
    if "cert" in named:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
                .sign(key, hashes.SHA256()))
        (folder / named["cert"]).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / named["key"]).write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                                serialization.PrivateFormat.PKCS8,
                                                                serialization.NoEncryption()))
    source = named.get("from-file", "").split("=")[-1]
    if source and not source.startswith("<("):
        (folder / source).write_text("0123456789abcdef0123456789abcdef", encoding="utf-8")


# Standard tools, not ours to check: they feed or read our commands in a documented pipeline (`cut -f2 file |
# python -m trainer ...`) or fetch a tree to measure against (`git archive REV | tar -x`).
SHELL_TOOLS = ("cat", "cut", "head", "tail", "paste", "echo", "printf", "jq", "sort", "git", "tar", "mkdir")


def without_redirections(tokens: list[str]) -> list[str]:
    """The tokens of a command less its shell redirections (`> log`, `< texts.txt`, `2>&1`, `>> log`)."""
    out, skip = [], False
    for t in tokens:
        if skip:
            skip = False
        elif re.fullmatch(r"\d?(>>?|<)", t):
            skip = True  # the file comes next
        elif not re.fullmatch(r"\d?(>>?|<)(&\d|\S+)", t):
            out.append(t)
    return out


def check(command: Command) -> str:
    """"" when the command checks out, else what is wrong."""
    if re.match(r"^\w+=\(", command.text):
        return ""  # a shell array being built (the CI step's optional flags); its flags are checked where used
    try:
        tokens = shlex.split(command.text)
    except ValueError as e:
        return f"cannot be read as a shell command ({e})" if command.in_block else ""
    if "|" in tokens:  # a pipeline: each command of it checks out on its own
        parts, cut = [], 0
        for i, t in enumerate([*tokens, "|"]):
            if t == "|":
                parts.append(tokens[cut:i])
                cut = i + 1
        problems = [p for part in parts if (p := check(dataclasses.replace(command, text=shlex.join(part))))]
        return "; ".join(problems)
    tokens = without_redirections(tokens)
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        tokens = tokens[1:]
    if not tokens:
        return ""
    head, args = tokens[0], tokens[1:]
    if head in SHELL_TOOLS and command.text != head:
        return ""  # a standard tool (SHELL_TOOLS)
    if not command.in_block and not args and head != "make":
        return ""  # a program named in prose (`python3`, `transfer-sentiment`), not a command
    if head in PYTHONS:
        return check_python(args)
    if head == "srun":
        while args and args[0].startswith("-"):  # srun's own options (--container-image=..., -N2)
            args = args[1:]
        return check_python(args[1:]) if args and args[0] in PYTHONS else f"srun {args[:1]}: not ours"
    if head == "sbatch":
        return check_sbatch(args)
    if head == "transfer-sentiment":
        return check_trainer(args[0] if args else "", args[1:])
    if head in ("sentiment-server", "sentiment-client"):
        return _parsed(module_parser(head.replace("sentiment-", "serving.")), args, head)
    if head == "deepspeed":
        return check_deepspeed(args)
    if head == "bash" and args and args[0] != "-c":
        return check_script(args[0], args[1:])
    if re.match(r"(launch|bench|deploy)/[\w.-]+\.(sh|py)$", head):
        return check_script(head, args)
    if head == "make":
        return check_make(args)
    if head in ("docker", "podman"):
        return check_container_run(args)
    if head == "podman-compose":
        return check_compose(args)
    if head == "kubectl":
        return check_kubectl(command.text, args)
    if head == "cp":
        missing = [a for a in args[:-1] if not a.startswith("-") and not (REPO / a).exists()]
        return f"cp: {missing[0]}: no such file in the repository" if missing else ""
    if head == "curl":
        return check_curl(args)
    if head in UTILITIES or not command.in_block:
        return ""
    return f"{head}: not a command this test knows (mark the block <!-- illustration: why -->, or label it text)"


def check_curl(args: list[str]) -> str:
    """A call of the server's HTTP API: its path is one of the server's routes, its -d body is JSON."""
    routes = re.findall(r'at\("(/[^"]*)"', (REPO / "serving" / "protocols" / "http" / "routes.py").read_text())
    url = next(a for a in reversed(args) if not a.startswith("-"))
    path = "/" + url.split("://")[-1].split("/", 1)[-1].split("?")[0]
    pattern = lambda route: re.fullmatch(re.sub(r"\{\w+\}", "[^/]+", route), path)  # noqa: E731
    if not any(pattern(r) for r in routes):
        return f"curl: {path} is not a path the server serves ({routes})"
    body = next((args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-d", "--data")), None)
    try:
        json.loads(body) if body is not None else None
    except ValueError as e:
        return f"curl: its body is not JSON: {e}"
    return ""


COMMANDS = all_commands()


@pytest.mark.parametrize("doc", sorted(COMMANDS))
def test_every_documented_command_parses_against_the_real_command_line(doc: str) -> None:
    problems = [f"{c.where}: {c.text[:90]}\n    -> {p}" for c in COMMANDS[doc] if (p := check(c))]
    assert not problems, "\n".join(problems)


def test_the_commands_are_found() -> None:
    """The extraction itself: enough commands from each main document that an empty read cannot pass."""
    counts = {doc: len(cmds) for doc, cmds in COMMANDS.items()}
    assert counts["README.md"] >= 20 and counts["launch/README.md"] >= 10, counts
    assert counts["docs/BENCHMARKS.md"] >= 15 and counts["docs/RESULTS.md"] >= 5, counts
    assert counts["deploy/ci/export-check.yml"] >= 4, counts
    # The markers stay few: an illustration is the exception.
    marked = sum(len(ILLUSTRATION.findall(p.read_text(encoding="utf-8"))) for p in MARKDOWN)
    assert marked <= 6, f"{marked} blocks marked as illustrations"


@pytest.mark.parametrize("text,problem", [
    ("python -m trainer pretrain --preset tiny --stop_at_step 3 --out runs/x", "unrecognized arguments: --stop_at"),
    ("python -m trainer pretrian --preset tiny", "no subcommand 'pretrian'"),
    ("python -m trainer finetune --preset tiny --set finetune.dropuot=0.1", "finetune.dropuot"),
    ("python -m trainer finetune --preset tiny --set finetune.dropout=2", "finetune.dropout"),
    ("python -m trainer params --preset huge", "invalid choice: 'huge'"),
    ("deepspeed --num_gpu 2 launch/pretrain.sh --preset demo", "deepspeed"),
    ("deepspeed launch/pretrain.sh --preset demo --out x --resumes", "unrecognized arguments: --resumes"),
    ("python -m serving.server BUNDLE --max-text 16", "unrecognized arguments"),
    ("launch/serve.sh runs/demo/bundle --metric-port 1", "unrecognized arguments"),
    (".venv/bin/python bench/soak.py --bundle B --second 3", "unrecognized arguments"),
    (".venv/bin/python bench/no_such_bench.py", "no such file"),
    ("make imagee", "no target 'imagee'"),
    ("make image IMAGES=x", "no variable IMAGES"),
    ("docker run --rm transfer-sentiment:cpu /mnt/models --max-textz 3", "unrecognized arguments"),
    ("kubectl apply -k deploy/nothing/", "no kustomization.yaml"),
    ("kubectl -n ns cp runs/demo/bundle pod:/models/m/2", "not a temporary name"),
    ("kubectl exec pod -- mv -T /models/m/.incoming-2 /models/n/2", "not a rename into a version of one model"),
    ("kubectl logs deployment/no-such-server", "no Deployment named no-such-server"),
    ("podman run --rm transfer-sentiment-train:cpu params --presett lab", "unrecognized arguments"),
    ("docker compose upp -d", "compose upp: not a compose command"),
    ("podman-compose -f deploy/compose.yaml up -d", "deploy/compose.yaml: no such compose file"),
    ("sbatch --nodes=4 launch/train.sbatch pretrain --preset lab --outt x", "unrecognized arguments"),
    ("sbatch launch/train.sbatch export runs/x", "takes pretrain or finetune"),
    ("srun --container-image=x python -m trainer pretrainn", "no subcommand 'pretrainn'"),
    (".venv/bin/python -m pytest tests/test_help.py::test_no_such_thing", "no such test"),
    ("cut -f2 x.csv | python -m trainer predict B --data - --formatt jsonl", "unrecognized arguments: --formatt"),
    ("make demoo > log 2>&1", "no target 'demoo'"),
    ("frobnicate --all | python -m trainer params --preset lab", "frobnicate: not a command this test knows"),
])
def test_a_renamed_flag_subcommand_key_or_target_breaks_the_check(text: str, problem: str) -> None:
    assert problem in check(Command("doc.md:1", text, in_block=True))


def test_pipelines_and_redirections_are_checked_command_by_command() -> None:
    good = "cut -d, -f2 x.csv | python -m trainer predict B --data - --out - < in.txt > out.csv 2>&1"
    assert check(Command("doc.md:1", good, in_block=True)) == ""
    assert check(Command("doc.md:1", "make demo > log", in_block=True)) == ""


def test_params_prints_the_parameter_counts_the_readme_states() -> None:
    """Run for real: `python -m trainer params --preset lab` (no training, a second)."""
    from trainer.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["params", "--preset", "lab"]) == 0
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for count in re.search(r"`python -m trainer params --preset lab` \| prints ([\d,]+) \(LM\) and ([\d,]+)",
                           readme).groups():
        assert count in out.getvalue() or count.replace(",", "") in out.getvalue(), (count, out.getvalue())


def test_make_help_names_only_sections_the_readme_has() -> None:
    """Run for real: `make help`; every "README, Section" it points to is a heading of README.md."""
    if shutil.which("make") is None:
        pytest.skip("make not installed")
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    readme = re.sub(r"```.*?```", "", (REPO / "README.md").read_text(encoding="utf-8"), flags=re.S)
    headings = set(re.findall(r"^#+ (.+)$", readme, re.M))
    cited = re.findall(r"README(?:\.md)?, ([A-Z][\w -]*)", out.stdout)
    assert all(c.strip() in headings for c in cited), (cited, headings)


CITED = re.compile(r"(?<![\w./$-])((?:trainer|serving|contract|bench|deploy|launch|tests|docs|proto)/[\w./-]*\w)")


def test_every_file_the_docs_cite_exists() -> None:
    """A file or folder of the repository named in the docs (trainer/engine/loop.py, tests/test_x.py::name) exists."""
    problems = []
    for path in [*MARKDOWN, *DEPLOY]:
        for n, row in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in CITED.finditer(row):
                glob = row[m.end():m.end() + 1] == "*"  # tests/test_serving_*.py: a pattern, not a file
                if not glob and not (REPO / m.group(1).split("::")[0]).exists():
                    problems.append(f"{path.relative_to(REPO)}:{n}: {m.group(1)}")
    assert not problems, "\n".join(problems)
