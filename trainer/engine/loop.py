"""The training loop that pretrain.py and finetune.py both run, and what they share around it.

torchtitan's shape: the loop takes one optimizer step per global batch and asks a `Cadence` when to log, evaluate,
checkpoint and stop; a stage hands it a `Task` (its batches, how a micro-batch becomes model inputs, the loss
denominator, what a log row holds) and a `LoopRun` (the engine and where the run writes). Written once here: the resume
guard, epoch rollover, per-micro-step reseeding, the loss scaling, checkpoint timing, `--stop-at`, and the fp32 weights
that go into the artifact.

Loop state (checkpoint.LoopState) after the last step of an epoch says (epoch e, batch = len(batches)): the next
step rolls over. A checkpoint saved as (e + 1, 0) resumes the same way.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from trainer.config.choice import RESUME_AUTO
from trainer.config.schema import ConfigError, RunConfig
from trainer.engine import checkpoint as ckpt
from trainer.engine import deepspeed_engine as eng
from trainer.engine import monitor

SIGNALS = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


@dataclass(frozen=True)
class RunOptions:
    """How a training run starts and where it writes (the command line's run options, typed)."""

    out: Path  # run folder: config.json, env.json, metrics.csv, tb/, checkpoints/, tokenizer/, artifact/
    resume: str | None = None  # "latest" or a checkpoint tag: continue RUN/checkpoints; "auto": continue the run RUN
    #                            holds, else start it; None: a fresh run
    deepspeed_config: str | None = None  # a DeepSpeed JSON overriding the derived keys (else engine.deepspeed_config)
    stop_at: int = 0  # stop after this optimizer step with a checkpoint, as if interrupted (0: never)
    tokenizer: Path | None = None  # an existing tokenizer folder instead of building one

    def __post_init__(self) -> None:
        if self.stop_at < 0:
            raise ConfigError(f"--stop-at must be >= 0 (0: never), got {self.stop_at}")


@dataclass(frozen=True)
class Cadence:
    """When the loop logs, evaluates, checkpoints and stops; each question takes the optimizer steps done."""

    total: int  # optimizer steps of the whole run
    log_every: int  # engine.log_every: a log row is the loop's only host-device sync
    checkpoint_every: int = 0  # engine.checkpoint_every (0: only at the end)
    eval_every: int = 0  # steps between evaluations (0: only at the end)
    eval_epochs: bool = False  # also evaluate when an epoch ends (fine-tuning scores every epoch)
    stop_at: int = 0  # RunOptions.stop_at

    def evaluate(self, step: int, epoch_end: bool) -> bool:
        return step == self.total or (self.eval_every > 0 and step % self.eval_every == 0) \
            or (self.eval_epochs and epoch_end)

    def log(self, step: int, epoch_end: bool) -> bool:
        return step % self.log_every == 0 or self.evaluate(step, epoch_end)

    def checkpoint(self, step: int) -> bool:
        return step in (self.total, self.stop_at) or (self.checkpoint_every > 0 and step % self.checkpoint_every == 0)

    def stop(self, step: int) -> bool:
        return step == self.stop_at and step != self.total


@dataclass(frozen=True)
class Interval:
    """The steps since the last log row: loss summed over ranks, rates of this process."""

    loss_sum: float  # summed loss of the interval's global batches (all ranks)
    count: int  # their denominators summed (predicted tokens, or examples)
    tokens_per_s: float  # real (non-pad) input tokens of this process per second
    examples_per_s: float  # sequences of this process per second
    elapsed_s: float  # since the loop started

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.count)


class Step(Protocol):
    """What one optimizer step needs from a stage (bench/train_throughput.py's plain loop uses the same)."""

    def inputs(self, part: list[int], epoch: int) -> tuple[torch.Tensor, ...]:
        """A micro-batch's model inputs on the CPU: (input_ids (B, T), padding_mask (B, T), ...targets)."""

    def denominator(self, batch: list[int]) -> int:
        """What a global batch's summed loss is divided by (predicted tokens, or examples)."""

    def tokens(self, batch: list[int]) -> int:
        """The real (non-pad) input tokens of these examples, from the data (no tensor is read)."""


class Task(Step, Protocol):
    """What a stage gives the loop."""

    def batches(self, epoch: int) -> Sequence[list[int]]:
        """The epoch's global batches of example indices, in training order (the same on every rank)."""

    def report(self, engine: Any, state: ckpt.LoopState, interval: Interval, evaluate: bool) -> dict[str, Any]:
        """The log row at a log point; with `evaluate`, also the evaluation (and its LoopState.history record)."""

    def improved(self, state: ckpt.LoopState) -> bool:
        """After an evaluation: these weights are the best so far (the loop checkpoints them, then calls
        store_best)."""

    def store_best(self, engine: Any, ckpt_dir: Path, tag: str, state: ckpt.LoopState) -> None:
        """Store the weights just checkpointed as the ones the artifact will hold (call on every rank)."""

    def stop_early(self, state: ckpt.LoopState) -> str | None:
        """After an evaluation: why the run ends here (early stopping), or None to go on."""


@dataclass(frozen=True)
class LoopRun:
    """What the loop runs on and where it writes: the same for every step of one run."""

    engine: Any  # the DeepSpeed engine (deepspeed_engine.initialize)
    cadence: Cadence
    plan: eng.BatchPlan  # micro-batch, accumulation, world size
    info: eng.DistInfo  # this rank and its device
    seed: int  # cfg.seed: dropout of every micro-step derives from it
    log: monitor.RunLog
    ckpt_dir: Path  # RUN/checkpoints
    keep_last: int  # engine.keep_checkpoints: complete checkpoints kept, older ones pruned
    meta: dict[str, Any]  # written into every checkpoint's marker (stage, objective or run name)
    auto_resume: bool = False  # started with --resume auto: the same command continues after an interruption


def train(run: LoopRun, task: Task, state: ckpt.LoopState) -> bool:
    """Optimizer steps from `state` on; True when the run reached its end, False at the cadence's stop step.

    Either way the state of the last step is in a checkpoint (a finished run's checkpoint holds done=True). SIGINT or
    SIGTERM: every rank stops after the same step, the checkpoint of that step is written, then Interrupted."""
    engine, cadence, info, log, ckpt_dir = run.engine, run.cadence, run.info, run.log, run.ckpt_dir
    t0 = t_log = time.perf_counter()
    loss_acc = torch.zeros((), device=info.device)  # summed loss since the last log row (on the device: no sync)
    count = tokens = examples = 0  # denominators (all ranks), this process's real tokens and sequences
    batches = task.batches(state.epoch)
    try:
        with StopSignals() as signals:
            while state.step < cadence.total and not state.done:
                if state.batch >= len(batches):  # the epoch is used up
                    state.epoch, state.batch = state.epoch + 1, 0
                    batches = task.batches(state.epoch)
                batch = batches[state.batch]
                n, t, e = optimizer_step(engine, task, batch, state.epoch, state.step, run.plan, info, run.seed,
                                         loss_acc)
                count, tokens, examples = count + n, tokens + t, examples + e
                state.step, state.batch = state.step + 1, state.batch + 1
                state.tokens += task.tokens(batch)
                log.advance()
                epoch_end = state.batch == len(batches)
                logged, evaluated = cadence.log(state.step, epoch_end), cadence.evaluate(state.step, epoch_end)
                if logged:
                    (loss_sum,) = eng.all_reduce_sum([float(loss_acc)])  # the one host-device sync
                    refuse_diverged(loss_sum, state.step, ckpt_dir)
                    now = time.perf_counter()
                    interval = Interval(loss_sum, count, tokens / max(1e-9, now - t_log),
                                        examples / max(1e-9, now - t_log), now - t0)
                    log.log(state.step, **task.report(engine, state, interval, evaluated))
                    loss_acc.zero_()
                    count, tokens, examples, t_log = 0, 0, 0, time.perf_counter()
                improved = evaluated and task.improved(state)
                early = task.stop_early(state) if evaluated else None
                state.done = state.step == cadence.total or early is not None
                signum = signals.agreed()
                tag, t_save = None, time.perf_counter()
                if cadence.checkpoint(state.step) or state.done or improved or signum:
                    tag = _checkpoint(run, state, loss_acc, logged)
                if improved:
                    assert tag is not None
                    task.store_best(engine, ckpt_dir, tag, state)
                t_log += time.perf_counter() - t_save  # saving is no training: the next row's rates leave it out
                if signum:
                    how = "run the same command again to continue (--resume auto)" if run.auto_resume \
                        else "continue with the same command and --out plus --resume"
                    log.print(f"interrupted by {SIGNALS.get(signum, signum)} after step {state.step}: checkpoint "
                              f"{ckpt_dir / str(tag)}; {how}")
                    raise Interrupted(signum)
                if early is not None and state.step < cadence.total:
                    log.print(f"early stop after step {state.step}: {early}")
                if cadence.stop(state.step):
                    log.print(f"stopped at step {state.step} (--stop-at); checkpoint {ckpt_dir / str(tag)}; "
                              "continue with --resume")
                    return False
        return True
    finally:
        log.close()


def _checkpoint(run: LoopRun, state: ckpt.LoopState, loss_acc: torch.Tensor, logged: bool) -> str:
    """Save the state of this step; only finite weights are saved, so the previous checkpoint stays "latest"."""
    if not logged:
        refuse_diverged(eng.all_reduce_sum([float(loss_acc)])[0], state.step, run.ckpt_dir)
    if not eng.weights_finite(run.engine):
        refuse_diverged(float("nan"), state.step, run.ckpt_dir, what="a weight")
    return ckpt.save(run.engine, run.ckpt_dir, state, run.keep_last, run.meta)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a run after a checkpoint; `code` is the exit status (130, 143)."""

    def __init__(self, signum: int) -> None:
        super().__init__(SIGNALS.get(signum, str(signum)))
        self.signum, self.code = signum, 128 + signum


class StopSignals:
    """SIGINT/SIGTERM during training: note the signal; every step, `agreed()` tells every rank whether any rank got
    one, so they all stop after the same step and write one checkpoint. A second Ctrl-C stops at once.

    The agreement is an all-reduce (max) of one int on the host, over a gloo group of its own, that travels while
    the next step runs: after step s each rank starts it without waiting and reads it after step s + 1, so no step
    waits on a peer or on a device for it (the loop's one host-device sync stays the log row). Every rank reads the
    same value after the same step; a signal stops the run one step after the one it arrived in."""

    def __init__(self) -> None:
        self.signum, self.at = 0, 0.0
        self.old: dict[int, Any] = {}
        self.pending: tuple[Any, torch.Tensor] | None = None  # (work, (1,) int32) of the all-reduce in flight

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum:
            # Ctrl-C pressed again stops at once, without a checkpoint. Not a signal within the first second: under
            # the DeepSpeed launcher one Ctrl-C brings SIGINT from the terminal and SIGTERM from the launcher.
            if signum == signal.SIGINT and time.monotonic() - self.at > 1.0:
                raise Interrupted(signum)
            return
        self.signum, self.at = signum, time.monotonic()
        if eng.is_main():
            which = "the next" if eng.world_size() > 1 else "this"  # the agreement takes a step (agreed)
            os.write(2, f"{SIGNALS[signum]}: stopping after {which} step with a checkpoint (Ctrl-C again: at once, "
                        "without one)\n".encode())

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self.old = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        for s, handler in self.old.items():
            signal.signal(s, handler)
        if self.pending is not None and exc_type is None:
            self.pending[0].wait()  # every rank started it; after an error a peer may never have

    def agreed(self) -> int:
        """The signal any rank had got by the previous call (the largest number), 0 when none had."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.signum
        got = 0
        if self.pending is not None:
            work, flag = self.pending
            work.wait()  # started a step ago: done by now unless a peer is a step behind
            got = int(flag[0])
        flag = torch.tensor([self.signum], dtype=torch.int32)
        self.pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_flag_group(), async_op=True), flag)
        return got


@functools.cache
def _flag_group() -> Any:
    """A gloo group for the stop flag alone: its all-reduce is in flight while the step's own collectives run."""
    return dist.new_group(backend="gloo")


class Diverged(ValueError):
    """The loss (or a weight) is no longer finite: the run stops without an artifact or a checkpoint of that state."""


def refuse_diverged(loss_sum: float, step: int, ckpt_dir: Path, what: str = "the loss") -> None:
    """Stop a run whose loss went inf/nan. Checked at every log row and before every checkpoint, so `latest` only
    ever names finite weights. A ValueError: one line, exit 2 (a learning rate or data problem, not a crash)."""
    if math.isfinite(loss_sum):
        return
    last = ckpt.read_latest(ckpt_dir)
    keep = (f"{ckpt_dir / last} (the last checkpoint) holds finite weights and --resume continues from it; lower the "
            "learning rate if it diverges again") if last else "no checkpoint was written"
    raise Diverged(f"{what} is {loss_sum} at step {step}: training diverged; stopped without an artifact; {keep}")


def optimizer_step(engine: Any, task: Step, batch: list[int], epoch: int, step: int, plan: eng.BatchPlan,
                   info: eng.DistInfo, seed: int, loss_acc: torch.Tensor) -> tuple[int, int, int]:
    """Optimizer step number `step` (0-based) on global batch `batch`: this rank runs its micro-batches of it, and
    the gradient is that of the loss summed over all ranks / the batch's denominator. Adds the summed loss to
    `loss_acc` (in place, on the device); returns (denominator, this process's real input tokens, sequences)."""
    n = task.denominator(batch)  # the whole global batch's: every rank knows it
    tokens = examples = 0
    for micro, part in enumerate(micro_batches(batch, plan)[info.rank::plan.world_size]):
        inputs = to_device(task.inputs(part, epoch), info.device)
        tokens, examples = tokens + task.tokens(part), examples + len(part)
        seed_micro_step(seed, step, micro, info.rank, info.device)
        loss = engine(*inputs)
        # DeepSpeed averages gradients over ranks: scale so the gradient is that of (global sum / n).
        engine.backward(loss * (plan.world_size / max(1, n)), scale_wrt_gas=False)
        engine.step()
        loss_acc += loss.detach()
    return n, tokens, examples


# ---------------------------------------------------------------------------------------------- around the loop


def resume_tags(run_dir: Path, cfg: RunConfig, ckpt_dirs: list[Path], resume: str | None) -> list[str | None]:
    """The checkpoint each of `ckpt_dirs` resumes from (None: starts fresh), checked before anything is written.

    With --resume the run folder must hold the same config and at least one folder a checkpoint that verifies;
    without it no folder may hold checkpoints (a fresh run would mix its tags with another run's).

    --resume auto (a scheduler reruns the same command after a preemption): a folder without config.json starts the
    run, as without --resume; a folder with it is this run, continued from each folder's latest complete checkpoint.
    The config must be the same, a latest checkpoint that does not verify is an error (never a silent start
    over), and a run stopped before its first checkpoint starts again at step 0, which the log says.

    Every rank decides before the process group starts and rank 0 writes config.json only after it, so all ranks
    see the same folder."""
    if resume == RESUME_AUTO:
        if not (run_dir / "config.json").is_file():
            monitor.note(f"--resume auto: {run_dir} holds no run yet: starting one")
            resume = None
        else:
            monitor.check_resume_config(run_dir, cfg)
            tags = [ckpt.find(d) if ckpt.complete_tags(d) or ckpt.read_latest(d) else None for d in ckpt_dirs]
            if all(t is None for t in tags):
                monitor.note(f"--resume auto: {run_dir} holds this run but no complete checkpoint (it stopped before "
                             "its first one): training again from step 0")
            return tags
    if resume is None:
        if (run_dir / "config.json").is_file():
            raise ckpt.CheckpointError(f"{run_dir} holds a run ({run_dir / 'config.json'}): continue it with --resume "
                                       "(alone, it takes the run's own config), or choose a new --out")
        for d in ckpt_dirs:
            ckpt.refuse_overwrite(d)
        return [None] * len(ckpt_dirs)
    if not (run_dir / "config.json").is_file():
        raise ckpt.CheckpointError(f"nothing to resume: {run_dir / 'config.json'} not found")
    monitor.check_resume_config(run_dir, cfg)
    tags = [ckpt.find(d, resume) if d.is_dir() else None for d in ckpt_dirs]
    if all(t is None for t in tags):
        ckpt.find(ckpt_dirs[0], resume)  # raises, naming the folder that should have held them
    return tags


def steps_of(task: Task, epochs: int, max_steps: int, what: str, global_batch: int) -> tuple[int, int]:
    """(global batches per epoch, optimizer steps of the run): max_steps, else epochs x batches per epoch."""
    per_epoch = len(task.batches(0))
    if per_epoch == 0:
        raise ConfigError(f"{what} cannot fill one global batch of {global_batch}")
    return per_epoch, max_steps or epochs * per_epoch


def final_model(engine: Any, ckpt_dir: Path, state: ckpt.LoopState,
                build: Callable[[], torch.nn.Module]) -> torch.nn.Module | None:
    """`build()` holding the engine's fp32 weights on rank 0, None on the others (call on every rank)."""
    tag = ckpt.read_latest(ckpt_dir) or ckpt.tag_for(state.step)
    weights = eng.fp32_state_dict(engine, ckpt_dir, tag)
    if not eng.is_main():
        return None
    model = build()
    model.load_state_dict(weights, strict=True)
    return model


# ---------------------------------------------------------------------------------------------- micro-batches


def full_batches(batches: list[list[int]], plan: eng.BatchPlan) -> list[list[int]]:
    """Drop a last global batch too small to give every micro-step at least one example."""
    return [b for b in batches if len(b) >= plan.grad_accum * plan.world_size]


def order_digest(batches: list[list[int]]) -> str:
    """sha256 of an epoch's global batches in order ("3,1,4;1,5" as UTF-8): two runs with equal digests trained on
    the same examples in the same order (finetune --compare records it per epoch)."""
    return hashlib.sha256(";".join(",".join(map(str, b)) for b in batches).encode()).hexdigest()


def micro_batches(batch: list[int], plan: eng.BatchPlan) -> list[list[int]]:
    """Cut a global batch into grad_accum x world_size micro-batches; micro-step a of rank r is slot a * W + r.

    The cut depends only on the global batch, so 2 ranks x B see the same examples as 1 rank x 2B."""
    n = plan.grad_accum * plan.world_size
    return [part.tolist() for part in np.array_split(np.asarray(batch, dtype=np.int64), n)]


def seed_micro_step(seed: int, step: int, micro: int, rank: int, device: torch.device) -> None:
    """Dropout (and any torch RNG) of one micro-step depends only on (seed, step, micro, rank): resume is exact.

    Seeds the CPU's generator and, on a GPU, this rank's: torch.manual_seed would also queue a seed for every
    accelerator torch knows and has not started (XPU, MTIA...), formatting a Python traceback for each, every call."""
    s = int(np.random.SeedSequence([seed, step, micro, rank]).generate_state(1)[0])
    torch.default_generator.manual_seed(s)
    if device.type == "cuda":
        torch.cuda.manual_seed(s)  # the current device: init_distributed made it this rank's


def to_device(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """CPU batch tensors -> `device`. On CUDA they are pinned first: a copy from pageable memory is synchronous
    whatever `non_blocking` says, and would stall the host until the GPU had finished the previous step."""
    if device.type != "cuda":
        return tensors
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)
