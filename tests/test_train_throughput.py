"""bench/train_throughput.py on the tiny preset: one real run (plain python, 1 process, gloo), both tasks, a few steps.

Checks that the two loops really train the same thing (same tokens per window, same losses from the same weights)
and that the rows carry positive rates and the closed-form FLOPs.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import procs
from procs import REPO

KEYS = {"task", "loop", "processes", "threads_per_process", "device", "precision", "micro_batch", "global_batch",
        "seq_len", "tokens_per_s", "tokens_per_s_per_process", "step_ms", "data_wait_fraction", "pad_fraction",
        "flops_per_token", "achieved_flops", "peak_flops", "utilisation", "tokens_per_s_windows",
        "tokens_per_window", "loss_windows"}


def test_plain_and_deepspeed_loops_train_the_same_batches(tmp_path: Path, data_dir: Path) -> None:
    out = tmp_path / "tt.json"
    cmd = [sys.executable, str(REPO / "bench" / "train_throughput.py"), "--preset", "tiny", "--task", "both",
           "--micro-batch", "13", "--seq-len", "24", "--warmup", "1", "--windows", "2", "--steps", "2",
           "--json", str(out)]
    env = {**os.environ, "TS_DATA": str(data_dir)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # one process on loopback, whatever the test session holds
    p = procs.run(cmd, 120, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| lm | deepspeed |" in p.stdout and "| classifier | plain |" in p.stdout  # the markdown table
    rows = json.loads(out.read_text(encoding="utf-8"))["rows"]
    assert [(r["task"], r["loop"]) for r in rows] == [("lm", "plain"), ("lm", "deepspeed"),
                                                      ("classifier", "plain"), ("classifier", "deepspeed")]
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        assert r["processes"] == 1 and r["global_batch"] == 13 and r["precision"] == "fp32"
        assert r["tokens_per_s"] > 0 and all(x > 0 for x in r["tokens_per_s_windows"])
        assert len(r["tokens_per_s_windows"]) == 2 and len(r["tokens_per_window"]) == 3
        assert 0 <= r["data_wait_fraction"] < 1 and 0 <= r["pad_fraction"] < 1
        assert r["achieved_flops"] == r["flops_per_token"] * r["tokens_per_s"]
    by = {(r["task"], r["loop"]): r for r in rows}
    for task in ("lm", "classifier"):
        plain, ds = by[(task, "plain")], by[(task, "deepspeed")]
        # Each loop counts its own tokens: equal lists mean the same batches, window by window.
        assert plain["tokens_per_window"] == ds["tokens_per_window"]
        assert all(n > 0 for n in plain["tokens_per_window"])
        # Same initial weights, data, loss, Adam and clipping: the losses agree (fp32, tiny model).
        for a, b in zip(plain["loss_windows"], ds["loss_windows"], strict=True):
            assert math.isfinite(a) and math.isclose(a, b, rel_tol=1e-4), (task, plain["loss_windows"],
                                                                           ds["loss_windows"])
        assert "ratio_vs_plain" in ds and ds["ratio_vs_plain"] > 0
    # Closed form (vocab 99, d 32, d_ff 48, 2 layers, T 24): 6 x (2 x (4 x 32^2 + 2 x 32 x 48) + 32 x 99)
    # + 12 x 2 x 32 x 24 for the LM; the classifier has no per-token head.
    assert by[("lm", "plain")]["flops_per_token"] == 123456
    assert by[("classifier", "plain")]["flops_per_token"] == 123456 - 6 * 32 * 99
