"""Reading a file of a folder that came from outside: a regular file inside the folder, of bounded size, or nothing.

A bundle is copied between machines and people, so its files are not trusted until read this way: every component
of the path is opened relative to the folder without following symbolic links (a link out of the folder, or to
/dev/zero, is refused, not read), the file must be a regular file (a FIFO would block the reader forever, a device
could be endless), and its size is checked before reading and again while reading (it could grow in between).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from contract.errors import BundleError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: a FIFO swapped in cannot block
_CHUNK = 1 << 24


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _size(n: int) -> str:
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n} bytes"


class Folder:
    """An opened folder; `read(rel, limit)` returns the bytes of one regular file under it. Use as a context."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the folder itself may be a link
        except FileNotFoundError:
            raise BundleError(f"{path}: bundle folder not found") from None
        except OSError as e:
            raise BundleError(f"{path}: cannot open the bundle folder ({e.strerror})") from None

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def read(self, rel: str, limit: int, listed_in: str | None = None) -> bytes:
        """The bytes of `rel` (a "/"-separated path without "..") if it is a regular file of at most `limit` bytes;
        else BundleError naming it. listed_in: the file that names `rel`, for the message when it is missing."""
        path = self.path / rel
        *dirs, name = rel.split("/")
        opened: list[int] = []
        try:
            fd = self._fd
            for i, part in enumerate(dirs):
                self._expect(fd, part, stat.S_ISDIR, self.path.joinpath(*dirs[: i + 1]), "a folder")
                fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                opened.append(fd)
            self._expect(fd, name, stat.S_ISREG, path, "a regular file", limit)
            f = os.open(name, _FILE_FLAGS, dir_fd=fd)
            try:
                st = os.fstat(f)  # what was opened, which may have been swapped since the check above
                if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                    raise BundleError(f"{path}: changed while it was read (now {_kind(st.st_mode)}, "
                                      f"{st.st_size} bytes)")
                chunks, total = [], 0
                while total <= limit:
                    chunk = os.read(f, min(_CHUNK, limit + 1 - total))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    total += len(chunk)
            finally:
                os.close(f)
        except FileNotFoundError:
            where = f"listed in {listed_in} but " if listed_in else ""
            raise BundleError(f"{path}: {where}missing") from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a component turned into a link or a file meanwhile
                raise BundleError(f"{path}: a symbolic link on the way: a bundle holds regular files only") from None
            raise BundleError(f"{path}: cannot be read ({e.strerror})") from None
        finally:
            for fd in opened:
                os.close(fd)
        if total > limit:
            raise BundleError(f"{path}: larger than the {_size(limit)} a bundle's {name} may have")
        return b"".join(chunks)

    @staticmethod
    def _expect(dir_fd: int, name: str, test: Callable[[int], bool], path: Path, what: str,
                limit: int | None = None) -> None:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not test(st.st_mode):
            raise BundleError(f"{path}: {_kind(st.st_mode)}, not {what}: a bundle holds regular files only")
        if limit is not None and st.st_size > limit:
            raise BundleError(f"{path}: {_size(st.st_size)}, larger than the {_size(limit)} a bundle's {path.name} "
                              "may have")
