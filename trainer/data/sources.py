"""The public data sets the presets read, each pinned to its source: the URLs `data fetch` downloads, the sha256 and
size of every file (checked before anything is built from it), the license and the citation. The catalogue itself is
data, trainer/data/sources.toml (a table a set); this module reads it into `SETS`.

Each set is built from its downloads into one folder of `data_sets()` (trainer/config/presets.py) by the converter
its `build` names (trainer/data/convert.py), in the layout the presets read. A set's folder is complete when every
file of `files` is there (a fetched set also has its SOURCE.json; a copy laid out by hand need not).

The hashes of cls-books-fr and eltec-fr were computed from the repositories' blobs at the pinned commits. The sites of
imdb and sst2 serve one archive each, unversioned: their sha256 is the one other dataset loaders publish for the same
URL (tensorflow-datasets and MLDatasets.jl for aclImdb_v1.tar.gz), so a changed archive is refused, not used.
allocine-fr's archive is a file of its repository at the pinned commit, and its sha256 is the one Hugging Face's
`datasets` publishes for the same file (its allocine loader's download checksums).
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

RAW = "https://raw.githubusercontent.com"


@dataclasses.dataclass(frozen=True)
class Remote:
    """One file to download: where from, its checksum and size, and the name it is saved under."""

    url: str
    sha256: str
    size: int  # bytes: the progress bar's total, and a download that grows past it is cut short
    name: str = ""  # the download's file name (default: the URL's last part)

    @property
    def filename(self) -> str:
        return self.name or self.url.rsplit("/", 1)[-1]


@dataclasses.dataclass(frozen=True)
class DataSet:
    """A public data set: what it is, where it comes from, and what its folder holds once built."""

    name: str  # the folder under data_sets(): what data paths start with (cls-books-fr/train.review.spm)
    title: str
    source: str  # the repository or page it comes from
    revision: str  # the commit, or the archive's version
    license: str
    citation: str
    remotes: tuple[Remote, ...]
    build: str  # the converter in trainer/data/convert.py
    files: tuple[str, ...]  # what the folder holds when complete

    @property
    def size(self) -> int:
        return sum(r.size for r in self.remotes)


def _read(path: Path) -> dict[str, DataSet]:
    """The catalogue's sets, by name (its comment says what each key holds)."""
    sets = {}
    for name, entry in tomllib.loads(path.read_text(encoding="utf-8")).items():
        repository = entry.get("repository")
        raw = f"{RAW}/{repository}/{entry['revision']}" if repository else ""
        sets[name] = DataSet(
            name=name, title=entry["title"], source=entry.get("source") or f"https://github.com/{repository}",
            revision=entry["revision"], license=entry["license"], citation=entry["citation"],
            remotes=tuple(Remote(url.replace("{raw}", raw), sha256, size) for url, sha256, size in entry["remotes"]),
            build=entry["build"], files=tuple(entry["files"]))
    return sets


SETS: dict[str, DataSet] = _read(Path(__file__).with_name("sources.toml"))
