"""The `gpu` preset: its size and shapes (about 100 M parameters, attention heads every SDPA kernel takes, ids that
tile), and a CPU smoke run of its recipe (bf16 engine, AdamW, cosine schedule, a tokenizer trained on its corpus)
at a few steps and tiny sizes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import procs
from procs import REPO, env

from trainer.config.presets import gpu
from trainer.engine.precision import resolve


def test_the_gpu_preset_is_about_100m_parameters_with_kernel_friendly_shapes() -> None:
    p = subprocess.run([sys.executable, "-m", "trainer", "params", "--preset", "gpu"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    counted = [int(n.replace(",", "")) for n in re.findall(r"total \(counted\)\s+([\d,]+)", p.stdout)]
    formula = [int(n.replace(",", "")) for n in re.findall(r"total \(formula\)\s+([\d,]+)", p.stdout)]
    assert counted == formula == [110_236_672, 97_638_914]  # language model, classifier
    cfg = gpu()
    m = cfg.model
    assert (m.d_model // m.n_heads) % 8 == 0  # flash, memory-efficient and cuDNN attention all apply
    assert m.vocab_size % 64 == 0 and m.vocab_size == cfg.tokenizer.vocab_size + 4  # a trained tokenizer's ids
    assert cfg.tokenizer.kind == "train" and cfg.pretrain.seq_len <= m.max_positions
    assert cfg.engine.precision == "bf16" and cfg.engine.compile == "auto"


def test_the_gpu_recipe_runs_on_a_cpu_at_tiny_sizes(tmp_path: Path, data_dir: Path) -> None:
    """The preset with its shapes and corpus shrunk by --set: its own tokenizer trained on the corpus, bf16, AdamW +
    cosine, engine.compile=auto (off on a CPU), three steps and an artifact."""
    out = tmp_path / "run"
    small = {"model.d_model": 64, "model.n_heads": 8, "model.n_layers": 2, "model.d_ff": 96, "model.vocab_size": 260,
             "model.max_positions": 64, "tokenizer.vocab_size": 256, "tokenizer.train_lines": 3000,
             "tokenizer.max_len": 64, "pretrain.seq_len": 32, "pretrain.micro_batch": 5, "pretrain.max_steps": 3,
             "pretrain.optim.warmup_steps": 1, "engine.log_every": 1, "data.root": str(data_dir),
             # the reviews alone instead of the novels too: seconds, not minutes, of tokenizing on 2 cores
             "data.pretrain": "cls-books-fr/train.review.txt", "data.pretrain_eval_lines": 50}
    args = [a for k, v in small.items() for a in ("--set", f"{k}={v}")]
    p = procs.run([sys.executable, "-m", "trainer", "pretrain", "--preset", "gpu", *args, "--out", str(out)], 600,
                  cwd=REPO, env=env())
    assert p.returncode == 0, p.stderr[-4000:]
    assert "ZeRO 0, bf16" in p.stderr  # the preset's precision, on a CPU too
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) == 4 and all(float(r.split(",")[2]) > 0 for r in rows[1:])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["preset"] == "gpu" and cfg["pretrain"]["optim"]["name"] == "adamw" and cfg["engine"]["compile"] == "auto"
    assert json.loads((out / "tokenizer" / "meta.json").read_text())["vocab_size"] == 260  # trained on its corpus
    assert (out / "artifact" / "model.safetensors").is_file()
    assert resolve("bf16", cuda=False) == "bf16"
