"""A model repository on disk, in the layout Triton and KServe use: what it holds, never what is loaded
(serving/model/models.py loads it).

    DIR/NAME/model.json        optional: the version policy (below)
    DIR/NAME/VERSION/          a bundle (`python -m trainer export ... --out DIR/NAME/VERSION`)

NAME: a letter or digit, then letters, digits, '_', '.', '-' (at most 64). VERSION: a folder named by a number
without leading zeros (at most 9 digits), as in Triton; `07` or a 10-digit name is listed as refused, never read.
Any other entry is ignored: a version is copied under another name (`.incoming-3`) and renamed into place, which is
atomic, so that a version is never seen half written. A NAME or VERSION that is a symbolic link is followed only
when it stays inside DIR (a link out of it is listed as refused, never read).

The version policy, Triton's `version_policy` written as JSON:
    {"version_policy": {"latest": {"num_versions": 2}}}    the N highest versions (the default, N = 1)
    {"version_policy": {"specific": {"versions": [1, 3]}}} these versions
    {"version_policy": {"all": {}}}                         every version
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from contract.errors import BundleError
from contract.manifest import strict_json

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
VERSION = re.compile(r"(0|[1-9][0-9]{0,8})\Z")  # as written by str(int): one folder per number
DIGITS = re.compile(r"[0-9]+\Z")
POLICY_FILE = "model.json"
MAX_POLICY_BYTES = 64 * 1024
POLICY_KINDS = ("latest", "specific", "all")


class RepositoryError(ValueError):
    """A repository, model folder or policy file that cannot be read; the message names the path."""


class NoSuchModel(RepositoryError):
    """A model name that is not one, or has no folder inside the repository."""


class LeadsOutside(RepositoryError):
    """A model folder that is a link out of the repository: listed as refused, never read."""


@dataclass(frozen=True)
class Policy:
    """Which versions of a model are served."""

    kind: str = "latest"  # one of POLICY_KINDS
    num_versions: int = 1  # latest: how many
    versions: tuple[int, ...] = ()  # specific: which

    def pick(self, available: list[int]) -> list[int]:
        """The versions to serve out of `available`, highest first."""
        ordered = sorted(available, reverse=True)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered[: self.num_versions]


@dataclass(frozen=True)
class Found:
    """One model's folder as read now: its policy, its version folders (version -> bundle folder; the policy picks
    among them), and the entries refused (version -> why), for the repository index and the log."""

    name: str
    policy: Policy
    versions_on_disk: dict[int, Path]
    refused: dict[str, str]


def model_names(root: Path) -> list[str]:
    """The model folders of the repository, by name; RepositoryError when the repository cannot be read."""
    try:
        entries = sorted(root.iterdir())
    except OSError as e:
        raise RepositoryError(f"model repository {root}: {e.strerror or e}") from None
    return [e.name for e in entries if NAME.match(e.name) and e.is_dir()]


def read_model(root: Path, name: str) -> Found:
    """Model `name` as its folder holds it now; RepositoryError naming the file when the folder or its policy cannot
    be read (a version that cannot be used is in `refused`, not an error)."""
    if not NAME.match(name):
        raise NoSuchModel(f"model name {name[:80]!r}: not a model name (a letter or digit, then letters, digits, "
                              "'_', '.', '-', at most 64)")
    folder = root / name
    real_root = root.resolve()
    if not folder.is_dir():
        raise NoSuchModel(f"model {name!r}: no folder {folder} inside the repository")
    if not _inside(folder, real_root):
        raise LeadsOutside(f"{folder} leads outside the repository: not loaded")  # not where: a client reads it
    policy = read_policy(folder / POLICY_FILE)
    available: dict[int, Path] = {}
    refused: dict[str, str] = {}
    try:
        entries = list(folder.iterdir())
    except OSError as e:
        raise RepositoryError(f"model {name!r}: {folder}: {e.strerror or e}") from None
    for entry in entries:
        if not VERSION.match(entry.name):
            if DIGITS.match(entry.name):  # 07, or too long: no folder of its own number (7 could be another)
                refused[entry.name] = (f"{entry}: not a version number as written (no leading zero, at most 9 "
                                       "digits): not loaded")
            continue  # a temporary name, the policy file, anything else: not a version
        if not _inside(entry, real_root):
            refused[entry.name] = f"{entry} leads outside the repository: not loaded"  # not where: a client reads it
        elif not entry.is_dir():
            refused[entry.name] = f"{entry} is not a folder"
        else:
            available[int(entry.name)] = entry
    return Found(name, policy, available, refused)


def read_policy(path: Path) -> Policy:
    """The policy in `path` (the default when there is no such file); RepositoryError naming the file and field. At
    most MAX_POLICY_BYTES, strict JSON (contract/manifest.py's reader: no key twice, bounded depth), no unknown key."""
    if not path.exists():
        return Policy()
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_POLICY_BYTES + 1)
    except OSError as e:
        raise RepositoryError(f"{path}: {e.strerror or e}") from None
    if len(raw) > MAX_POLICY_BYTES:
        raise RepositoryError(f"{path}: more than {MAX_POLICY_BYTES} bytes; a version policy is a line of JSON")
    try:
        doc = strict_json(raw, path)
    except BundleError as e:
        raise RepositoryError(str(e)) from None
    _known(doc, {"version_policy"}, path, "")
    policy = doc.get("version_policy")
    if not isinstance(policy, dict) or len(policy) != 1 or next(iter(policy)) not in POLICY_KINDS:
        raise RepositoryError(f'{path}: expected {{"version_policy": {{KIND: {{...}}}}}} with KIND one of '
                              f"{list(POLICY_KINDS)}")
    (kind, options), = policy.items()
    _known(options, {"latest": {"num_versions"}, "specific": {"versions"}, "all": set()}[kind], path,
           f"version_policy.{kind}")
    if kind == "latest":
        n = options.get("num_versions", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 100:
            raise RepositoryError(f"{path}: version_policy.latest.num_versions: expected an integer in [1, 100], "
                                  f"got {n!r}")
        return Policy("latest", num_versions=n)
    if kind == "specific":
        vs = options.get("versions")
        if not isinstance(vs, list) or not vs or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                         for v in vs):
            raise RepositoryError(f"{path}: version_policy.specific.versions: expected a non-empty list of version "
                                  f"numbers, got {str(vs)[:80]}")
        return Policy("specific", versions=tuple(sorted(set(vs))))
    return Policy("all")


def _known(obj: object, keys: set[str], path: Path, where: str) -> None:
    """RepositoryError unless `obj` is an object whose keys are all in `keys` (a misspelt key is an error)."""
    if not isinstance(obj, dict):
        raise RepositoryError(f"{path}: {where or 'the file'}: expected an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - keys)
    if unknown:
        raise RepositoryError(f"{path}: {where + ': ' if where else ''}unknown key {unknown[0][:40]!r}; expected "
                              f"{sorted(keys) or 'none'}")


def _inside(path: Path, real_root: Path) -> bool:
    """Whether `path`, its links followed, is inside the repository (a link out of it is refused)."""
    try:
        return path.resolve().is_relative_to(real_root)
    except (OSError, RuntimeError):  # a link loop
        return False
