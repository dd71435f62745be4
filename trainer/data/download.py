"""One file over HTTP(S), verified: resumed where a cut transfer stopped (HTTP Range), checked against its sha256
before it gets its final name, never left half-written at that name.

The transfer goes to `DEST.part`; a later call sends `Range: bytes=N-` for the N bytes already there, appends what a
206 answer brings, and starts over when the server ignores the range (200). Once the size is reached the whole file
is hashed: a match is renamed to DEST (atomic on one file system), a mismatch deletes the part and raises. requests
honours HTTPS_PROXY, HTTP_PROXY and NO_PROXY, and REQUESTS_CA_BUNDLE for a proxy's own certificate authority.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import requests
from tqdm import tqdm

CHUNK = 1 << 16


class FetchError(ValueError):
    """A download failed or did not verify; the message names the URL (and the file and both hashes)."""


class Unreachable(FetchError):
    """The source did not answer, or not with the file: another source (a mirror, a copy) may."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def download(url: str, dest: Path, sha256: str, size: int, timeout: float = 30.0, label: str = "") -> int:
    """Fetch `url` to `dest` unless `dest` is there with the right hash; returns the bytes transferred (0: none).
    `timeout`: seconds to connect, and the longest wait for the next bytes of the body."""
    if dest.exists():
        if sha256_of(dest) == sha256:
            return 0
        dest.unlink()  # a file at the final path that is not the pinned one is not kept
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    got = 0
    if have < size:
        got = _transfer(url, part, have, size, timeout, label or dest.name)
    digest = sha256_of(part)
    if digest != sha256:
        part.unlink()
        raise FetchError(f"{dest.name}: sha256 {digest} differs from the pinned {sha256} (from {url}); the "
                         "download was deleted: fetch again, and if it differs again the source has changed")
    os.replace(part, dest)
    return got


def _transfer(url: str, part: Path, have: int, size: int, timeout: float, label: str) -> int:
    headers = {"Range": f"bytes={have}-"} if have else {}
    try:
        r = requests.get(url, headers=headers, stream=True, timeout=timeout)
    except requests.RequestException as e:
        raise Unreachable(f"{url}: {_reason(e)}") from None
    with r:
        if r.status_code == 416 and have:  # nothing after `have`: the part already holds all the server has
            return 0
        if r.status_code not in (200, 206):
            raise Unreachable(f"{url}: HTTP {r.status_code} {r.reason}")
        if r.status_code == 200 or not _resumes_at(r, have):
            have = 0  # the server sent the whole file: start the part over
        got, too_long = 0, False
        bar = tqdm(total=size, initial=have, unit="B", unit_scale=True, unit_divisor=1024, desc=label,
                   file=sys.stderr, disable=None, leave=False)
        try:
            with open(part, "r+b" if have else "wb") as f:
                f.seek(have)
                f.truncate()
                for block in r.iter_content(CHUNK):
                    if have + got + len(block) > size:
                        too_long = True
                        break
                    f.write(block)
                    got += len(block)
                    bar.update(len(block))
        except requests.RequestException as e:
            raise Unreachable(f"{url}: {_reason(e)} after {have + got:,} of {size:,} bytes (kept: the next fetch "
                             "resumes)") from None
        finally:
            bar.close()
    if too_long:
        part.unlink()
        raise FetchError(f"{url}: the server sent more than the pinned {size:,} bytes; nothing was kept")
    if have + got < size:
        raise Unreachable(f"{url}: the transfer ended after {have + got:,} of {size:,} bytes (kept: the next fetch "
                         "resumes)")
    return got


def _resumes_at(r: requests.Response, have: int) -> bool:
    """A 206 answer whose Content-Range starts where the part ends."""
    spec = r.headers.get("Content-Range", "")  # "bytes START-END/TOTAL"
    try:
        return int(spec.split()[1].split("-")[0]) == have
    except (IndexError, ValueError):
        return False


def _reason(e: requests.RequestException) -> str:
    """What went wrong, in a few words rather than urllib3's nested reprs."""
    if isinstance(e, requests.ConnectTimeout):
        return "no connection within the timeout"
    if isinstance(e, requests.ReadTimeout) or "timed out" in str(e):
        return "the server stopped sending (read timeout)"
    if isinstance(e, requests.exceptions.ChunkedEncodingError):
        return "the connection was cut"
    if isinstance(e, requests.ConnectionError):
        text = str(e)
        for hint in ("Name or service not known", "Temporary failure in name resolution", "Connection refused",
                     "Network is unreachable", "No route to host", "ProxyError", "Connection reset"):
            if hint in text:
                return hint.lower()
        return "cannot connect"
    return type(e).__name__
