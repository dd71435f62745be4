"""Every command line of the project as its real argparse parser, built without running the command: the trainer's
subcommands (as `python -m trainer` builds them), the server, the client, and the scripts under bench/, deploy/, proto/
(whose parsers are built inside their main(): caught at the moment they parse).

Used by tests/test_help.py (every option's help reads right) and tests/test_doc_commands.py (every documented
command parses against these parsers).
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys
from functools import cache
from pathlib import Path
from unittest import mock

from procs import REPO

# Scripts with a command line of their own, run as `python SCRIPT ...` (their folders' other files are modules).
# Every bench/ file that runs as a script (one without `__main__` is a module the scripts import: step_profile.py)
SCRIPTS = sorted([*(p for p in (REPO / "bench").glob("*.py") if '__name__ == "__main__"' in p.read_text()),
                  *(REPO / "deploy" / name for name in ("healthcheck.py", "measure_rss.py", "serve_requirements.py")),
                  REPO / "proto" / "gen.py"])
MODULES = ("serving.server", "serving.client")


def trainer_subcommands() -> list[str]:
    from trainer.__main__ import SUBCOMMANDS

    return list(SUBCOMMANDS)


@cache
def trainer_parser(name: str) -> argparse.ArgumentParser:
    """The parser of `python -m trainer NAME`, built as trainer/__main__.py builds it."""
    from trainer.__main__ import SUBCOMMANDS

    module = importlib.import_module(SUBCOMMANDS[name][0])
    sub = argparse.ArgumentParser(prog=f"python -m trainer {name}", description=(module.__doc__ or "").strip(),
                                  formatter_class=argparse.RawDescriptionHelpFormatter,
                                  epilog=getattr(module, "EXAMPLES", None))
    module.add_arguments(sub)
    return sub


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _caught(self: argparse.ArgumentParser, *args: object, **kw: object) -> None:
    raise _Built(self)


@cache
def script_parser(path: Path) -> argparse.ArgumentParser:
    """The parser `python PATH` builds, caught when main() asks it to parse: nothing after that runs."""
    saved_path, saved_argv = list(sys.path), sys.argv
    sys.argv = [str(path)]
    sys.path.insert(0, str(path.parent))  # as `python PATH` has it
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_known_args", _caught):
            runpy.run_path(str(path), run_name="__main__")
    except _Built as built:
        return built.parser
    finally:
        sys.path[:] = saved_path
        sys.argv = saved_argv
    raise AssertionError(f"{path} ran to its end without parsing a command line")


@cache
def module_parser(module: str) -> argparse.ArgumentParser:
    """The parser of `python -m MODULE` (the server and the client expose theirs as `_parser()`)."""
    mod = importlib.import_module(module)
    if hasattr(mod, "_parser"):
        return mod._parser()
    return script_parser(Path(mod.__file__))


@cache
def deepspeed_parser() -> argparse.ArgumentParser:
    """The parser of DeepSpeed's `deepspeed` launcher (deepspeed.launcher.runner), caught as it parses."""
    from deepspeed.launcher import runner

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", _caught):
        try:
            runner.parse_args([])
        except _Built as built:
            return built.parser
    raise AssertionError("deepspeed.launcher.runner.parse_args parsed nothing")


def all_clis() -> dict[str, argparse.ArgumentParser]:
    """name -> parser, for every command line of the project."""
    out = {f"python -m trainer {name}": trainer_parser(name) for name in trainer_subcommands()}
    out.update({f"python -m {m}": module_parser(m) for m in MODULES})
    out.update({str(p.relative_to(REPO)): script_parser(p) for p in SCRIPTS})
    return out
