"""Resumable engine checkpoints: every rank writes its shards, and `latest` never points at a partial checkpoint.

Layout of `RUN/checkpoints/`:
  step00000500/     one DeepSpeed checkpoint (DeepSpeed decides which rank writes which file) + complete.json
  latest            the tag of the newest complete checkpoint (DeepSpeed's own name, so its tools work on it)

Saving (all ranks): DeepSpeed writes the shards with `save_latest=False` (its own `latest` is written by rank 0
without waiting for the other ranks' shards) and returns after a barrier; then rank 0 fsyncs the files, records
their sizes and sha256 in `complete.json`, and only then replaces `latest` atomically. A kill at any moment leaves
`latest` at the previous complete checkpoint. Old checkpoints beyond `keep_last` are pruned by rank 0.
Checkpoints need a folder every rank can see (a shared filesystem across nodes), as DeepSpeed's loader does.

Loop state (step, epoch, position in the epoch's batch list, tokens trained on, history) travels in DeepSpeed's client
state. RNG states are not stored because none are carried over: data order is a function of (seed, epoch), dropout is
reseeded from (seed, step, micro-step, rank) and MLM masks from (seed, epoch, window), so a resumed run replays the
same numbers bit for bit.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.artifact import sha256_file, write_text_atomic
from trainer.engine import deepspeed_engine as eng

LATEST = "latest"
MARKER = "complete.json"
FORMAT = 1
_TAG = re.compile(r"^step(\d{8})$")


class CheckpointError(ValueError):
    """No checkpoint to resume, or one that is incomplete, corrupt or from another setup; names the file."""


@dataclass
class LoopState:
    """What the training loop needs to continue exactly where it stopped."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch (0-based)
    batch: int = 0  # global batches of this epoch already consumed
    tokens: int = 0  # real (non-pad) input tokens trained on, all ranks (Task.tokens)
    history: list[dict[str, Any]] = field(default_factory=list)  # eval / per-epoch records, in order
    done: bool = False  # the run reached its end (a resume only rewrites the artifact)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoopState:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def read_latest(ckpt_dir: str | Path) -> str | None:
    p = Path(ckpt_dir) / LATEST
    return p.read_text(encoding="utf-8").strip() if p.is_file() else None


def save(engine: Any, ckpt_dir: str | Path, state: LoopState, keep_last: int, meta: dict[str, Any]) -> str:
    """Write a checkpoint of `engine` + `state` (call on every rank); returns its tag."""
    d = Path(ckpt_dir)
    tag = tag_for(state.step)
    if eng.is_main():
        d.mkdir(parents=True, exist_ok=True)
        if (d / tag).exists() and read_latest(d) != tag:
            shutil.rmtree(d / tag)  # leftover of a save that was killed: never mix its files with new ones
    eng.barrier()
    if read_latest(d) == tag:
        return tag  # resumed exactly here: this state is already on disk
    client = {"loop": dataclasses.asdict(state), "meta": meta}
    try:
        engine.save_checkpoint(str(d), tag=tag, client_state=client, save_latest=False)  # ends with a barrier
    except Exception as e:  # torch.save on a full disk says only "unexpected pos N vs M", naming no file
        raise CheckpointError(_save_failed(d, tag, e)) from e
    if eng.is_main():
        files = {}
        for f in sorted(p for p in (d / tag).rglob("*") if p.is_file()):
            with open(f, "rb") as fh:  # the shards are written without fsync
                os.fsync(fh.fileno())
            files[str(f.relative_to(d / tag))] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
        marker = {"format": FORMAT, "tag": tag, "step": state.step, "world_size": eng.world_size(),
                  "precision": _precision(engine),
                  "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "files": files, **meta}
        write_text_atomic(d / tag / MARKER, json.dumps(marker, indent=1) + "\n")
        write_text_atomic(d / LATEST, tag + "\n")
        _fsync_dir(d)
        prune(d, keep_last, protect=tag)
    eng.barrier()
    return tag


def _save_failed(d: Path, tag: str, e: Exception) -> str:
    """Why a save raised, in words: the folder, the free space against the previous checkpoint's size, what is safe."""
    free, prev, need = shutil.disk_usage(d).free, read_latest(d), 0
    if prev:
        try:
            files = json.loads((d / prev / MARKER).read_text(encoding="utf-8"))["files"]
            need = sum(f["bytes"] for f in files.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            need = 0
    full = ": likely No space left on device" if free < max(need, 1 << 20) else ""
    safe = f"latest still names {prev} (intact): free space, then --resume" if prev else "no complete checkpoint yet"
    return (f"{d / tag}: checkpoint save failed ({type(e).__name__}: {e}); {free:,} bytes free there, the previous "
            f"checkpoint took {need:,}{full}. {safe}")


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_tags(ckpt_dir: str | Path) -> list[str]:
    """Tags with a completion marker, oldest first."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if _TAG.match(p.name) and (p / MARKER).is_file())


def prune(ckpt_dir: Path, keep_last: int, protect: str) -> None:
    """Keep the newest `keep_last` complete checkpoints (and `protect`); remove older ones and partial leftovers."""
    complete = complete_tags(ckpt_dir)
    keep_set = set(complete[-max(1, keep_last):]) | {protect}
    for p in ckpt_dir.iterdir():
        if _TAG.match(p.name) and p.name not in keep_set:
            shutil.rmtree(p, ignore_errors=True)


def refuse_overwrite(ckpt_dir: str | Path) -> None:
    """A fresh run must not write into a folder of another run's checkpoints (its tags would collide)."""
    tags = complete_tags(ckpt_dir)
    if tags or read_latest(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir} already holds checkpoints ({', '.join(tags[-3:]) or 'latest'}): pass "
                              "--resume to continue that run, or choose a new --out")


def find(ckpt_dir: str | Path, which: str = "latest") -> str:
    """The tag to resume from: `latest` (the pointer, else the newest complete one) or an explicit tag.

    Reads only; raises CheckpointError naming the folder or file when there is nothing good to resume."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise CheckpointError(f"nothing to resume: checkpoint folder {d} does not exist")
    if which != "latest":
        tag = which
    else:
        tag = read_latest(d) or (complete_tags(d)[-1] if complete_tags(d) else "")
        if not tag:
            raise CheckpointError(f"nothing to resume: {d} has no complete checkpoint (no {LATEST} file, no {MARKER})")
    verify(d, tag)
    return tag


def verify(ckpt_dir: str | Path, tag: str) -> dict[str, Any]:
    """Check a checkpoint against its marker (every file present, same size and sha256); returns the marker."""
    folder = Path(ckpt_dir) / tag
    marker_path = folder / MARKER
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist (complete ones: {complete_tags(ckpt_dir)})")
    if not marker_path.is_file():
        raise CheckpointError(f"{folder}: incomplete checkpoint (no {MARKER}: its save was interrupted)")
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
        files = marker["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker_path}: unreadable marker ({type(e).__name__}: {e})") from None
    for name, want in files.items():
        f = folder / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing from checkpoint {tag}")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{f}: corrupt ({size} bytes, {want['bytes']} when saved)")
        if sha256_file(f) != want["sha256"]:
            raise CheckpointError(f"{f}: corrupt (sha256 differs from {MARKER})")
    return marker


def refuse_unsafe_pickle(path: Path) -> None:
    """A torch.save file whose pickle names an object outside engine.SAFE_GLOBALS is refused, unread: the scan
    parses the pickle's opcodes without executing any."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # not a torch.save zip, or a damaged one
        raise CheckpointError(f"{path}: not a torch checkpoint file ({type(e).__name__}: {e}); not loaded") from None
    unsafe = sorted(set(names) - eng.safe_global_names())
    if unsafe:
        raise CheckpointError(f"{path}: its pickle calls {', '.join(unsafe)}, which a checkpoint never holds; "
                              "refused without unpickling it (replaced or tampered with?)")


def load(engine: Any, ckpt_dir: str | Path, tag: str) -> tuple[LoopState, dict[str, Any]]:
    """Restore engine (weights, optimizer, lr schedule) and return (loop state, meta) from a verified checkpoint.

    Nothing in it is unpickled but tensors, plain containers and the few DeepSpeed types of engine.SAFE_GLOBALS: each
    file is scanned first (a refusal names the file and the object), and DeepSpeed's loads then run under
    engine.weights_only_loads (checkpoints travel between people and machines; a pickle can run any code)."""
    marker = verify(ckpt_dir, tag)
    if marker.get("world_size") != eng.world_size():
        raise CheckpointError(
            f"{Path(ckpt_dir) / tag / MARKER}: written by {marker.get('world_size')} ranks, this run has "
            f"{eng.world_size()}; resume with the same number of processes (the global batch depends on it)"
        )
    written, now = marker.get("precision", _precision(engine)), _precision(engine)
    if written != now:  # engine.precision=auto on other hardware, or a checkpoint of DeepSpeed's own bf16 mode
        raise CheckpointError(f"{Path(ckpt_dir) / tag / MARKER}: written in {written}, this run trains in {now}; "
                              f"{_how_to_train_in(written)} to resume it")
    for name in marker["files"]:
        if name.endswith(".pt"):
            refuse_unsafe_pickle(Path(ckpt_dir) / tag / name)
    try:
        with eng.weights_only_loads():
            path, client = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    except Exception as e:  # DeepSpeed raises whatever torch.load or its own asserts raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{Path(ckpt_dir) / tag}: cannot load ({type(e).__name__}: {first})") from None
    if path is None or not client or "loop" not in client:
        raise CheckpointError(f"{Path(ckpt_dir) / tag}: DeepSpeed found no loadable checkpoint with loop state")
    return LoopState.from_dict(client["loop"]), dict(client.get("meta", {}))


def _precision(engine: Any) -> str:
    """What the engine trains in, as deepspeed_engine.precision_of names the JSON it was built from (checkpoints
    before 2026-11-27 wrote "bf16" for DeepSpeed's bf16 mode, which was then the trainer's bf16: the same name)."""
    return eng.precision_of(engine.config)


def _how_to_train_in(precision: str) -> str:
    if precision == "fp32":
        return "set engine.precision=fp32"
    if precision == "bf16-autocast":
        return "set engine.precision=bf16"
    if precision.endswith("-autocast"):
        return 'pass --deepspeed-config with {"torch_autocast": {"enabled": true, "dtype": "float16"}}'
    return (f'pass --deepspeed-config with {{"{precision}": {{"enabled": true}}}} (DeepSpeed\'s own {precision} mode, '
            f"which wrote it)")
