"""engine.compile=on (DeepSpeed's engine.compile(): the module compiled in place by inductor) on the CPU, tiny preset,
one process: the compiled engine trains like the eager one, and a compiled run stopped and resumed equals the
uninterrupted compiled run, bit for bit, with engine.deterministic=true. (Without it inductor's CPU kernels are not
deterministic: two uninterrupted compiled runs of this config differed by up to 1e-5 after 8 steps, in the attention's
key bias, where Adam scales rounding noise up, and 2e-7 elsewhere; with it, 0.)

Tolerance: inductor fuses and reorders float reductions, so a compiled step is not bit-equal to an eager one; the
per-step losses agree within 1e-4 relative (they agreed to 1e-5 when this was written). Dropout differs by design
(inductor draws its masks with its own generator, seeded from torch's), so that comparison runs without dropout, and
the resume runs with it: a compiled run replays its own masks exactly after --resume (reseeded per micro-step).
Slow: the first compile of each graph takes minutes on 2 loaded cores (inductor caches them for the next runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import procs
import pytest
import torch
from procs import REPO, env
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

LOSS_RTOL = 1e-4  # compiled vs eager, per step (module docstring)
STEPS = ["--set", "pretrain.max_steps=8", "--set", "engine.log_every=1", "--set", "engine.checkpoint_every=2",
         "--set", "engine.zero_stage=2", "--set", "engine.grad_accum=2", "--set", "pretrain.micro_batch=7"]


def pretrain(args: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    p = procs.run([sys.executable, "-m", "trainer", "pretrain", *args, "--out", str(out)], 900, cwd=REPO, env=env())
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def losses(run: Path) -> list[float]:
    return [float(r.split(",")[2]) for r in (run / "metrics.csv").read_text().splitlines()[1:]]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "artifact" / "model.safetensors"))


@pytest.fixture(scope="module")
def base(tiny_tokenizer_dir: Path, data_dir: Path) -> list[str]:
    return ["--preset", "tiny", "--tokenizer", str(tiny_tokenizer_dir), "--set", f"data.root={data_dir}", *STEPS]


def test_the_compiled_engine_trains_like_the_eager_one(base: list[str], tmp_path: Path) -> None:
    eager = pretrain([*base, "--set", "engine.compile=off"], tmp_path / "eager")
    compiled = pretrain([*base, "--set", "engine.compile=on"], tmp_path / "compiled")
    a, b = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert len(a) == len(b) == 8 and np.allclose(a, b, rtol=LOSS_RTOL, atol=0), (a, b)
    assert a[-1] < a[0]  # it trained
    # Compiled in place: the same parameter names in the artifact. (Weights are not compared: the attention's key
    # bias has no gradient but rounding noise, which Adam turns into full-size steps of either sign.)
    assert weights(tmp_path / "compiled").keys() == weights(tmp_path / "eager").keys()
    assert "ZeRO 2" in eager.stderr and "ZeRO 2" in compiled.stderr


def test_a_compiled_run_resumes_exactly(base: list[str], tmp_path: Path) -> None:
    args = [*base, "--set", "engine.compile=on", "--set", "engine.deterministic=true", "--set", "model.dropout=0.1"]
    full, halves = tmp_path / "full", tmp_path / "halves"
    pretrain(args, full)
    pretrain([*args, "--stop-at", "4"], halves)
    p = pretrain([*args, "--resume"], halves)
    assert "resumed at step 4" in p.stderr
    assert np.allclose(losses(halves), losses(full), rtol=0, atol=1e-6), (losses(halves), losses(full))
    a, b = weights(halves), weights(full)
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
