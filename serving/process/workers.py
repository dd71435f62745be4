"""Several server processes on one port: `python -m serving.server BUNDLE --workers N`.

One Python process runs every request's gRPC handling, protobuf and tokenization under one interpreter lock, so
past a point it, not onnxruntime, sets the server's ceiling. With `--workers N` a parent process starts N workers,
each a full `SentimentServer` (its own predictor, batcher, handler threads and limits) on the same gRPC port (and HTTP
port): gRPC's multiprocessing pattern (grpc/examples/python/multiprocessing). The parent binds each port with
SO_REUSEPORT and keeps it bound while the workers bind it too; the kernel then hands each new connection to one of the
listening workers. A connection stays with its worker: a client needs several connections (channels) to use
several workers (one channel reaches one worker).

Workers are started with multiprocessing's `spawn` (a fresh interpreter, no fork of a process that holds gRPC
threads: gRPC does not survive a fork after use). Each sends the parent "ready" over a pipe once it serves.

The parent alone serves, for all workers:
  - health on `--health-port`: NOT_SERVING until every worker is ready, SERVING while at least one is (a
    worker being restarted leaves the others serving: the port still answers), NOT_SERVING from SIGTERM on;
  - Prometheus metrics on `--metrics-port`: prometheus_client's multiprocess mode, the workers' files in a
    private temporary folder (removed on exit), counters and histograms summed over the workers (the counts of
    a worker that died stay in the sums), gauges summed over the live ones; per worker, `sentiment_worker_*`
    (ready, restarts, CPU seconds and resident memory from /proc, texts by pid).
Lifecycle: the bundle and the TLS files are verified and every port of the parent bound (a bad bundle or file, or a
taken port, exits 2 with one line) before any worker starts. SIGTERM or SIGINT: health NOT_SERVING, every worker
gets SIGTERM and drains as one server does (drain_delay_s, grace_s), the parent exits 0 once all have exited 0. A
worker that dies otherwise is logged and restarted, after a back-off that doubles while it keeps dying young (0.5 s
up to 30 s); one that exits 2 (its configuration cannot work) stops the server with exit 2. A worker whose parent
is gone drains and exits.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path

from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry, ProcessCollector, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from contract.bundle import bundle_manifest
from serving.config import ServerConfig
from serving.errors import BundleError, ServerConfigError
from serving.process.stop_signal import StopSignal
from serving.protocols.grpc.health import Health
from serving.protocols.grpc.health_port import HealthPort
from serving.telemetry import logs, tracing
from serving.telemetry.prometheus import Metrics, MetricsServer

log = logging.getLogger("serving.process.workers")

BACKOFF_FIRST_S = 0.5  # wait before restarting a worker that died young; doubles at each further young death
BACKOFF_MAX_S = 30.0
YOUNG_S = 60.0  # a worker that served this long before dying is restarted at once (its back-off is reset)
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class _Slot:
    """Worker `index`: its current process and its history."""

    index: int
    process: BaseProcess | None = None
    conn: Connection | None = None  # the parent's end of the worker's pipe
    ready: bool = False
    started: float = 0.0  # time.monotonic() of the current process' start
    restarts: int = 0
    young_deaths: int = 0  # deaths in a row of processes that lived less than YOUNG_S
    restart_at: float | None = None  # time.monotonic() of the next start, while waiting out a back-off
    pids: list[int] = field(default_factory=list)


def serve(bundle: str | Path | None, cfg: ServerConfig, log_level: str = "INFO", log_format: str = "text") -> int:
    """Run `cfg.workers` server processes until SIGTERM or SIGINT; the exit code. bundle: None with
    cfg.model_repository, which each worker loads and (model_control=poll) follows on its own."""
    from serving.process.app import (
        KSERVE_SERVICE,
        SENTIMENT_SERVICE,
        check_distinct_ports,
        server_credentials,
        transport_options,
        warn_if_open,
    )
    from serving.process.app import metrics_server as bind_metrics

    if (bundle is None) == (cfg.model_repository is None):
        raise ServerConfigError("give one bundle or a model repository (--model-repository DIR), not "
                                f"{'both' if bundle is not None else 'neither'}")
    if bundle is not None:
        cfg.check_bundle_fit(bundle_manifest(bundle).max_len)  # each worker verifies the whole bundle as it loads
    tracing.check()  # each worker exports its own spans (serving/telemetry/tracing.py); a bad variable: one line now
    check_distinct_ports(cfg)
    server_credentials(cfg)  # unreadable or mismatched TLS files: one line now, before any worker starts
    warn_if_open(cfg)
    metrics_host = cfg.metrics_host or cfg.host
    with _reserved_port(cfg.host, cfg.port, "gRPC") as port, _reserved_port(cfg.host, cfg.http_port, "HTTP") as \
            http_port, _multiprocess_folder() as folder:
        log.info("multiprocess metrics in %s (removed on exit)", folder)
        metrics = Metrics()  # the parent's own counts (health port calls), into the same folder
        health = Health()
        health.listen(lambda: metrics.serving.set(health.serving()))
        for service in ("", SENTIMENT_SERVICE, KSERVE_SERVICE):
            health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        parent = _Parent(bundle, cfg.replace(port=port, http_port=http_port, health_port=None, metrics_port=None),
                         log_level, log_format)
        health_server: HealthPort | None = None
        metrics_server: MetricsServer | None = None
        try:
            if cfg.health_port is not None:
                health_server = HealthPort(health, metrics, cfg.host, cfg.health_port, transport_options(cfg),
                                           cfg.body_timeout_s)
            if cfg.metrics_port is not None:
                registry = CollectorRegistry()
                MultiProcessCollector(registry, folder)
                ProcessCollector(registry=registry)  # the parent's own process_*
                registry.register(_WorkersCollector(parent.slots))
                metrics_server = bind_metrics(registry, metrics_host, cfg.metrics_port)
            for listener in (health_server, metrics_server):
                if listener is not None:
                    listener.start()
            where = (f"{'HTTP off' if http_port is None else f'HTTP on {cfg.host}:{http_port}'}, "
                     f"health port {'off' if health_server is None else f':{health_server.port}'}, metrics "
                     f"{'off' if metrics_server is None else f'on {metrics_host}:{metrics_server.port}'}")
            return parent.run(health, (SENTIMENT_SERVICE, KSERVE_SERVICE), where)
        finally:
            if health_server is not None:
                health_server.stop()
            if metrics_server is not None:
                metrics_server.stop()


class _Parent:
    """Starts, watches, restarts and stops the workers."""

    def __init__(self, bundle: str | Path | None, worker_cfg: ServerConfig, log_level: str,
                 log_format: str = "text") -> None:
        self.bundle = None if bundle is None else str(bundle)
        self.cfg, self.log_level, self.log_format = worker_cfg, log_level, log_format
        self.slots = [_Slot(i) for i in range(worker_cfg.workers)]
        self._context = multiprocessing.get_context("spawn")
        self._stop = StopSignal()
        self._serving = False
        self._announced = False

    def run(self, health: Health, services: tuple[str, ...], where: str) -> int:
        # The handlers stay through the drain: a second SIGTERM must not kill the parent under its workers.
        with self._stop:
            for slot in self.slots:
                self._start(slot)
            code = self._watch(health, services, where)
            return self._drain(health) if code is None else self._kill_all(code)

    def _start(self, slot: _Slot) -> None:
        parent_end, child_end = self._context.Pipe(duplex=False)
        process = self._context.Process(target=_worker_main, name=f"sentiment-worker-{slot.index}",
                                        args=(slot.index, self.bundle, self.cfg, child_end, self.log_level,
                                              self.log_format, os.getpid()))
        process.start()
        child_end.close()
        slot.process, slot.conn, slot.ready, slot.restart_at = process, parent_end, False, None
        slot.started = time.monotonic()
        slot.pids.append(process.pid or 0)
        log.info("worker %d started (pid %d)", slot.index, process.pid)

    def _watch(self, health: Health, services: tuple[str, ...], where: str) -> int | None:
        """Until SIGTERM (None) or a worker's exit 2 (2)."""
        while not self._stop.signum:
            now = time.monotonic()
            waits = [s.restart_at - now for s in self.slots if s.restart_at is not None]
            timeout = max(0.0, min([0.5, *waits]))  # a timed wait lets the signal handler run promptly
            live = [s for s in self.slots if s.process is not None]
            ends: dict[object, _Slot] = {s.process.sentinel: s for s in live}  # type: ignore[union-attr]
            ends |= {s.conn: s for s in live if s.conn is not None and not s.ready}
            for end in wait(list(ends), timeout):
                slot = ends[end]
                if end is slot.conn and slot.conn is not None:
                    try:
                        slot.conn.recv()  # "ready"
                        slot.ready = True
                        log.info("worker %d ready (pid %d)", slot.index, slot.process.pid)
                        continue
                    except EOFError:
                        pass  # the worker died before it served: its sentinel says how
                if slot.process is not None and not slot.process.is_alive():
                    if self._died(slot) == 2:
                        return 2
            for slot in self.slots:
                if slot.restart_at is not None and time.monotonic() >= slot.restart_at:
                    self._start(slot)
            self._report(health, services, where)
        return None

    def _died(self, slot: _Slot) -> int:
        """Log a worker's death and schedule its restart; its exit code."""
        assert slot.process is not None
        slot.process.join()
        code, pid = slot.process.exitcode or 0, slot.process.pid
        if slot.conn is not None:
            slot.conn.close()
        slot.process, slot.conn, slot.ready = None, None, False
        mark_process_dead(pid)  # its live gauges leave the sums; its counts stay
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        if code == 2:
            log.error("worker %d (pid %d) %s: its configuration cannot serve; stopping", slot.index, pid, how)
            return code
        lived = time.monotonic() - slot.started
        slot.young_deaths = slot.young_deaths + 1 if lived < YOUNG_S else 0
        delay = 0.0 if slot.young_deaths == 0 else min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (slot.young_deaths - 1))
        slot.restarts += 1
        slot.restart_at = time.monotonic() + delay
        log.warning("worker %d (pid %d) %s after %.1f s; restarting it in %.1f s (restart %d)", slot.index, pid,
                    how, lived, delay, slot.restarts)
        return code

    def _report(self, health: Health, services: tuple[str, ...], where: str) -> None:
        """Health from the workers' readiness: SERVING once all were ready, until none is."""
        ready = sum(s.ready for s in self.slots)
        serving = ready == len(self.slots) or (self._serving and ready > 0)
        if serving == self._serving:
            return
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", *services):
            health.set(service, status)
        self._serving = serving
        # After the health status, as from one process (serving/process/app.py): a script that waits for the line
        # and then asks health must read SERVING.
        if serving and not self._announced:  # the line scripts wait for
            self._announced = True
            c = self.cfg
            log.info("listening on %s:%d (%d workers, pids %s; %s%s), %s", c.host, c.port, len(self.slots),
                     " ".join(str(s.process.pid) for s in self.slots if s.process is not None),
                     "mutual TLS" if c.tls_client_ca else "TLS" if c.tls_cert else "plaintext",
                     ", token auth" if c.auth_token else "", where)
        elif not serving:
            log.warning("no worker is ready: NOT_SERVING until one is")

    def _drain(self, health: Health) -> int:
        """SIGTERM every worker and wait for all: 0 when each exited 0."""
        health.enter_graceful_shutdown()
        log.info("signal received: NOT_SERVING, every worker drains (drain_delay_s %.1f, grace %.1f s)",
                 self.cfg.drain_delay_s, self.cfg.grace_s)
        live = [s for s in self.slots if s.process is not None]
        for slot in live:
            _signal(slot.process, signal.SIGTERM)
        # A worker's stop() waits up to drain_delay_s, then grace_s for its calls and as long for its batcher.
        end = time.monotonic() + self.cfg.drain_delay_s + 2 * self.cfg.grace_s + 10
        failed = 0
        for slot in live:
            assert slot.process is not None
            slot.process.join(max(0.0, end - time.monotonic()))
            if slot.process.exitcode is None:
                log.error("worker %d (pid %d) still running after the grace period: killed (its threads' stacks "
                          "follow on stderr)", slot.index, slot.process.pid)
                _signal(slot.process, signal.SIGUSR1)  # faulthandler in the worker: where it is stuck
                slot.process.join(1.0)
                _signal(slot.process, signal.SIGKILL)
                slot.process.join()
            if slot.process.exitcode not in (0, -signal.SIGTERM):  # SIGTERM before its handler: nothing to drain
                failed += 1
                log.error("worker %d (pid %d) exited with %s while draining", slot.index, slot.process.pid,
                          slot.process.exitcode)
        log.info("stopped (%d workers)", len(live))
        return 0 if not failed else 1

    def _kill_all(self, code: int) -> int:
        for slot in self.slots:
            if slot.process is not None:
                _signal(slot.process, signal.SIGKILL)
                slot.process.join()
        return code


def _signal(process: BaseProcess | None, sig: int) -> None:
    if process is not None and process.pid is not None:
        try:
            os.kill(process.pid, sig)
        except ProcessLookupError:
            pass


class _WorkersCollector:
    """Per worker, read when scraped: ready, restarts, and its current process' CPU time and resident memory."""

    def __init__(self, slots: list[_Slot]) -> None:
        self.slots = slots

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        ready = GaugeMetricFamily("sentiment_worker_ready", "1 while the worker serves", labels=["worker"])
        restarts = CounterMetricFamily("sentiment_worker_restarts", "times the worker was restarted after it died",
                                       labels=["worker"])
        cpu = CounterMetricFamily("sentiment_worker_cpu_seconds", "user + system CPU time of the worker's current "
                                  "process (from 0 again after a restart)", labels=["worker"])
        memory = GaugeMetricFamily("sentiment_worker_resident_memory_bytes", "resident memory of the worker's "
                                   "current process", labels=["worker"])
        for slot in list(self.slots):
            name = str(slot.index)
            ready.add_metric([name], float(slot.ready))
            restarts.add_metric([name], slot.restarts)
            process = slot.process
            usage = proc_usage(process.pid) if process is not None and process.pid else None
            if usage is not None:
                cpu.add_metric([name], usage[0])
                memory.add_metric([name], usage[1])
        yield from (ready, restarts, cpu, memory)


def proc_usage(pid: int) -> tuple[float, int] | None:
    """(user + system CPU seconds, resident bytes) of a live process, from /proc/PID/stat; None once gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) is fields[0]
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS, int(fields[21]) * _PAGE


@contextmanager
def _reserved_port(host: str, port: int | None, what: str) -> Iterator[int | None]:
    """A port (gRPC's, HTTP's) bound (not listening) with SO_REUSEPORT while the workers bind it too: port 0 picks one
    for all of them, and a process of another user cannot take it in between. A taken port: ServerConfigError.
    None (off): None."""
    if port is None:
        yield None
        return
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as sock:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
        except OSError as e:
            raise ServerConfigError(f"cannot listen on {host}:{port} ({what}): {e.strerror or e}") from None
        yield int(sock.getsockname()[1])


@contextmanager
def _multiprocess_folder() -> Iterator[str]:
    """A private folder for prometheus_client's multiprocess files, named in PROMETHEUS_MULTIPROC_DIR for the
    workers (a fresh interpreter reads it when it imports prometheus_client); removed on exit."""
    folder = tempfile.mkdtemp(prefix="sentiment-metrics-")  # mode 0700
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    # This process imported prometheus_client before the variable was set: the metrics it creates from now on
    # write to the folder too (what values.get_value_class() picks when the variable is set at import).
    values.ValueClass = values.MultiProcessValue()
    try:
        yield folder
    finally:
        values.ValueClass = values.MutexValue
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        shutil.rmtree(folder, ignore_errors=True)



# ---------------------------------------------------------------------------------------------------- worker


def _worker_main(index: int, bundle: str | None, cfg: ServerConfig, conn: Connection, log_level: str, log_format: str,
                 parent_pid: int) -> None:
    """One worker: a SentimentServer on the shared port until SIGTERM (or its parent is gone)."""
    from serving.process.app import SentimentServer, configure_process

    logs.configure(log_level, log_format, worker=index)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a worker stuck past its grace: its parent asks
    with StopSignal() as stop:
        try:
            configure_process(cfg, worker=index)
            server = SentimentServer(bundle, cfg, shared_port=True).bind()
        except (BundleError, ServerConfigError) as e:
            print(f"sentiment-server: error: worker {index}: {e}", file=sys.stderr)
            sys.exit(2)
        server.start()
        conn.send("ready")
        while not stop.wait(0.5):
            if os.getppid() != parent_pid:
                log.error("the parent process is gone: draining")
                break
        server.stop()
    tracing.shutdown()
    sys.exit(0)
