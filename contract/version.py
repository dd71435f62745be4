"""The `--version` line of every command line, from the installed package's metadata (importlib.metadata: no torch,
no onnxruntime, nothing slow), so that the trainer, the server and the client print one version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "transfer-sentiment"  # pyproject.toml's [project] name


def version_line(command: str) -> str:
    """`COMMAND VERSION`, e.g. "sentiment-server 0.1.0"."""
    try:
        return f"{command} {version(DISTRIBUTION)}"
    except PackageNotFoundError:  # a source tree on PYTHONPATH that was never installed
        return f"{command} (not installed: no version; `pip install .` gives it one)"
