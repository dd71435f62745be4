"""The exporter's errors (ValueErrors: `python -m trainer` shows them as one line and exits 2)."""

from __future__ import annotations


class ExportError(ValueError):
    """The artifact cannot be exported as asked (wrong task, length beyond the positional table, bad option)."""


class ExportValidationError(ExportError):
    """onnxruntime and PyTorch disagree on a validation batch beyond the precision's stated tolerance."""
