"""Our DeepSpeed engine's training step does no more work than the plain PyTorch loop's, counted, not timed
(bench/step_profile.py: counts do not depend on load). One step of each loop on the tiny preset, 2 micro-batches a
step (an accumulation boundary every other micro-step), ZeRO 0 (fp32 and bf16 autocast) and ZeRO 2, by
bench/train_throughput.py --profile; and between two log rows the training loop itself reads nothing from the device.
A host read (`.item()`, `bool(t)`), a synchronize call or a `.cpu()` there would each stall a GPU's queue."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import procs
import pytest
from procs import REPO, env, free_port

GRAD_ACCUM = 2
PHASES = ("step.forward", "step.backward", "step.optimizer")  # bench/step_profile.py's
# What DeepSpeed 0.19.8's ZeRO 1/2 optimizer does per optimizer step beyond the plain loop, with gradient clipping on
# (compute_grad_norm=false, its one switch, refuses clipping): docs/BENCHMARKS.md, "What a step does".
ZERO_2_EXTRA = {
    "host_reads": 3,  # the gradient norm read on the host: is_invalid_grad_norm twice, a masked_fill_ with a tensor
    "collectives": GRAD_ACCUM + 1,  # each micro-step's gradient bucket reduced (over a group of one here), the norm
    "cat": GRAD_ACCUM + 2,  # each bucket flattened when it is reduced, the norm's two stacks
}
# Python calls a micro-step of our loop makes beyond the plain loop's: reseeding the micro-step (exact resume) and
# counting its tokens from the data. torch.manual_seed alone made about 800 (a traceback per idle accelerator).
LOOP_CALLS_PER_MICRO_STEP = 15
# At ZeRO 0, Python calls per micro-step DeepSpeed makes around each of forward, backward and step beyond the plain
# loop's (its counters, the hooks on the loss, the timers it checks are off); its zero_grad's walk over the module
# made about 280 more a step.
DEEPSPEED_CALLS_PER_MICRO_STEP = 100


def profiles(tmp_path: Path, data_dir: Path, zero: int, *extra: str) -> dict[tuple[str, str], dict]:
    out = tmp_path / f"zero{zero}.json"
    cmd = [sys.executable, str(REPO / "bench" / "train_throughput.py"), "--preset", "tiny", "--task", "lm",
           "--micro-batch", "13", "--seq-len", "40", "--warmup", "0", "--windows", "1", "--steps", "1", "--profile",
           "--set", f"engine.zero_stage={zero}", "--set", f"engine.grad_accum={GRAD_ACCUM}", *extra,
           "--json", str(out)]
    e = {**env(), "TS_DATA": str(data_dir)}
    for name in ("LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(name, None)
    p = procs.run(cmd, 300, cwd=REPO, env=e)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text(encoding="utf-8"))["rows"]
    return {(r["loop"], r["precision"]): r["profile"] for r in rows}


@pytest.mark.parametrize("zero, extra", [(0, ["--precisions", "fp32,bf16"]), (2, [])], ids=["zero0", "zero2"])
def test_the_engines_step_does_no_more_than_the_plain_loops(tmp_path: Path, data_dir: Path, zero: int,
                                                            extra: list[str]) -> None:
    allowed = ZERO_2_EXTRA if zero == 2 else {}
    found = profiles(tmp_path, data_dir, zero, *extra)
    for prec in ("fp32", "bf16") if zero == 0 else ("fp32",):
        plain, ours = found[("plain", prec)], found[("deepspeed", prec)]
        where = (zero, prec, {k: (plain[k], ours[k]) for k in plain if k not in ("ops", "phases_ms")})
        # What stalls a GPU's queue: none in the plain loop, none in the engine beyond DeepSpeed's ZeRO 1/2 norm.
        assert plain["host_reads"] == plain["sync_calls"] == plain["to_host"] == 0, where
        assert ours["host_reads"] <= allowed.get("host_reads", 0), where
        assert ours["sync_calls"] == ours["to_host"] == ours["device_syncs"] == 0, where
        assert sum(ours["collectives"].values()) <= allowed.get("collectives", 0), where
        # One optimizer step, and no more of its work: the same torch Adam (over one flat partition at ZeRO 2).
        assert ours["optimizer_steps"] == plain["optimizer_steps"] == 1, where
        assert ours["optimizer_counter_reads"] <= plain["optimizer_counter_reads"], where
        # No more kernels (compute ops stand in for them on a CPU) and no more copies: flat buffers included.
        assert ours["compute_ops"] <= plain["compute_ops"], where
        assert ours["copies"]["aten::copy_"] <= plain["copies"]["aten::copy_"], where
        assert ours["copies"]["aten::cat"] <= plain["copies"]["aten::cat"] + allowed.get("cat", 0), where
        if zero == 0:
            assert ours["aten_ops"] <= plain["aten_ops"], where
        # Our loop's own Python around DeepSpeed's calls.
        more = {k: ours["python_calls"][k] - plain["python_calls"][k] for k in plain["python_calls"]}
        assert more["loop"] <= LOOP_CALLS_PER_MICRO_STEP * GRAD_ACCUM, (more, where)
        if zero == 0:  # ZeRO 1/2 hook every parameter's gradient in Python (docs/BENCHMARKS.md)
            assert all(more[ph] <= DEEPSPEED_CALLS_PER_MICRO_STEP * GRAD_ACCUM for ph in PHASES), (more, where)


SCRIPT = r"""
import json, sys, tempfile
from pathlib import Path
import torch
sys.path.insert(0, "bench")
import step_profile
from trainer.config.presets import tiny
from trainer.config.schema import override
from trainer.engine import checkpoint as ckpt, deepspeed_engine as eng, loop, monitor
from trainer.tasks.pretrain import LMObjective

cfg = override(tiny(), {"engine.grad_accum": 2})
info = eng.init_distributed()
ds, plan = eng.ds_config(cfg, "pretrain", 1)
T = 7  # input ids a window


class Windows:
    # Random next-token windows, 12 global batches of 26 an epoch: what the loop asks of a stage.
    ids = torch.randint(4, cfg.model.vocab_size, (26 * 12, T + 1), generator=torch.Generator().manual_seed(0))

    def batches(self, epoch): return [list(range(i, i + 26)) for i in range(0, 26 * 12, 26)]
    def inputs(self, part, epoch):
        x = self.ids[part]
        return x[:, :-1], torch.zeros(len(part), T, dtype=torch.bool), torch.arange(len(part) * T), x[:, 1:].flatten()
    def denominator(self, batch): return len(batch) * T
    def tokens(self, batch): return len(batch) * T
    def report(self, engine, state, interval, evaluate): return {"loss": interval.loss}
    def improved(self, state): return False
    def store_best(self, engine, ckpt_dir, tag, state): pass
    def stop_early(self, state): return None


def run(total, log_every):
    torch.manual_seed(0)
    engine = eng.initialize(LMObjective(cfg.model, causal=True), ds, cfg.pretrain.optim, total)
    out = Path(tempfile.mkdtemp())
    r = loop.LoopRun(engine, loop.Cadence(total, log_every), plan, info, 0,
                     monitor.RunLog(out, total, 0, "count", ["loss"]), out / "checkpoints", 1, {})
    c = step_profile.count(lambda: loop.train(r, Windows(), ckpt.LoopState()), info.device)
    return {k: c[k] for k in ("host_reads", "sync_calls", "to_host", "device_syncs")} | {
        "collectives": sum(c["collectives"].values())}


print(json.dumps({"4 steps, 1 row": run(4, 4), "8 steps, 1 row": run(8, 8), "8 steps, 2 rows": run(8, 4)}))
"""


def test_between_log_rows_the_training_loop_reads_nothing_from_the_device() -> None:
    """trainer/engine/loop.py's train(), a real engine, one process: 4 more steps without a log row add no host read,
    synchronize call, copy to the host or collective; a log row adds one read (the summed loss). Each run ends with a
    checkpoint (its reads are the same in every run)."""
    run_env = {**env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    run_env.pop("LOCAL_SIZE", None)
    p = procs.run([sys.executable, "-c", SCRIPT], 300, cwd=REPO, env=run_env)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    short, long_, logged = r["4 steps, 1 row"], r["8 steps, 1 row"], r["8 steps, 2 rows"]
    assert long_ == short, r  # steps 5-8 read nothing
    assert logged == {**long_, "host_reads": long_["host_reads"] + 1}, r  # a row reads the loss once
