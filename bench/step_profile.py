"""What one training step does, counted: counts do not depend on the machine's load, unlike times.

`count(run, device)` runs `run` (a training step, or more) under torch.profiler and counts:
- aten ops launched on the host, and compute ops (aten ops with no aten op inside them, views and allocations left
  out: what would each launch a kernel on a GPU); on a GPU, the device kernels themselves;
- host reads of a tensor's value (`.item()`, `float(t)`, `bool(t)`: aten::_local_scalar_dense), apart from those
  inside an optimizer's step (torch's unfused Adam reads its step counters, CPU tensors on a GPU too): on a GPU each
  read waits for the device;
- synchronize calls (torch.cuda's, its streams' and events', DeepSpeed's accelerator's, which is a no-op on a CPU and
  counted all the same) and copies to the host (`.cpu()`, `.tolist()`, `.numpy()`), made through Python; on a GPU
  also the cuda*Synchronize calls the profiler sees;
- collectives (c10d ops), tensor copies (aten::copy_, aten::cat: flat buffers are built by cat and filled by copy_),
  optimizer steps (torch.optim's "Optimizer.step#" ranges);
`profile(step, device)` counts one step so, then runs another counting Python calls (this thread's), by phase:
"loop" is everything outside the step's forward, backward and optimizer phases, which both loops name with `phase`
(the engine's through `annotate`).
bench/train_throughput.py --profile reports them per loop; tests/test_step_work.py checks that the DeepSpeed engine's
step does no more of each than the plain PyTorch loop's.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

PHASES = ("step.forward", "step.backward", "step.optimizer")
LOOP = "loop"  # Python calls outside the phases
ITEM = "aten::_local_scalar_dense"  # what .item(), float(t), int(t), bool(t) run
DEVICE_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPIES = ("aten::copy_", "aten::cat", "aten::_foreach_copy_")
OPTIMIZER_STEP = "Optimizer.step#"  # torch.optim's record_function around every optimizer's step
# Leaf aten ops that launch no kernel: views, metadata and allocations.
NO_KERNEL = frozenset(f"aten::{n}" for n in (
    "view", "_unsafe_view", "view_as", "as_strided", "t", "transpose", "permute", "expand", "reshape", "alias",
    "detach", "detach_", "slice", "select", "narrow", "unsqueeze", "squeeze", "unflatten", "split", "chunk", "unbind",
    "split_with_sizes", "empty", "empty_like", "empty_strided", "lift_fresh", "resolve_conj", "resolve_neg",
    "_reshape_alias", "result_type", "is_nonzero", "item", "_local_scalar_dense", "to", "numpy_T", "set_"))
HOST_COPIES = ("cpu", "tolist", "numpy")  # torch.Tensor methods that bring a tensor's data to the host
_phase = [LOOP]


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A part of the step (PHASES): named in the profile, and the owner of the Python calls made inside it."""
    outer, _phase[0] = _phase[0], name
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        _phase[0] = outer


def annotate(engine: Any) -> None:
    """Name the engine's forward, backward and step as the plain loop names its own (instance attributes:
    nn.Module.__call__ and our loop look them up on the engine)."""
    for name, label in zip(("forward", "backward", "step"), PHASES, strict=True):
        fn = getattr(engine, name)

        def wrapped(*a: Any, _fn: Callable[..., Any] = fn, _label: str = label, **k: Any) -> Any:
            with phase(_label):
                return _fn(*a, **k)

        setattr(engine, name, wrapped)


@contextlib.contextmanager
def host_waits() -> Iterator[Counter[str]]:
    """Counts, during the block, the Python calls that make the host wait for a device: synchronize (torch.cuda's,
    its streams' and events', DeepSpeed's accelerator's) and copies to the host (HOST_COPIES)."""
    from deepspeed.accelerator import get_accelerator

    counts: Counter[str] = Counter()
    patched: list[tuple[Any, str, Any, bool]] = []  # (owner, name, original, was the owner's own attribute)

    def count(owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)

        def counted(*a: Any, **k: Any) -> Any:
            counts[key] += 1
            return original(*a, **k)

        patched.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, counted)

    for name in HOST_COPIES:
        count(torch.Tensor, name, "to_host")
    count(torch.cuda, "synchronize", "sync_calls")
    count(torch.cuda.Stream, "synchronize", "sync_calls")
    count(torch.cuda.Event, "synchronize", "sync_calls")
    count(get_accelerator(), "synchronize", "sync_calls")
    try:
        yield counts
    finally:
        for owner, name, original, own in reversed(patched):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


@contextlib.contextmanager
def python_calls() -> Iterator[Counter[str]]:
    """Python function calls made during the block, by the phase they were made in (LOOP outside every phase)."""
    counts: Counter[str] = Counter()

    def tracer(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            counts[_phase[0]] += 1

    sys.setprofile(tracer)
    try:
        yield counts
    finally:
        sys.setprofile(None)


def profile(step: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """Run `step` twice (two steps of a warmed-up loop): the first counted by `count`, the second counting Python
    calls (python_calls slows a step down: kept out of the timed one)."""
    out = count(step, device)
    with python_calls() as calls:
        step()
    out["python_calls"] = {k: calls[k] for k in (LOOP, *PHASES)}
    return out


def count(run: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """Run `run` once under torch.profiler and host_waits: what it did (module docstring) and its host times."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync()
    with torch.profiler.profile(activities=acts) as prof, host_waits() as waits:
        t0 = time.perf_counter()
        run()
        sync()
        wall = time.perf_counter() - t0
    events = prof.events()
    host = [e for e in events if e.device_type == DeviceType.CPU]
    names: Counter[str] = Counter()
    self_ms: Counter[str] = Counter()
    for e in host:
        name = "compiled graph" if e.name.startswith("## Call CompiledFxGraph") else e.name  # drop the graph's hash
        names[name] += 1
        self_ms[name] += e.self_cpu_time_total / 1000
    reads = [e for e in host if e.name == ITEM]
    counter_reads = sum(1 for e in reads if _inside(e, OPTIMIZER_STEP))
    return {
        "wall_ms": 1000 * wall,
        "aten_ops": sum(c for n, c in names.items() if n.startswith("aten::")),
        "compute_ops": sum(1 for e in host if e.name.startswith("aten::") and e.name not in NO_KERNEL
                           and not any(c.name.startswith("aten::") for c in e.cpu_children)),
        "kernels": sum(1 for e in events if e.device_type == DeviceType.CUDA),
        "host_reads": len(reads) - counter_reads,
        "optimizer_counter_reads": counter_reads,
        "sync_calls": waits["sync_calls"],
        "to_host": waits["to_host"],
        "device_syncs": sum(names[n] for n in DEVICE_SYNCS),
        "collectives": {n: c for n, c in names.items() if n.startswith("c10d::")},
        "copies": {n: names[n] for n in COPIES},
        "optimizer_steps": sum(c for n, c in names.items() if n.startswith(OPTIMIZER_STEP)),
        "phases_ms": {ph: sum(e.cpu_time_total for e in host if e.name == ph) / 1000 for ph in PHASES},
        "ops": {n: [c, round(self_ms[n], 3)] for n, c in names.items()},
    }


def _inside(event: Any, prefix: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


def extra_ops(loop_: dict[str, Any], base: dict[str, Any], top: int = 12) -> list[tuple[str, int, float, float]]:
    """Operators a loop's step runs more often than its baseline's: (name, extra calls, self ms of all its calls in
    the loop, in the baseline), most extra calls first."""
    rows = [(n, c - base["ops"].get(n, [0, 0.0])[0], ms, base["ops"].get(n, [0, 0.0])[1])
            for n, (c, ms) in loop_["ops"].items() if n not in PHASES and c > base["ops"].get(n, [0, 0.0])[0]]
    return sorted(rows, key=lambda r: (-r[1], -r[2]))[:top]


def tables(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: one profiled step of each loop side by side, per task and precision; then what a loop adds."""
    out: list[str] = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if "profile" in r:
            groups.setdefault((r["task"], r["precision"]), []).append(r)
    metric = [("wall ms", lambda p: f"{p['wall_ms']:.1f}"),
              *[(f"{ph.split('.')[1]} host ms", lambda p, ph=ph: f"{p['phases_ms'][ph]:.1f}") for ph in PHASES],
              ("aten ops", lambda p: str(p["aten_ops"])), ("compute ops", lambda p: str(p["compute_ops"])),
              ("device kernels", lambda p: str(p["kernels"])),
              ("host reads (.item(), bool(t); optimizer counters apart)",
               lambda p: f"{p['host_reads']} (+{p['optimizer_counter_reads']})"),
              ("synchronize calls / cuda*Synchronize", lambda p: f"{p['sync_calls']} / {p['device_syncs']}"),
              (".cpu() / .tolist() / .numpy()", lambda p: str(p["to_host"])),
              ("collectives", lambda p: ", ".join(f"{n.split('::')[1]} {c}" for n, c in p["collectives"].items())
               or "0"),
              ("copy_ / cat / _foreach_copy_", lambda p: " / ".join(str(c) for c in p["copies"].values())),
              ("optimizer steps", lambda p: str(p["optimizer_steps"])),
              ("Python calls: loop / forward / backward / optimizer",
               lambda p: " / ".join(str(c) for c in p["python_calls"].values()))]
    for (task, prec), rs in groups.items():
        out += ["", f"One profiled step, {task}, {prec} (torch.profiler; host times include the profiler's own cost):",
                "", "| | " + " | ".join(r["loop"] for r in rs) + " |", "|---|" + "---:|" * len(rs)]
        out += [f"| {name} | " + " | ".join(fmt(r["profile"]) for r in rs) + " |" for name, fmt in metric]
        for r in rs:
            if r.get("profile_extra_ops"):
                out += ["", f"{r['loop']} runs more often than {r['baseline']} ({task}, {prec}; calls more, self "
                        f"ms of all calls there / in {r['baseline']}): "
                        + "; ".join(f"{n} +{c} ({ms:.2f} / {base_ms:.2f})"
                                    for n, c, ms, base_ms in r["profile_extra_ops"])]
    return out
