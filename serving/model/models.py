"""The models a server holds and their versions, each version a ServingCore (its predictor, its batcher and queue,
its limits), and how versions come and go without a call failing.

A call names a model and maybe a version (`""`: the server's one model; its newest ready version). `get` gives the
core to run it on; `classify` and `submit` run it and say which core answered. A load (at start, from the
repository API, or from the poller) reads the model's folder (serving/model/repository.py), loads each version its
policy lists that is not loaded yet, and only then switches: a new version is verified (contract/bundle.py, the check
export runs), its graph run at max_len (the predictor does) and a warm-up call made on it **before** it is listed;
then the versions the policy no longer lists are retired: taken off the list first (new calls go to the new one),
then drained (their accepted calls finish, serving/model/core.py), their batcher closed, their metrics removed and
their memory freed. A call that picked a version just before it was taken off finds it retired and runs again on the
newest (`Retired`); one that named the retired version gets UNAVAILABLE. A version that fails to load is listed
UNAVAILABLE with its reason (the index, the log, sentiment_model_loads_total{result="failed"}) and left out of the
policy's pick: the versions already serving keep serving. It is tried again once its folder changes, or at an explicit
load.

Several models: each has its own batcher and queue bound (max_queue texts); no model may hold more than its share
of the process' model calls (`share`: a call past it is refused RESOURCE_EXHAUSTED, "model 'a' holds its share of the
server's model calls"), and while several are busy they take turns for the cores (serving/model/turns.py), so that a
flooded model leaves the others room. What no share can do: past max_concurrent_rpcs the process refuses a call at
admission, before its body is read, and so before its model is known ("server busy: N model calls in progress"): a
flood larger than that limit refuses every model's calls. The edge's MODEL_CALLS (deploy/proxy/) bounds a flood
before it gets there.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from serving.config import ServerConfig
from serving.errors import BundleError, InvalidInput, LoadFailed, ModelNotFound, NotReady, Retired, ServerConfigError
from serving.model.core import ServingCore
from serving.model.predictor import Prediction
from serving.model.repository import VERSION, NoSuchModel, RepositoryError, model_names, read_model
from serving.model.turns import Turns

log = logging.getLogger(__name__)
T = TypeVar("T")

READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
# How a version's core is made: name, version, bundle folder -> a core whose predictor is loaded and verified.
OpenCore = Callable[[str, int, Path], ServingCore]
WARM_UP = "Warm-up call, made before this version takes traffic."


def share(max_calls: int, models: int) -> int:
    """The model calls one model may hold at once when `models` are served: all of them for one model; else all but
    the room kept for the others, a quarter of max_calls shared among them (at least one call each)."""
    if models <= 1:
        return max_calls
    return max(1, max_calls - max(models - 1, max_calls // 4))


@dataclass
class _Version:
    """One version's line in the repository index."""

    state: str
    reason: str = ""
    stamp: tuple[int, ...] | None = None  # its folder's state when it failed: tried again once it changes


class Models:
    """Thread-safe. `get`, `classify`, `submit` are the protocols'; `load`, `unload`, `index` the repository API's."""

    def __init__(self, cfg: ServerConfig, open_core: OpenCore, on_change: Callable[[str, str], None] | None = None,
                 call_turns: Turns | None = None) -> None:
        """on_change(model, result): a version was loaded, failed or unloaded (the metric). call_turns: the turns the
        versions' calls take (serving/model/turns.py)."""
        self.call_turns = call_turns
        self.cfg = cfg
        self.root = Path(cfg.model_repository) if cfg.model_repository else None
        self._open = open_core
        self._on_change = on_change or (lambda model, result: None)
        self._lock = threading.Lock()  # the lists below; held for lookups and switches only
        self._changing = threading.Lock()  # one load or unload at a time
        self._ready: dict[str, dict[int, ServingCore]] = {}  # what calls can reach
        self._cores: tuple[ServingCore, ...] = ()
        self._index: dict[tuple[str, int], _Version] = {}
        self._refused: dict[tuple[str, str], str] = {}  # entries of a model folder that are not versions it can use
        self._known: set[str] = set()
        self._errors: dict[str, str] = {}  # the last load error of each model, logged once
        self._unloaded: set[str] = set()  # unloaded through the API: the poller does not load them again
        self.draining = False
        self._serving = False  # `open` was called: a version listed from now on takes calls at once
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ calls

    def get(self, name: str, version: str = "") -> ServingCore:
        """The core for a call to model `name` ("" = the one model) at `version` ("" = its newest ready one);
        ModelNotFound (an unknown name or version), NotReady (known, nothing loaded) or InvalidInput (no name given to
        a server of several models)."""
        with self._lock:
            if not name:
                if len(self._ready) != 1:
                    if not self._ready:
                        raise NotReady(f"no model is loaded (known: {sorted(self._known)}); see the repository "
                                       "index")
                    raise InvalidInput(f"this server holds several models {sorted(self._ready)}: name one")
                name = next(iter(self._ready))
            versions = self._ready.get(name)
            if not versions:
                if name in self._known:
                    raise NotReady(f"model {name!r} has no version loaded (unloaded, or its versions failed to load: "
                                   "see the repository index)")
                raise ModelNotFound(f"unknown model {name[:80]!r}; this server holds {sorted(self._ready)}")
            if not version:
                return versions[max(versions)]
            core = versions.get(int(version)) if VERSION.match(version) else None
            if core is None:
                raise ModelNotFound(f"model {name!r} has no version {version[:20]!r} ready; versions: "
                                    f"{[str(v) for v in sorted(versions)]}")
            return core

    def classify(self, name: str, version: str, texts: Sequence[str], deadline: float | None = None,
                 cancelled: Callable[[], bool] | None = None) -> tuple[ServingCore, list[Prediction]]:
        """The core that answered and its predictions; a call that found its version retired runs on the newest."""
        return self._run(name, version, ServingCore.classify, texts, deadline, cancelled)

    def submit(self, name: str, version: str, texts: Sequence[str], deadline: float | None = None,
               cancelled: Callable[[], bool] | None = None) -> tuple[ServingCore, Future]:
        """`classify` without blocking (ServingCore.submit)."""
        return self._run(name, version, ServingCore.submit, texts, deadline, cancelled)

    def _run(self, name: str, version: str, work: Callable[..., T], *args: Any) -> tuple[ServingCore, T]:
        """`work(core, *args)` on the core of `name` and `version`."""
        core = self.get(name, version)
        while True:  # a retired core is off the list before it refuses: the next `get` finds another, or raises
            try:
                return core, work(core, *args)
            except Retired:
                if version:
                    raise
                core = self.get(name, "")

    def names(self) -> list[str]:
        """The models with a version ready."""
        with self._lock:
            return sorted(self._ready)

    def versions(self, name: str) -> list[str]:
        """Model `name`'s ready versions, lowest first."""
        with self._lock:
            return [str(v) for v in sorted(self._ready.get(name, {}))]

    @property
    def cores(self) -> tuple[ServingCore, ...]:
        """Every ready version, by name then version (a tuple made at each change: read on every call, no lock)."""
        return self._cores

    def _listed(self) -> None:
        """The lock held: `cores` again, after a change of `_ready`."""
        self._cores = tuple(self._ready[n][v] for n in sorted(self._ready) for v in sorted(self._ready[n]))

    @property
    def contended(self) -> bool:
        """Several models have calls in progress: a call may wait for its turn (an event loop waits in a thread)."""
        return self.call_turns is not None and self.call_turns.shared

    @property
    def reports_ready(self) -> bool:
        """What health and the server's readiness say: serving, with at least one version ready."""
        return not self.draining and any(c.reports_ready for c in self.cores)

    def no_room_for_any(self, max_texts: int) -> str | None:
        """Admission's question (serving/limits/admission.py) before a call's model is known: a refusal only when no
        ready version has room for a call of max_texts."""
        cores = self._cores
        if len(cores) == 1:  # the usual case, on every call
            return cores[0].batcher.no_room_for_any(max_texts)
        reasons = [c.batcher.no_room_for_any(max_texts) for c in cores]
        return reasons[0] if reasons and all(reasons) else None

    # ------------------------------------------------------------------------------------------ repository API

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Every version held or tried (RepositoryIndex), by name then version."""
        with self._lock:
            rows = [{"name": n, "version": str(v), "state": e.state, "reason": e.reason}
                    for (n, v), e in sorted(self._index.items())]
            rows += [{"name": n, "version": v, "state": UNAVAILABLE, "reason": why}
                     for (n, v), why in sorted(self._refused.items())]
        return [r for r in rows if r["state"] == READY] if ready_only else rows

    def add_bundle(self, name: str, bundle: Path) -> None:
        """One bundle given on the command line: model `name`, version 1. Its BundleError or ServerConfigError is
        raised (the server does not start)."""
        core = self._open(name, 1, bundle)
        _warm_up(core)
        with self._lock:
            core.ready = self._serving
            self._known.add(name)
            self._ready[name] = {1: core}
            self._listed()
            self._index[(name, 1)] = _Version(READY)
        self._on_change(name, "loaded")

    def load_all(self) -> None:
        """Every model of the repository (at start, and at each poll). A folder that cannot be read is logged."""
        assert self.root is not None
        names = model_names(self.root)
        for name in names:
            if name in self._unloaded:
                continue  # unloaded through the API: it stays so until loaded through the API
            try:
                self.load(name, again=False)
                self._errors.pop(name, None)
            except (LoadFailed, ModelNotFound) as e:
                if self._errors.get(name) != str(e) and not (isinstance(e, LoadFailed) and e.logged):  # once a reason
                    log.error("%s", e)
                self._errors[name] = str(e)
        with self._lock:
            gone = [n for n in self._known if n not in names and n in self._ready]
        for name in gone:  # its folder was removed: its versions go too (Triton's poll mode does the same)
            log.info("model %r: its folder is gone from %s: unloading it", name, self.root)
            self.unload(name)

    def load(self, name: str, again: bool = True) -> None:
        """Load model `name` from the repository (again): see the module docstring. LoadFailed naming each version
        that failed now (the versions serving keep serving) or a policy file that cannot be read; ModelNotFound
        without such a folder.
        again: try versions that failed before even if their folder has not changed (an explicit load)."""
        if self.root is None:
            raise LoadFailed("this server holds one bundle given on its command line: no repository to load from")
        with self._changing:
            if again:
                self._unloaded.discard(name)
            try:
                found = read_model(self.root, name)
            except NoSuchModel as e:
                raise ModelNotFound(str(e)) from None
            except RepositoryError as e:  # its policy file: the versions serving keep serving
                with self._lock:
                    self._known.add(name)
                    self._refused = {k: v for k, v in self._refused.items() if k[0] != name}
                    self._refused[(name, "")] = self._shown(e)
                serving = self.versions(name)
                raise LoadFailed(f"{self._shown(e)}; " + (f"version {serving[-1]} keeps serving" if serving else
                                             "no version serves")) from None
            with self._lock:
                self._known.add(name)
                self._refused = {k: v for k, v in self._refused.items() if k[0] != name}
                self._refused |= {(name, v): self._shown(why) for v, why in found.refused.items()}
            failed: dict[int, str] = {}  # every version that could not be loaded
            fresh: dict[int, str] = {}  # of those, the ones tried now (not skipped as unchanged since they failed)
            while True:
                wanted = found.policy.pick([v for v in found.versions_on_disk if v not in failed])
                for v in wanted:
                    if not self._held(name, v):
                        reason, tried = self._load_version(name, v, found.versions_on_disk[v], again)
                        if reason is not None:
                            failed[v] = reason
                            if tried:
                                fresh[v] = reason
                if all(v not in failed for v in wanted):
                    break
            keep = set(wanted) or set(self._ready_versions(name))  # nothing loadable: what serves keeps serving
            for v in sorted(set(self._ready_versions(name)) - keep):
                self._retire(name, v)
            if fresh:
                serving = self.versions(name)
                raise LoadFailed(f"model {name!r}: " + "; ".join(f"version {v} refused: {why}"
                                                                 for v, why in sorted(fresh.items()))
                                 + (f"; version {serving[-1]} keeps serving" if serving else "; no version serves"),
                                 logged=True)

    def unload(self, name: str) -> None:
        """Every version of model `name`: drained, then freed; the poller leaves it unloaded until `load`.
        ModelNotFound for a name never loaded."""
        with self._changing:
            if name not in self._known:
                raise ModelNotFound(f"unknown model {name[:80]!r}; this server holds {sorted(self._ready)}")
            self._unloaded.add(name)  # the poller leaves it unloaded until a load through the API
            for v in sorted(self._ready_versions(name)):
                self._retire(name, v)

    # ------------------------------------------------------------------------------------------ poller, lifecycle

    def poll(self, every_s: float) -> None:
        """Read the repository again every `every_s` seconds, in a thread of its own, until `close`."""

        def loop() -> None:
            while not self._stop.wait(every_s):
                try:
                    self.load_all()
                except RepositoryError as e:
                    log.error("%s", e)
                except Exception:  # a bug: logged, the poller goes on
                    log.exception("repository poll failed")

        self._poller = threading.Thread(target=loop, name="repository-poll", daemon=True)
        self._poller.start()

    def open(self) -> None:
        """The server serves: every version listed takes calls, and those listed later will at once."""
        with self._lock:
            self._serving = True
            for versions in self._ready.values():
                for core in versions.values():
                    core.ready = True

    def refuse_and_wait(self, timeout: float) -> bool:
        """Shutdown: every version refuses new calls; True once the accepted ones are done within `timeout`."""
        self._stop.set()
        with self._lock:
            self.draining, self._serving = True, False  # a version a load lists from now on takes no call
        return all(c.refuse_and_wait(timeout) for c in self.cores)

    def close(self, timeout: float) -> None:
        """Stop the poller and close every version's batcher (their queued texts run first)."""
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout)
        changing = self._changing.acquire(timeout=timeout)  # a load in progress lists its version first
        try:
            for core in self.cores:
                core.batcher.close(timeout=timeout)
        finally:
            if changing:
                self._changing.release()

    # ------------------------------------------------------------------------------------------ inside

    def _shown(self, reason: object) -> str:
        """A reason as clients read it (the index, a load's error): paths inside the repository relative to it, as
        NAME/VERSION/FILE. The server's own paths are for its log only."""
        text = str(reason)
        if self.root is not None:
            for path in sorted({str(self.root), str(self.root.resolve())}, key=len, reverse=True):
                text = text.replace(path + os.sep, "")
        return text

    def _held(self, name: str, version: int) -> bool:
        with self._lock:
            return version in self._ready.get(name, {})

    def _ready_versions(self, name: str) -> list[int]:
        with self._lock:
            return list(self._ready.get(name, {}))

    def _load_version(self, name: str, version: int, folder: Path, again: bool) -> tuple[str | None, bool]:
        """Load, verify and warm up one version, then list it: (the reason it failed or None, whether it was tried
        now)."""
        stamp = _stamp(folder)
        with self._lock:
            before = self._index.get((name, version))
            if before is not None and before.state == UNAVAILABLE and before.stamp == stamp and not again \
                    and before.reason != "unloaded":
                return before.reason, False  # failed already, and its folder has not changed since
            self._index[(name, version)] = _Version(LOADING)
        try:
            core = self._open_warm(name, version, folder)
        except (BundleError, ServerConfigError, LoadFailed, OSError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.error("model %r version %d refused, the versions serving keep serving: %s", name, version, reason)
            reason = self._shown(reason)
            with self._lock:
                self._index[(name, version)] = _Version(UNAVAILABLE, reason, stamp=stamp)
            self._on_change(name, "failed")
            return reason, True
        with self._lock:
            core.ready = self._serving
            self._ready.setdefault(name, {})[version] = core
            self._listed()
            self._index[(name, version)] = _Version(READY)
        self._update_shares()
        self._on_change(name, "loaded")
        log.info("model %r version %d loaded from %s and serving", name, version, folder)
        return None, True

    def _open_warm(self, name: str, version: int, folder: Path) -> ServingCore:
        core = self._open(name, version, folder)
        try:
            _warm_up(core)
        except Exception:
            core.batcher.close(timeout=0)
            raise
        return core

    def _retire(self, name: str, version: int) -> None:
        """Off the list, then drained, closed and freed (called with `_changing` held)."""
        with self._lock:
            core = self._ready[name].pop(version)
            if not self._ready[name]:
                del self._ready[name]
            self._listed()
            self._index[(name, version)] = _Version(UNLOADING)
        grace = self.cfg.grace_s
        core.retired = True
        if not core.refuse_and_wait(grace):
            log.warning("model %r version %d: calls still running after grace %.1f s", name, version, grace)
        core.batcher.close(timeout=grace)
        core.close()
        with self._lock:
            self._index[(name, version)] = _Version(UNAVAILABLE, "unloaded")
        # Its graph's memory goes with the last reference: onnxruntime's buffers are mappings of their own
        # (serving/process/memory.py), given back to the system when freed. No collection or trim here: a full
        # collection holds the interpreter lock, and so every call, while it runs.
        del core
        self._update_shares()
        self._on_change(name, "unloaded")
        log.info("model %r version %d unloaded", name, version)

    def _update_shares(self) -> None:
        limit = share(self.cfg.max_concurrent_rpcs or self.cfg.max_workers, len(self._ready))
        for core in self.cores:
            core.max_active = limit


def _warm_up(core: ServingCore) -> None:
    """One call through the version's tokenizer and graph before it takes traffic; LoadFailed when the answer is not
    a probability per label. (The predictor already ran its graph at max_len when it was made.)"""
    (p,) = core.predictor.predict([WARM_UP])
    if len(p.probabilities) != len(core.predictor.label_names) or not 0.999 < float(p.probabilities.sum()) < 1.001:
        raise LoadFailed(f"warm-up call: probabilities {p.probabilities.tolist()} are not one per label summing to 1")


def _stamp(folder: Path) -> tuple[int, ...] | None:
    """What changes when anything in a version's folder does: its inode, and the newest change time, the count and
    the total size of everything under it (a file still being written grows, even when no entry is added)."""
    try:
        stats = [folder.stat()] + [p.stat() for p in folder.rglob("*")]
    except OSError:
        return None
    return (stats[0].st_ino, max(st.st_ctime_ns for st in stats), len(stats), sum(st.st_size for st in stats))
