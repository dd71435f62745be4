"""Fetch the public data sets the presets read, from their pinned sources (trainer/data/sources.py), verified.

  data fetch [SET ...]         the sets named (default: every set), each one that is not complete yet
  data fetch --preset demo     the sets a preset reads (what `make demo` runs first)
  data fetch --list            each set's source, revision, license, citation, size, and whether it is here

Sets land in $TS_DATA when it is set, else in the user's cache ($XDG_CACHE_HOME/transfer-sentiment/data, by default
~/.cache/transfer-sentiment/data): the folder every preset reads them from. A complete set is never fetched again.
Each download is checked against its sha256 before a set is built from it; the set is built in a temporary folder
and renamed into place with its SOURCE.json (source, revision, license, citation, each file's sha256), so a set's
folder is whole or absent; a folder that lacks one of the set's files is reported, never overwritten. A cut
transfer resumes where it stopped at the next fetch.

A mirror (`--mirror URL` or $TS_DATA_MIRROR) serves the same files under URL/HOST/PATH for each source URL
https://HOST/PATH: a copy of the sources inside a site without internet access.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import shutil
import sys
from pathlib import Path
from urllib.parse import urlsplit

from trainer.data.sources import SETS, DataSet

MIRROR_ENV = "TS_DATA_MIRROR"
SOURCE_FILE = "SOURCE.json"
REMEDY = ("the sets can come from elsewhere: set TS_DATA to a folder that holds them, or fetch them from a mirror "
          f"with --mirror URL (or ${MIRROR_ENV})")

EXAMPLES = """examples:
  python -m trainer data fetch --list
  python -m trainer data fetch --preset demo
  python -m trainer data fetch imdb sst2
  TS_DATA=/data/sets python -m trainer data fetch --mirror http://mirror.internal/sources cls-books-fr
"""


def complete(root: Path, ds: DataSet) -> bool:
    """The set's folder holds every file of the set: fetched (with its SOURCE.json) or laid out by hand."""
    folder = root / ds.name
    return all((folder / f).is_file() for f in ds.files)


def mirrored(url: str, mirror: str | None) -> str:
    if not mirror:
        return url
    parts = urlsplit(url)
    return f"{mirror.rstrip('/')}/{parts.netloc}{parts.path}"


def sets_of_preset(name: str) -> list[str]:
    """The sets whose folders a preset's data section names (its files' first path part)."""
    from trainer.config import presets

    cfg = presets.preset(name)
    d, tok = cfg.data, cfg.tokenizer
    paths = [*d.pretrain, d.train, d.valid, d.test, *d.extra_test]
    if tok.kind == "lab":
        paths += [tok.model, tok.vocab]
    tops = {Path(p).parts[0] for p in paths if p and not Path(p).is_absolute()}
    return [s for s in SETS if s in tops]


def fetch(ds: DataSet, root: Path, mirror: str | None = None, timeout: float = 30.0) -> int:
    """Make `root/NAME` complete; returns the bytes downloaded (0 when it already was)."""
    from trainer import atomic
    from trainer.data import convert
    from trainer.data.download import FetchError, Unreachable, download, sha256_of

    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / ".fetch.lock", "a")  # held, and locked, for the whole fetch
    except OSError as e:
        raise FetchError(f"{root}: cannot write the data sets there ({e.strerror}); set TS_DATA to a folder you "
                         "can write") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch into a folder at a time (two ranks or shells may start one)
        if complete(root, ds):
            return 0
        folder = root / ds.name
        if folder.exists():
            lacks = ", ".join(f for f in ds.files if not (folder / f).is_file())
            raise FetchError(f"{folder}: exists but lacks {lacks}; move it away and fetch again (a fetch never "
                             "writes into a folder it did not make)")
        raw = root / ".downloads" / ds.name
        raw.mkdir(parents=True, exist_ok=True)
        print(f"{ds.name}: {len(ds.remotes)} file(s), {ds.size / 1e6:,.1f} MB from {ds.source} -> {folder}",
              file=sys.stderr)
        got = 0
        for r in ds.remotes:
            url = mirrored(r.url, mirror)
            try:
                got += download(url, raw / r.filename, r.sha256, r.size, timeout=timeout, label=r.filename)
            except Unreachable as e:
                raise Unreachable(f"{e}; {REMEDY}") from None
        tmp = atomic.temp_dir(root, f".{ds.name}.partial-")
        try:
            convert.build(ds, raw, tmp)
            record = {
                "name": ds.name, "title": ds.title, "source": ds.source, "revision": ds.revision,
                "license": ds.license, "citation": ds.citation,
                "fetched": datetime.date.today().isoformat(), "mirror": mirror or None,
                "downloads": [{"url": r.url, "sha256": r.sha256, "bytes": r.size} for r in ds.remotes],
                "files": {f: sha256_of(tmp / f) for f in ds.files},
            }
            (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            os.rename(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(raw, ignore_errors=True)
        return got


def describe(root: Path) -> str:
    rows = []
    for ds in SETS.values():
        here = "here" if complete(root, ds) else "not fetched"
        rows += [f"{ds.name}  ({ds.size / 1e6:,.1f} MB to download; {here}: {root / ds.name})",
                 f"  {ds.title}", f"  source:   {ds.source} @ {ds.revision}", f"  license:  {ds.license}",
                 f"  citation: {ds.citation}", ""]
    return "\n".join(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION", help="fetch: download the sets")
    f = sub.add_parser("fetch", help="download and verify data sets into $TS_DATA or the user's cache",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    f.add_argument("sets", nargs="*", metavar="SET", help=f"which sets (default: all): {', '.join(SETS)}")
    f.add_argument("--preset", help="the sets this preset reads")
    f.add_argument("--list", action="store_true", help="print each set's source, license and citation; fetch nothing")
    f.add_argument("--mirror", default=os.environ.get(MIRROR_ENV) or None, metavar="URL",
                   help=f"fetch from URL/HOST/PATH instead of each source https://HOST/PATH (default: ${MIRROR_ENV})")
    f.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="seconds to connect, and the longest wait for more bytes (default 30)")


def main(args: argparse.Namespace) -> int:
    from trainer.config.presets import data_sets

    root = Path(data_sets())
    if args.list:
        print(describe(root))
        return 0
    unknown = [s for s in args.sets if s not in SETS]
    if unknown:
        raise ValueError(f"unknown data set {', '.join(unknown)}; the sets: {', '.join(SETS)}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout {args.timeout:g}: must be more than 0 seconds")
    names = list(args.sets) + (sets_of_preset(args.preset) if args.preset else [])
    if args.preset and not names:
        print(f"the {args.preset} preset reads none of the sets ({', '.join(SETS)}): nothing to fetch")
        return 0
    for name in dict.fromkeys(names or SETS):  # no set and no preset named: every set
        ds = SETS[name]
        got = fetch(ds, root, args.mirror, args.timeout)
        print(f"{name}: {'fetched, ' + f'{got / 1e6:,.1f} MB' if got else 'complete'} in {root / name}")
    return 0
