"""Model artifacts: the hand-over between stages (pretrain -> finetune -> export), with no DeepSpeed and no pickle.

An artifact folder holds `model.safetensors` (fp32), `config.json` (the resolved RunConfig: its tokenizer.max_len is
the artifact's cut), `artifact.json` (task, label_values and label_names, checksum) and `tokenizer/`. It is written
into a temporary sibling folder and renamed into place, so a crash never leaves a half artifact where a later stage
would read it; its modes follow the umask (trainer/atomic.py), so a later stage that runs as another user can read
it. An artifact.json that calls the label values "labels" (an earlier version's) is read as label_values.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file

from contract.errors import TokenizerError
from contract.tokens import TokenizerMeta, meta_path
from trainer.atomic import file_mode, temp_dir
from trainer.atomic import replace_dir as replace_dir  # re-exported: monitor, checkpoint, export
from trainer.atomic import sha256_file as sha256_file  # re-exported: checkpoint
from trainer.atomic import write_text_atomic as write_text_atomic
from trainer.config import schema as config_mod
from trainer.config.schema import RunConfig
from trainer.data.tokenizer import Tokenizer
from trainer.model.encoder import build

FORMAT = 1
WEIGHTS = "model.safetensors"


class ArtifactError(ValueError):
    """An artifact folder is missing, incomplete or does not match its own metadata."""


class SavesItself(Protocol):
    def save(self, folder: str | Path) -> None: ...


@dataclass
class Artifact:
    path: Path
    cfg: RunConfig
    task: str  # "lm" | "classifier"
    meta: dict[str, Any]
    state: dict[str, torch.Tensor]

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    def tokenizer(self) -> Tokenizer:
        """The artifact's tokenizer, cutting at its config's tokenizer.max_len."""
        return Tokenizer.load(self.tokenizer_dir, self.cfg.tokenizer.max_len)

    @property
    def temperature(self) -> float:
        """A classifier's fitted temperature (artifact.json "calibration"; 1: none fitted, an earlier artifact)."""
        return float((self.meta.get("calibration") or {}).get("temperature", 1.0))

    def model(self) -> torch.nn.Module:
        """The model with these weights, in eval mode, fp32; a classifier's logits divided by its temperature."""
        m = build(self.cfg.model, self.task)
        m.load_state_dict(self.state, strict=True)
        if self.task == "classifier":
            m.temperature = self.temperature
        return m.eval()


def save(
    out: str | Path,
    model: torch.nn.Module,
    cfg: RunConfig,
    task: str,
    tokenizer: SavesItself,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write an artifact folder atomically and return its path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out.parent, f".{out.name}.tmp-")
    try:
        # fp32, contiguous, detached from any DeepSpeed wrapper or bf16 cast.
        state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS))
        (tmp / WEIGHTS).chmod(file_mode(tmp))  # safetensors creates it 0600 whatever the umask
        (tmp / "config.json").write_text(cfg.to_json(), encoding="utf-8")
        tokenizer.save(tmp / "tokenizer")
        meta = {
            "format": FORMAT,
            "task": task,
            "label_values": cfg.data.labels,  # the data's label values, in logit order
            "label_names": cfg.data.names,  # what the server answers for each
            "weights_sha256": sha256_file(tmp / WEIGHTS),
            "parameters": sum(v.numel() for v in state.values()),
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            **(extra or {}),
        }
        (tmp / "artifact.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_tokenizer_meta(path: Path, cfg: RunConfig) -> None:
    """The tokenizer folder's ids are the model's (config.check_tokenizer, the rule every stage applies): else the
    artifact was edited or assembled from two runs."""
    meta = meta_path(path / "tokenizer")
    try:
        vocab_size = TokenizerMeta.parse(meta.read_bytes(), meta).vocab_size
        config_mod.check_tokenizer(vocab_size, cfg, str(meta))
    except OSError as e:
        raise ArtifactError(f"{meta}: unreadable ({e.strerror})") from None
    except (TokenizerError, config_mod.ConfigError) as e:
        raise ArtifactError(str(e)) from None


def config_path(path: str | Path) -> Path:
    """An artifact's config.json (read it with config.load: a stage can settle its config before the weights)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ArtifactError(f"{path}: missing config.json (not a model artifact, or an interrupted write)"
                            if path.is_dir() else f"artifact folder not found: {path}")
    return path / "config.json"


def load(path: str | Path, verify: bool = True) -> Artifact:
    """Read an artifact folder; every missing piece or checksum mismatch is an ArtifactError naming the file."""
    path = Path(path)
    if not path.is_dir():
        raise ArtifactError(f"artifact folder not found: {path}")
    for name in (WEIGHTS, "config.json", "artifact.json", "tokenizer"):
        if not (path / name).exists():
            raise ArtifactError(f"{path}: missing {name} (not a model artifact, or an interrupted write)")
    try:
        meta = json.loads((path / "artifact.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path / 'artifact.json'}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{path / 'artifact.json'}: format {meta.get('format')!r}, expected {FORMAT}")
    if "labels" in meta:  # written before label values and names had a key each: "labels" held the values
        meta.setdefault("label_values", meta.pop("labels"))
    if meta.get("task") not in ("lm", "classifier"):
        raise ArtifactError(f"{path / 'artifact.json'}: task {meta.get('task')!r} is not 'lm' or 'classifier'")
    if verify and sha256_file(path / WEIGHTS) != meta.get("weights_sha256"):
        raise ArtifactError(f"{path / WEIGHTS}: checksum does not match artifact.json (corrupt or replaced)")
    cfg = config_mod.load(path / "config.json")
    _check_tokenizer_meta(path, cfg)
    try:
        state = load_file(str(path / WEIGHTS))  # safetensors: no pickle
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise ArtifactError(f"{path / WEIGHTS}: cannot read weights: {e}") from None
    return Artifact(path=path, cfg=cfg, task=meta["task"], meta=meta, state=state)
