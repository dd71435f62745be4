"""What tracing costs the server: texts/s at concurrency c (64 by default, one review per call, closed loop) of three
servers of one bundle, measured in turns within one run (the order rotates every round), so that a shared machine's
load falls on all three alike:
  - before: the code before tracing (`--before`, a tree of it: `git archive COMMIT | tar -x -C DIR`; without it,
    only off and on take turns, so that more rounds fit the same time);
  - off: this tree without OTEL_* variables (tracing off; request ids and access lines on, as by default);
  - on: this tree exporting every call's spans (OTEL_TRACES_SAMPLER=always_on) over OTLP/gRPC to a receiver that
    counts them, in a process of its own as a collector would be (tests/otlp_receiver.py, ReceiverProcess).
Prints each round's rows, the ratios off/before and on/off of texts/s and of the server's CPU time per text (the
median over rounds: on a shared machine the CPU per text moves less than the rate), spans received, a call's
telemetry hooks timed in this process with tracing off and on, and the load average at the start and the end
(docs/BENCHMARKS.md, Tracing).

With --server-cpus (a taskset list), the servers run on those cores and everything else (this load generator, the
receiver, the span export processes) on the others: a machine with cores to spare beside the server's, where the
export's CPU is not the calls' (it is still counted in the CPU per text).

    python bench/telemetry_bench.py --bundle /tmp/lab-bundle [--before /tmp/before] [--rounds 5] [--seconds 5]
        [--server-cpus 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))
from otlp_receiver import ReceiverProcess  # noqa: E402
from serve_bench import bench_server, cpu_seconds  # noqa: E402
from serving_fixtures import ServerProcess, reviews  # noqa: E402
from workers_bench import cores, cpu_list  # noqa: E402

from trainer.config.presets import data_sets  # noqa: E402

MODES = ("before", "off", "on")
# what the hooks' timings send as a call's headers and span attributes
_HEADERS = [("user-agent", "grpc-python/1"), ("x-request-id", "bench-1")]
_ATTRIBUTES = {"rpc.system.name": "grpc", "rpc.method": "sentiment.v1.SentimentService/Classify"}


class _Measured:
    """What serve_bench.bench_server reads of a server: its ports, its pids and its metrics."""

    def __init__(self, server: ServerProcess) -> None:
        self.server, self.port = server, server.wait_listening(120)
        # its CPU: the server's process and its span export process (serving/telemetry/export.py), when tracing
        self.metrics_port = server.metrics_port
        self.exporters = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
        self.pids = [server.proc.pid, *self.exporters]

    def metric(self, name: str) -> float:
        value = self.server.metric(name)
        return float("nan") if value is None else value


def _threads(pid: int) -> dict[int, set[int]]:
    """The cores each live thread of process `pid` may run on (a thread that ends meanwhile is left out)."""
    cores = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        try:
            cores[tid] = os.sched_getaffinity(tid)
        except ProcessLookupError:
            pass
    return cores


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` (sched_setaffinity moves one thread; those made later inherit its set), again
    until none is left on other cores: a thread started meanwhile by one not yet moved has the old set."""
    for _ in range(10):
        stray = [tid for tid, cores in _threads(pid).items() if cores != cpus]
        if not stray:
            return
        for tid in stray:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                pass
    raise RuntimeError(f"process {pid}: threads still outside cores {sorted(cpus)}")


def _cores_of(pids: list[int]) -> list[int]:
    """The cores any thread of these processes may run on."""
    return sorted(set().union(*(cores for pid in pids for cores in _threads(pid).values())))


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True, help="bundle folder all three servers serve")
    ap.add_argument("--before", type=Path, help="a tree of the code before tracing (without it: off and on only)")
    ap.add_argument("--data", type=Path, default=Path(data_sets()),
                    help="folder holding cls-books-fr/ (its test reviews are the texts)")
    ap.add_argument("--concurrency", type=int, default=64, help="closed-loop callers")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per turn (after 2 s of warm-up)")
    ap.add_argument("--rounds", type=int, default=5, help="turns of each server")
    ap.add_argument("--texts", type=int, default=256, help="distinct reviews drawn from the test split")
    ap.add_argument("--json", type=Path, help="write every turn's row, the ratios and the load averages to this file")
    ap.add_argument("--server-cpus", type=cpu_list, help="cores the servers run on (taskset's list, e.g. 0); the "
                    "load generator, the receiver and the span export processes then run on the others")
    args = ap.parse_args()
    server_cpus = set(cores(args.server_cpus)) if args.server_cpus else None
    other_cpus = os.sched_getaffinity(0) - (server_cpus or set())
    if server_cpus is not None and (not server_cpus or not other_cpus):
        ap.error(f"--server-cpus {args.server_cpus}: must name some but not all of the cores this process may use "
                 f"{sorted(os.sched_getaffinity(0))}")
    modes = MODES if args.before else MODES[1:]
    pairs = [("off", "before"), ("on", "off")] if args.before else [("on", "off")]
    texts = reviews(args.data, args.texts)
    for k in [k for k in os.environ if k.startswith("OTEL_")]:  # only "on" traces: none left from the shell
        del os.environ[k]
    start_load = _load()
    print(f"load average at start: {start_load}", flush=True)
    with ReceiverProcess() as receiver:
        if server_cpus is not None:
            _pin(os.getpid(), other_cpus)  # the callers' threads, made later, inherit it
            _pin(receiver.proc.pid, other_cpus)
        # The SDK's own export settings (OTEL_BSP_*: every 5 s or 512 spans, a queue of 2,048), every call sampled.
        env = {"before": {"PYTHONPATH": str(args.before)}, "off": {"PYTHONPATH": str(REPO)},
               "on": {"PYTHONPATH": str(REPO), **receiver.env("grpc", OTEL_TRACES_SAMPLER="always_on",
                                                              OTEL_BSP_SCHEDULE_DELAY="5000")}}
        started = {m: ServerProcess(args.bundle, "--device", "cpu", "--metrics-port", "0",
                                    repo=args.before if m == "before" else REPO, env=env[m], cpus=args.server_cpus)
                   for m in modes}
        try:
            servers = {m: _Measured(s) for m, s in started.items()}
            for server in servers.values():
                for pid in server.exporters if server_cpus is not None else ():
                    _pin(pid, other_cpus)  # started by the server, on its cores
            rates: dict[str, list[float]] = {m: [] for m in modes}
            cpu: dict[str, list[float]] = {m: [] for m in modes}  # server CPU ms per text
            turns: list[dict] = []
            for r in range(args.rounds):
                order = modes[r % len(modes):] + modes[:r % len(modes)]
                for mode in order:
                    server = servers[mode]
                    spans0, export0, all0 = receiver.received, cpu_seconds(server.exporters), cpu_seconds(server.pids)
                    row = bench_server(server, mode, texts, args.concurrency, args.seconds)
                    # the span export process' share of the server's CPU over the turn (its warm-up included)
                    share = (cpu_seconds(server.exporters) - export0) / max(cpu_seconds(server.pids) - all0, 1e-9)
                    rates[mode].append(row["texts_per_s"])
                    cpu[mode].append(1000 * row["server_cpu"] * (os.cpu_count() or 1) / row["texts_per_s"])
                    spans = (receiver.received - spans0) if mode == "on" else 0
                    export_ms = share * cpu[mode][-1]
                    turns.append({**row, "round": r, "mode": mode, "cpu_ms_text": cpu[mode][-1], "spans": spans,
                                  "export_cpu_ms_text": export_ms})
                    print(f"round {r + 1} {mode:6s} {row['texts_per_s']:8.1f} texts/s  p50 {row['p50_ms']:.1f} ms  "
                          f"p99 {row['p99_ms']:.1f} ms  errors {row['errors'] or 0}  server CPU "
                          f"{100 * row['server_cpu']:.0f}% ({cpu[mode][-1]:.2f} ms a text, {export_ms:.3f} ms of it "
                          f"in the span export process)  spans received {spans}",
                          flush=True)
            on = servers["on"]
            affinity = {"server": _cores_of([on.server.proc.pid]), "span export": _cores_of(on.exporters),
                        "load generator": _cores_of([os.getpid()])}
            print(f"cores: {affinity}", flush=True)
            # Every span "on" made, its queue flushed by the drain: fewer a call than the code makes = dropped spans.
            calls = sum(started["on"].codes().values())
            started["on"].stop()
            spans_per_call = receiver.received / calls
            print(f"spans received per call answered by on: {spans_per_call:.2f}", flush=True)
        finally:
            for s in started.values():
                s.close()
    def ratio(values: dict[str, list[float]], a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(values[a], values[b], strict=True))

    def interval(a: str, b: str) -> tuple[float, float, float]:
        """The mean of the rounds' texts/s ratios a / b and its 95% t-interval."""
        from scipy import stats

        r = [x / y for x, y in zip(rates[a], rates[b], strict=True)]
        half = stats.t.ppf(0.975, len(r) - 1) * statistics.stdev(r) / len(r) ** 0.5
        return statistics.mean(r), statistics.mean(r) - half, statistics.mean(r) + half

    print("\nmean texts/s: " + ", ".join(f"{m} {statistics.mean(rates[m]):.1f}" for m in modes))
    print("texts/s, " + ", ".join(f"{a} / {b}: {ratio(rates, a, b):.3f}" for a, b in pairs)
          + f" (medians over {args.rounds} rounds)")
    print("server CPU per text, " + ", ".join(f"{a} / {b}: {ratio(cpu, a, b):.3f}" for a, b in pairs))
    intervals = {f"{a}_{b}": interval(a, b) for a, b in pairs}
    for name, (mean, low, high) in intervals.items():
        print(f"texts/s {name.replace('_', ' / ')}: mean of the rounds {mean:.3f}, 95% interval {low:.3f} to "
              f"{high:.3f}")
    export_ms = statistics.median(t["export_cpu_ms_text"] for t in turns if t["mode"] == "on")
    print(f"the span export process: {export_ms:.3f} ms of CPU a text (median of the on turns)")
    hooks_us, traced_us = off_hooks_us(), on_hooks_us()
    per_call_us = 1000 * statistics.median(cpu["off"])
    print(f"tracing off: a call's telemetry hooks take {hooks_us:.2f} us here, {100 * hooks_us / per_call_us:.3f}% of "
          f"the off server's CPU per call ({per_call_us:.0f} us)")
    print(f"tracing on: a sampled call's hooks, its records and their JSON take {traced_us:.1f} us here, "
          f"{100 * traced_us / per_call_us:.2f}% of the off server's CPU per call")
    end_load = _load()
    print(f"load average at start: {start_load}, at end: {end_load}")
    if args.json:
        ratios = {f"{v}_{a}_{b}": ratio(values, a, b) for v, values in (("texts_s", rates), ("cpu_ms_text", cpu))
                  for a, b in pairs}
        out = {"turns": turns, "ratios": ratios, "intervals": intervals, "off_hooks_us": hooks_us,
               "on_hooks_us": traced_us,
               "export_cpu_ms_text": export_ms,
               "spans_per_call": spans_per_call, "concurrency": args.concurrency,
               "seconds": args.seconds, "rounds": args.rounds, "loadavg_start": start_load, "loadavg_end": end_load,
               "cpus": os.cpu_count(), "server_cpus": args.server_cpus, "affinity": affinity}
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def off_hooks_us(n: int = 20_000) -> float:
    """Microseconds one call spends in the telemetry hooks with tracing off, in this process: the call record and
    its request id, the steps a call passes (auth, admission, tokenize), the batcher's link, the end (no access line
    written: rate 0). What tracing off adds to a call is at most this."""
    from serving.telemetry import call_log, tracing

    assert tracing.active() is None
    log = call_log.CallLog(rate=0)
    return 1e6 * min(timeit.repeat(lambda: _one_call(log, None), number=n, repeat=5)) / n


def _one_call(log: Any, served: list | None) -> None:
    """One gRPC call through every telemetry hook: its record and request id, auth, admission, tokenize, the
    batcher's link (with the time it was queued, into `served`), the end."""
    from serving.telemetry import call_log

    call = log.begin("grpc", "sentiment.v1.SentimentService/Classify", _HEADERS, _ATTRIBUTES)
    start = time.time_ns() if call.traced else 0
    if start:
        call.timed("auth", start)
    with call:
        for step in ("admission", "tokenize"):
            if start:
                call.timed(step, time.time_ns())
        link = call_log.current().link()  # type: ignore[union-attr]
        if served is not None:
            served.append((link, time.time_ns()))
    call.finish("OK", failed=False)


def on_hooks_us(n: int = 20_000, batch: int = 7) -> float:
    """Microseconds one sampled call costs the server's process with tracing on, timed in this process: the hooks of
    off_hooks_us with every call sampled, its records made (its span, auth, admission, tokenize, its queue wait and
    its share of a batch's span, `batch` calls a run) and written as JSON for the pipe (SpanPipe's writer thread, a
    frame of 512 records). The records go to a list, not to the span export process, whose CPU the turns count."""
    from opentelemetry.propagate import get_global_textmap
    from opentelemetry.sdk.trace import sampling

    from serving.telemetry import call_log, export, tracing

    records: list[tuple] = []

    class _Kept:  # SpanPipe.put's side, into a list
        def put(self, record: tuple) -> None:
            records.append(record)

    log = call_log.CallLog(rate=0)
    batch_attributes = {"sentiment.graph": "model.int8.onnx", "sentiment.precision": "int8",  # as the batcher's
                        "sentiment.provider": "CPUExecutionProvider", "sentiment.per_row": False,
                        "sentiment.batch.texts": batch,
                        "sentiment.batch.calls": batch, "sentiment.batch.tokens": 900,
                        "sentiment.batch.padded_tokens": 1792}
    served: list = []

    def one() -> None:
        _one_call(log, served)
        if len(served) == batch:
            tracer.batch(served, time.time_ns(), time.time_ns(), batch_attributes, None)
            served.clear()
        if len(records) >= 512:
            export._encode(records)
            records.clear()

    tracer, was = tracing.Tracing(sampling.ALWAYS_ON, _Kept(), get_global_textmap()), tracing._tracing
    tracing._tracing = tracer  # the process' tracing, as configure() sets it
    try:
        return 1e6 * min(timeit.repeat(one, number=n, repeat=5)) / n
    finally:
        tracing._tracing = was


if __name__ == "__main__":
    sys.exit(main())
