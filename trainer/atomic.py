"""Writing files and folders atomically, with the modes the user's umask gives (torch-free).

Everything a stage hands to the next (artifact, tokenizer folder, bundle, corpus cache, metrics) is written into a
temporary sibling and renamed into place, so a reader sees the old version or the new one, never half of one.
tempfile.mkdtemp / mkstemp are not used for that: they create 0700 folders and 0600 files on purpose (private
scratch space in a shared /tmp), and the rename would carry those modes to the result, so that a bundle exported by
a CI job could not be read by a server that runs as another user. Here the temporary sibling *is* the result, so it
is created with the modes any file the user writes gets: 0777 / 0666 less the umask (0755 / 0644 under umask 022).
`sha256_file` is the checksum the readers of those files (artifact, checkpoint, prepared corpus, bundle) compare.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from pathlib import Path

_TRIES = 100


def temp_dir(parent: str | Path, prefix: str) -> Path:
    """A new, empty folder `parent/prefix<random>`, mode 0777 less the umask."""
    parent = Path(parent)
    for _ in range(_TRIES):
        path = parent / f"{prefix}{secrets.token_hex(6)}"
        try:
            path.mkdir(mode=0o777)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{parent}: no free name {prefix}* after {_TRIES} tries")


def temp_file(parent: str | Path, prefix: str, suffix: str = ".tmp") -> tuple[int, Path]:
    """A new, empty file `parent/prefix<random>suffix` opened for writing (fd, path), mode 0666 less the umask."""
    parent = Path(parent)
    for _ in range(_TRIES):
        path = parent / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        return fd, path
    raise FileExistsError(f"{parent}: no free name {prefix}*{suffix} after {_TRIES} tries")


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file's bytes, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_mode(folder: str | Path) -> int:
    """The mode a new file in `folder` gets from the umask (0o644 under umask 022), read from a probe file: the umask
    itself can only be read by setting it, which would race with other threads."""
    fd, probe = temp_file(folder, ".mode-probe-")
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write a file via a temporary file in the same folder + rename: readers see the old or the new file."""
    path = Path(path)
    fd, tmp = temp_file(path.parent, f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """`write_bytes_atomic` of UTF-8 text."""
    write_bytes_atomic(path, text.encode("utf-8"))


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished temporary folder into place; an existing folder is swapped out, then removed."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{secrets.token_hex(3)}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
