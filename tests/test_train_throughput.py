"""bench/train_throughput.py on the tiny preset: one real run (plain python, 1 process, gloo), both tasks, a few steps.

Checks that the two loops really train the same thing (same tokens per window, same losses from the same weights),
that the tokens they count are the real (non-pad) input tokens of the batches, counted here from the data, and that
the rows carry positive rates and the closed-form FLOPs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import procs
from procs import REPO

KEYS = {"task", "loop", "processes", "threads_per_process", "device", "precision", "micro_batch", "global_batch",
        "seq_len", "tokens_per_s", "tokens_per_s_per_process", "step_ms", "data_wait_fraction", "pad_fraction",
        "flops_per_token", "achieved_flops", "peak_flops", "utilisation", "tokens_per_s_windows",
        "tokens_per_window", "loss_windows"}


def bench(data_dir: Path, out: Path, *extra: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """bench/train_throughput.py at the tiny preset's odd sizes (both tasks, 1 warm-up + 2 windows of 2 steps), its
    JSON into `out`; one process on loopback, whatever rank variables the test session holds."""
    cmd = [sys.executable, str(REPO / "bench" / "train_throughput.py"), "--preset", "tiny", "--task", "both",
           "--micro-batch", "13", "--seq-len", "40", "--warmup", "1", "--windows", "2", "--steps", "2", *extra,
           "--json", str(out)]
    env = {**os.environ, "TS_DATA": str(data_dir)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    p = procs.run(cmd, timeout, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_plain_and_deepspeed_loops_train_the_same_batches(tmp_path: Path, data_dir: Path) -> None:
    out = tmp_path / "tt.json"
    p = bench(data_dir, out, "--profile", timeout=120)
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
    by = {(r["task"], r["loop"]): r for r in rows}
    # Real tokens per window and the padding of the measured windows, counted here from the data (at 40 ids a few
    # reviews are shorter than their batch: a count of padded positions would differ).
    counted = tokens_and_positions(data_dir, steps=2, windows=3)
    for task in ("lm", "classifier"):
        tokens, positions = counted[task]
        assert by[(task, "plain")]["tokens_per_window"] == by[(task, "deepspeed")]["tokens_per_window"] == tokens
        pad = 1 - sum(tokens[1:]) / sum(positions[1:])  # after the warm-up window
        assert (pad > 0) == (task == "classifier")  # LM windows are packed: full, never padded
        assert abs(by[(task, "deepspeed")]["pad_fraction"] - pad) < 1e-12
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
    # --profile: one more step of each loop under torch.profiler, its phases named in both loops alike.
    assert "One profiled step, lm, fp32" in p.stdout
    for r in rows:
        prof = r["profile"]
        assert all(prof["phases_ms"][ph] > 0 for ph in ("step.forward", "step.backward", "step.optimizer")), prof
        assert prof["aten_ops"] > 100 and prof["kernels"] == 0 and prof["device_syncs"] == 0  # a CPU: no device
        assert prof["wall_ms"] >= prof["phases_ms"]["step.forward"]
        # One process: no collective at all, the engine's included (it skips the gradient all-reduce over a group of
        # one, and clips with torch's clip_grad_norm_ rather than DeepSpeed's, which all-reduced the norm).
        assert not prof["collectives"], (r["loop"], prof["collectives"])
    # ZeRO 0, one process: the engine runs no operator more often than the plain loop (tests/test_step_work.py).
    assert by[("lm", "deepspeed")]["baseline"] == "plain" and by[("lm", "deepspeed")]["profile_extra_ops"] == []
    # Closed form (vocab 99, d 32, d_ff 48, 2 layers, T 40): 6 x (2 x (4 x 32^2 + 2 x 32 x 48) + 32 x 99)
    # + 12 x 2 x 32 x 40 for the LM; the classifier has no per-token head.
    assert by[("lm", "plain")]["flops_per_token"] == 135744
    assert by[("classifier", "plain")]["flops_per_token"] == 135744 - 6 * 32 * 99


def test_in_bf16_the_engine_computes_what_the_plain_autocast_loop_computes(tmp_path: Path, data_dir: Path) -> None:
    """bf16 is torch.autocast over fp32 weights in the engine as in the plain loop (DeepSpeed's torch_autocast): the
    same losses, window by window. DeepSpeed's own bf16 mode (bf16 weights: deepspeed-bf16) drifts from them."""
    out = tmp_path / "bf16.json"
    bench(data_dir, out, "--set", "engine.precision=bf16", "--loops", "plain,deepspeed,deepspeed-bf16", timeout=180)
    by = {(r["task"], r["loop"]): r["loss_windows"] for r in json.loads(out.read_text(encoding="utf-8"))["rows"]}
    for task in ("lm", "classifier"):
        plain, ours, theirs = by[(task, "plain")], by[(task, "deepspeed")], by[(task, "deepspeed-bf16")]
        assert all(math.isfinite(x) for x in plain) and len(plain) == len(ours) == 3
        assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(plain, ours, strict=True)), (task, plain, ours)
        assert not all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(plain[1:], theirs[1:], strict=True)), theirs


def tokens_and_positions(data_dir: Path, steps: int, windows: int) -> dict[str, tuple[list[int], list[int]]]:
    """Per window of `steps` global batches of 13, as the bench orders them: the real input tokens, and the input
    positions with padding (13 x the longest). The tiny preset's tokenizer cut at 40 ids, cls-books-fr train
    reviews; LM inputs are packed next-token windows of 40 ids (never padded), classifier inputs whole (cut)
    reviews."""
    from trainer.config.presets import preset
    from trainer.config.schema import override
    from trainer.data.batching import bucket_batches
    from trainer.data.tokenizer import build_tokenizer
    from trainer.tasks.finetune import load_split

    cfg = override(preset("tiny"), {"data.root": str(data_dir), "tokenizer.max_len": 40, "pretrain.seq_len": 40})
    tok = build_tokenizer(cfg)
    clf = load_split(cfg, cfg.data.train, tok, 0).lengths  # (N,) <sos> + pieces + <eos>, at most 40
    batches = bucket_batches(clf, 13, cfg.seed, 0)  # one epoch holds every window's batches here
    per = [batches[w * steps:(w + 1) * steps] for w in range(windows)]
    return {"lm": ([steps * 13 * 40] * windows, [steps * 13 * 40] * windows),
            "classifier": ([int(sum(clf[b].sum() for b in bs)) for bs in per],
                           [int(sum(len(b) * clf[b].max() for b in bs)) for bs in per])}
