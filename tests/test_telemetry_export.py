"""The span export process (serving/telemetry/export.py) that a traced server's spans leave by: its bounded queue,
its start-up errors, and what happens when it or the server dies. The spans' content is checked end to end in
tests/test_telemetry_traces.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from otlp_receiver import OtlpReceiver
from procs import REPO
from serving_fixtures import ServerProcess

from serving.client import SentimentClient
from serving.errors import ServerConfigError
from serving.telemetry import export

TEXT = "Un roman lumineux, des personnages attachants."
SETUP = {"resource": {"service.name": "test"}, "schema_url": "", "scope": ("serving", "test"), "exporters": ["otlp"]}


def _record(i: int) -> tuple:
    """A root span's record, as Tracing.record makes them (serving/telemetry/tracing.py)."""
    return (f"span {i}", 0x1234 + i, 0x99 + i, 1, None, 0, False, 0, 1_000, 2_000, {"i": i}, (), None, ())


def _gone(process: psutil.Process, timeout: float = 20.0) -> None:
    """Waits until `process` exited (a zombie its parent has not reaped yet counts); fails after `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    pytest.fail(f"process {process.pid} still runs after {timeout} s")


def _export_child(server: ServerProcess) -> psutil.Process:
    for child in psutil.Process(server.proc.pid).children():
        if "serving.telemetry.export" in " ".join(child.cmdline()):
            return child
    raise AssertionError("the server has no span export process")


@pytest.fixture
def otlp_env(monkeypatch: pytest.MonkeyPatch):
    with OtlpReceiver() as receiver:
        for key in [k for k in os.environ if k.startswith("OTEL_")]:
            monkeypatch.delenv(key)
        for key, value in receiver.env("grpc").items():
            monkeypatch.setenv(key, value)
        yield receiver


def test_spans_past_the_queue_are_dropped_counted_and_the_rest_exported(otlp_env: OtlpReceiver,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A server never waits for its spans: past `max_queue` waiting, they are dropped and a warning counts them;
    the ones kept arrive whole."""
    monkeypatch.setattr(export, "FLUSH_S", 60.0)  # the writer sleeps: the five puts below all find the queue
    pipe = export.SpanPipe(SETUP, max_queue=3, batch=100)
    for i in range(5):
        pipe.put(_record(i))
    with caplog.at_level(logging.WARNING, logger=export.__name__):
        assert pipe.close(30) is True
    assert "2 spans dropped: more than 3 waited to be exported (OTEL_BSP_MAX_QUEUE_SIZE)" in caplog.text
    spans = otlp_env.wait_for(lambda s: s if len(s) >= 3 else None)
    assert sorted((s.name, s.attributes["i"], s.trace_id) for s in spans) == \
        [(f"span {i}", i, format(0x1234 + i, "032x")) for i in range(3)]


def test_a_bad_exporter_variable_stops_the_start_with_its_name(otlp_env: OtlpReceiver,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """What only the exporter itself checks (here a timeout that is no number) is said by the export process
    before the server serves, in one ServerConfigError (the server then exits 2)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")
    with pytest.raises(ServerConfigError, match=r"OTEL_EXPORTER_OTLP_\* variables: could not convert .*'soon'"):
        export.SpanPipe(SETUP, max_queue=10, batch=10)


def test_a_server_whose_export_process_died_serves_on_and_says_so_once(tiny_bundle: Path) -> None:
    """The export process (at the lowest CPU priority) killed: calls are still answered, one warning says spans are
    dropped from then on, and the server stops cleanly."""
    with OtlpReceiver() as receiver:
        server = ServerProcess(tiny_bundle, "--device", "cpu", env=receiver.env("grpc"))
        try:
            with SentimentClient(f"127.0.0.1:{server.wait_listening()}", timeout=30) as client:
                assert client.classify([TEXT])[0].label
                receiver.wait_for(lambda s: s, what="the first call's spans")
                child = _export_child(server)
                assert child.nice() == 19  # the lowest priority: a loaded machine's CPU goes to the calls first
                assert child.memory_full_info().uss < 64 * 2**20  # docs/OBSERVABILITY.md: under 64 MB of its own
                child.kill()
                _gone(child)
                for _ in range(20):
                    assert client.classify([TEXT])[0].label
                    time.sleep(0.02)
            assert server.stop() == 0
            warnings = [line for line in server.lines if "span export process exited" in line]
            assert len(warnings) == 1 and "spans are dropped from now on" in warnings[0], server.log
        finally:
            server.close()


def test_the_export_process_does_not_outlive_a_killed_server(tiny_bundle: Path) -> None:
    """SIGKILL to the server closes its end of the pipe: the export process exits on its own."""
    with OtlpReceiver() as receiver:
        server = ServerProcess(tiny_bundle, "--device", "cpu", env=receiver.env("grpc"))
        try:
            server.wait_listening()
            child = _export_child(server)
            server.proc.send_signal(signal.SIGKILL)
            server.wait_exit()
            _gone(child)
        finally:
            server.close()


def test_the_export_process_ignores_the_groups_interrupt(otlp_env: OtlpReceiver) -> None:
    """A Ctrl-C reaches every process of the terminal's group: the export process lets the server decide, and
    exports what the server sends until the server closes the pipe."""
    code = ("import signal, sys, time\n"
            "from serving.telemetry import export\n"
            f"pipe = export.SpanPipe({SETUP!r}, max_queue=10, batch=10)\n"
            "pipe.child.send_signal(signal.SIGINT)\n"
            "time.sleep(0.5)\n"
            f"pipe.put({_record(7)!r})\n"
            "sys.exit(0 if pipe.close(30) else 1)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [s.name for s in otlp_env.wait_for(lambda s: s)] == ["span 7"]


def test_an_export_process_that_hangs_holds_the_stop_a_bounded_while(otlp_env: OtlpReceiver) -> None:
    """An export process that stopped reading (SIGSTOP here) with spans to take: `close` gives up after its bound
    and kills it, rather than holding a draining server."""
    pipe = export.SpanPipe(SETUP, max_queue=100_000, batch=100_000)
    pipe.child.send_signal(signal.SIGSTOP)
    try:
        for i in range(50_000):  # a few MB of records: more than the pipe's buffer holds
            pipe.put(_record(i))
        started = time.monotonic()
        assert pipe.close(1.0) is False
        assert time.monotonic() - started < 10
        assert pipe.child.poll() is not None
    finally:
        if pipe.child.poll() is None:
            pipe.child.kill()


def test_a_span_that_cannot_be_sent_drops_its_batch_only(otlp_env: OtlpReceiver, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """An attribute value JSON cannot hold: that batch is dropped with a warning naming why, and the writer goes on
    with the next one."""
    monkeypatch.setattr(export, "FLUSH_S", 0.05)
    pipe = export.SpanPipe(SETUP, max_queue=100, batch=100)
    with caplog.at_level(logging.WARNING, logger=export.__name__):
        bad = list(_record(1))
        bad[10] = {"callback": lambda: None}
        pipe.put(tuple(bad))
        end = time.monotonic() + 30  # the writer's turn, that batch alone: until it has said so
        while "spans dropped" not in caplog.text and time.monotonic() < end:
            time.sleep(0.01)
        pipe.put(_record(2))
        assert pipe.close(30) is True
    assert "1 spans dropped: Object of type function is not JSON serializable" in caplog.text, caplog.text
    assert [s.name for s in otlp_env.wait_for(lambda s: s)] == ["span 2"]


@pytest.mark.slow  # 30 s: bench/telemetry_bench.py end to end at its smallest, so that the cost figure's tool runs
@pytest.mark.parametrize(("before", "pinned"), [(True, False), (False, False), (False, True)],
                         ids=["before-off-on", "off-on", "off-on-pinned"])
def test_the_tracing_benchmark_runs_end_to_end(tiny_bundle: Path, tmp_path: Path, before: bool,
                                               pinned: bool) -> None:
    """Three servers (two without --before), a receiver in its own process, a turn each: the traced server's spans
    arrive, the CPU counted includes its export process, and the off path's hooks were timed. Not that every span
    arrives: while the callers keep the cores busy the export process (nice 19) falls behind, and the bounded queues
    drop spans by design, more the busier the machine (CI once counted 2.7 a call here); the benchmark reports it."""
    if pinned and (0 not in os.sched_getaffinity(0) or len(os.sched_getaffinity(0)) < 2):
        pytest.skip("pinning needs core 0 and one more")
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "bench/telemetry_bench.py", "--bundle", str(tiny_bundle),
                           *(["--before", str(REPO)] if before else []), "--rounds", "2", "--seconds", "1",
                           "--concurrency", "4", "--json", str(out), *(["--server-cpus", "0"] if pinned else [])],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    # at most a call's span, admission, tokenize, queue wait and its share of the batch's
    assert 0 < report["spans_per_call"] <= 5, report["spans_per_call"]
    pairs = {"off_before", "on_off"} if before else {"on_off"}
    assert 0 < report["off_hooks_us"] < report["on_hooks_us"] < 5000 and set(report["intervals"]) == pairs
    assert report["export_cpu_ms_text"] > 0  # the export process is found and counted
    assert {t["mode"] for t in report["turns"]} == ({"before", "off", "on"} if before else {"off", "on"})
    assert [t["mode"] for t in report["turns"]][:2] != [t["mode"] for t in report["turns"]][2:4]  # order rotates
    cores = sorted(os.sched_getaffinity(0))
    if pinned:  # the servers on core 0; the export process, and the callers, on the others
        others = [c for c in cores if c != 0]
        assert report["affinity"] == {"server": [0], "span export": others, "load generator": others}, report
    else:
        assert report["affinity"] == {"server": cores, "span export": cores, "load generator": cores}, report
