"""The contract's two errors. Both are ValueErrors: every command shows them as one line and exits 2."""

from __future__ import annotations


class TokenizerError(ValueError):
    """A tokenizer folder, model or vocabulary is missing or inconsistent; the message names file and value."""


class BundleError(ValueError):
    """A bundle folder is missing, incomplete, corrupt or tampered with; the message names the file."""


def one_line(error: BaseException | str, limit: int = 400) -> str:
    """Another library's error text, on one line and cut to `limit` characters: a refusal is one line."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
