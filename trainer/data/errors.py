"""The data readers' one error, and how its messages tell a user to name a field: imported by trainer/data/readers.py
and trainer/data/tables.py alike (neither imports the other's error)."""

from __future__ import annotations


class DataError(ValueError):
    """A data file is missing, empty or malformed; the message names the file, the line and what was expected."""


def name_it(option: str) -> str:
    """How a user names a field: the config key when training, the flag of `predict` and `export`."""
    return f"name yours with data.{option}=NAME (predict, export: --{option.replace('_', '-')} NAME)"
