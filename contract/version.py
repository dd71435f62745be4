"""The project's version, from the installed package's metadata (importlib.metadata: no torch, no onnxruntime, nothing
slow): the `--version` line of every command line, the server's KServe ServerMetadata, its traces' service.version and
its build metric, so that the trainer, the server and the client say one version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "transfer-sentiment"  # pyproject.toml's [project] name


def package_version() -> str | None:
    """This project's installed version; None in a source tree on PYTHONPATH that was never installed."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return None


def version_line(command: str) -> str:
    """`COMMAND VERSION`, e.g. "sentiment-server 0.1.0"."""
    found = package_version()
    if found is None:
        return f"{command} (not installed: no version; `pip install .` gives it one)"
    return f"{command} {found}"
