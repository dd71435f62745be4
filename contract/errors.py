"""The contract's errors. All are ValueErrors: every command shows them as one line and exits 2."""

from __future__ import annotations


class TokenizerError(ValueError):
    """A tokenizer folder, model or vocabulary is missing or inconsistent; the message names file and value."""


class BundleError(ValueError):
    """A bundle folder is missing, incomplete, corrupt or tampered with; the message names the file."""


class SessionError(ValueError):
    """A bundle's graph cannot be opened as asked: a graph the bundle does not hold, an unknown device, or
    device='cuda' where CUDA does not run; the message names the choice and why."""


def one_line(error: BaseException | str, limit: int = 400) -> str:
    """Another library's error text, on one line and cut to `limit` characters: a refusal is one line."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
