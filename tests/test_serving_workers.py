"""`python -m serving.server BUNDLE --workers 2` (serving/process/workers.py): real processes on 127.0.0.1.

The answers equal the in-process predictor's and both workers take calls; health says NOT_SERVING until every
worker is ready; a worker killed with SIGKILL is restarted while the other keeps answering; SIGTERM drains every
worker and the parent exits 0; the parent's metrics sum the workers'; TLS and token auth hold in every worker;
a taken port or a bad bundle exits 2 with one line.

Each client connection stays with the worker the kernel gave it (SO_REUSEPORT), so the tests open many channels,
each with its own connection (a local subchannel pool): 16 connections all on one of 2 workers has odds of 2^-15.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import shutil
import signal
import socket
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from procs import free_port
from serving_fixtures import (  # noqa: F401 (certs: a fixture)
    ServerProcess,
    certs,
    reviews,
    sigterm_under_load,
    wait_until,
    waited_out_the_server,
)

from serving.config import ServerConfig
from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.model.predictor import Predictor
from serving.process.workers import _Parent
from serving.protocols.grpc.health import Health

CHANNELS = 16
STARTED = re.compile(r"worker (\d+) started \(pid (\d+)\)")
READY = re.compile(r"worker (\d+) ready \(pid (\d+)\)")
CLASSIFY = "sentiment.v1.SentimentService/Classify"


def channel(port: int, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A channel with a connection of its own (channels otherwise share one per target)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    if credentials is not None:
        return grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options)
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=options)


def pids(server: ServerProcess, pattern: re.Pattern[str] = READY) -> dict[int, int]:
    """Worker index -> pid of its latest process matching `pattern` in the log."""
    return {int(m.group(1)): int(m.group(2)) for m in pattern.finditer(server.log)}


def worker_texts(server: ServerProcess) -> dict[int, float]:
    """Texts classified by each live worker pid (sentiment_worker_texts{pid=...})."""
    return {pid: server.metric("sentiment_worker_texts", {"pid": str(pid)}) or 0.0
            for pid in pids(server).values()}


def health_status(port: int, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                    timeout=10).status


def test_two_workers_answer_like_the_predictor_share_the_calls_and_sum_their_metrics(
        tiny_bundle: Path, data_dir: Path) -> None:
    texts = reviews(data_dir, 5)
    expected = np.stack([p.probabilities for p in Predictor(tiny_bundle, device="cpu").predict(texts)])
    server = ServerProcess(tiny_bundle, "--device", "cpu", "--workers", "2", "--metrics-port", "0")
    try:
        port = server.wait_listening()
        folder = re.search(r"multiprocess metrics in (\S+)", server.log).group(1)
        assert os.path.isdir(folder)
        assert "2 workers" in server.log and len(pids(server)) == 2, server.log
        for _ in range(2 * CHANNELS):
            with channel(port) as ch:
                r = pb_grpc.SentimentServiceStub(ch).Classify(pb.ClassifyRequest(texts=texts), timeout=30)
            np.testing.assert_allclose([x.probabilities for x in r.results], expected, atol=1e-5)
        calls = 2 * CHANNELS
        per_worker = worker_texts(server)
        assert all(n > 0 for n in per_worker.values()), per_worker  # both workers took calls
        assert sum(per_worker.values()) == calls * len(texts)
        # The parent's page: the workers' counts summed, per-worker rows, its own process.
        assert server.metric("sentiment_texts_total") == calls * len(texts)
        assert server.metric("sentiment_requests_total",
                             {"protocol": "grpc", "method": CLASSIFY, "code": "OK"}) == calls
        assert server.metric("sentiment_batch_size_sum") == calls * len(texts)
        for w in ("0", "1"):
            assert server.metric("sentiment_worker_ready", {"worker": w}) == 1
            assert server.metric("sentiment_worker_cpu_seconds_total", {"worker": w}) > 0
        assert server.metric("process_resident_memory_bytes") > 0
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(60) == 0, server.log
    finally:
        server.close()
    assert not os.path.exists(folder)  # the metrics files are removed


def test_the_parent_says_listening_only_once_its_health_says_serving(tiny_bundle: Path) -> None:
    """The parent's "listening on" line is what scripts wait for: when it is logged, health must already read
    SERVING. It was logged first, and a test that asked health right after the line read NOT_SERVING (once, in a
    full `make test`). Here the parent's readiness report runs in-process, its workers marked ready by hand."""
    parent = _Parent(tiny_bundle, ServerConfig(workers=2), "INFO")
    health = Health()
    health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    seen: list[int] = []

    class AtTheLine(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("listening on"):
                seen.append(health.statuses()[""])

    handler, logger = AtTheLine(), logging.getLogger("serving.process.workers")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for slot in parent.slots:
            slot.ready = True
        parent._report(health, (), "health port off")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen == [health_pb2.HealthCheckResponse.SERVING]


def test_health_is_not_serving_until_every_worker_is_ready(tiny_bundle: Path) -> None:
    """Worker 1 is stopped (SIGSTOP) as soon as it is started, long before it can load the bundle: with worker 0
    ready, the parent's health port says NOT_SERVING until worker 1 is let go and ready too."""
    health_port = free_port()
    server = ServerProcess(tiny_bundle, "--device", "cpu", "--workers", "2", "--health-port", str(health_port))
    try:
        wait_until(lambda: 1 in pids(server, STARTED), 60, what="worker 1 started")
        second = pids(server, STARTED)[1]
        os.kill(second, signal.SIGSTOP)
        try:
            wait_until(lambda: 0 in pids(server), 60, what="worker 0 ready")
            assert 1 not in pids(server), "worker 1 was ready before it could be stopped"
            for service in ("", "sentiment.v1.SentimentService"):
                assert health_status(health_port, service) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert "listening on" not in server.log
        finally:
            os.kill(second, signal.SIGCONT)
        server.wait_listening(60)
        assert health_status(health_port) == health_pb2.HealthCheckResponse.SERVING
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(60) == 0, server.log
    finally:
        server.close()


def test_a_killed_worker_is_restarted_while_the_other_answers(tiny_bundle: Path, data_dir: Path) -> None:
    texts = reviews(data_dir, 3)
    health_port = free_port()
    server = ServerProcess(tiny_bundle, "--device", "cpu", "--workers", "2", "--metrics-port", "0",
                           "--health-port", str(health_port))
    try:
        port = server.wait_listening()
        victim = pids(server)[0]
        os.kill(victim, signal.SIGKILL)
        answered_while_down = 0
        while pids(server).get(0) == victim:  # until the new worker 0 is ready
            with channel(port) as ch:
                r = pb_grpc.SentimentServiceStub(ch).Classify(pb.ClassifyRequest(texts=texts), timeout=30,
                                                             wait_for_ready=True)
            assert len(r.results) == len(texts)
            answered_while_down += 1
            assert health_status(health_port) == health_pb2.HealthCheckResponse.SERVING  # the other one serves
        assert answered_while_down > 0
        assert f"worker 0 (pid {victim}) was killed by signal 9" in server.log and "restarting" in server.log
        assert server.metric("sentiment_worker_restarts_total", {"worker": "0"}) == 1
        assert server.metric("sentiment_worker_restarts_total", {"worker": "1"}) == 0
        wait_until(lambda: server.metric("sentiment_worker_ready", {"worker": "0"}) == 1, 30, what="ready metric")
        for _ in range(CHANNELS):  # the new worker takes calls too
            with channel(port) as ch:
                pb_grpc.SentimentServiceStub(ch).Classify(pb.ClassifyRequest(texts=texts), timeout=30)
        assert all(n > 0 for n in worker_texts(server).values()), worker_texts(server)
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(60) == 0, server.log
    finally:
        server.close()


def test_sigterm_drains_every_worker_under_load_and_exits_0(tiny_bundle: Path, data_dir: Path) -> None:
    texts = reviews(data_dir, 16)
    server, outcomes, sigterm_at, rc = sigterm_under_load(tiny_bundle, ["--workers", "2", "--grace-s", "20"], texts,
                                                          answers=24, own_connections=True)
    assert rc == 0, server.log
    assert server.log.count("]: stopped") == 2, server.log  # each worker's
    assert "stopped (2 workers)" in server.log
    failed = [(round(o[0] - sigterm_at, 3), round(o[1] - sigterm_at, 3), *o[2:]) for o in outcomes if o[2] != "OK"]
    gone = server.gone_at and round(server.gone_at - sigterm_at, 3)
    why = f"failed calls (start, end: s after SIGTERM): {failed}; server gone at {gone}; log: {server.log[-3000:]}"
    before = {o[2] for o in outcomes if o[0] < sigterm_at}
    assert before <= {"OK", "UNAVAILABLE"}, why
    client_waits = {id(o) for o in waited_out_the_server(outcomes, sigterm_at, server)}  # gRPC's, rarely
    assert {o[2] for o in outcomes if id(o) not in client_waits} <= {"OK", "UNAVAILABLE", "CANCELLED"}, why
    assert [o for o in outcomes if o[0] < sigterm_at < o[1] and o[2] == "OK"], f"no request in flight at SIGTERM; {why}"


def test_tls_and_token_auth_hold_in_every_worker(tiny_bundle: Path, tmp_path: Path,
                                                certs: dict[str, Path]) -> None:  # noqa: F811
    token = "a-long-enough-secret-token"
    (tmp_path / "token").write_text(token + "\n")
    server = ServerProcess(tiny_bundle, "--device", "cpu", "--workers", "2", "--metrics-port", "0",
                           "--auth-token-file", str(tmp_path / "token"), "--tls-cert", str(certs["server"]),
                           "--tls-key", str(certs["server_key"]))
    try:
        port = server.wait_listening()
        assert "TLS, token auth" in server.log
        credentials = grpc.ssl_channel_credentials(certs["ca"].read_bytes())
        for _ in range(CHANNELS):
            with channel(port, credentials) as ch:
                stub = pb_grpc.SentimentServiceStub(ch)
                with pytest.raises(grpc.RpcError) as info:
                    stub.Classify(pb.ClassifyRequest(texts=["x"]), timeout=30)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                stub.Classify(pb.ClassifyRequest(texts=["x"]), timeout=30,
                              metadata=[("authorization", f"Bearer {token}")])
        assert all(n > 0 for n in worker_texts(server).values()), worker_texts(server)  # both took calls
        assert server.metric("sentiment_requests_total", {"protocol": "grpc", "method": CLASSIFY,
                                                          "code": "UNAUTHENTICATED"}) == CHANNELS
        with channel(port) as ch, pytest.raises(grpc.RpcError):  # plain text on a TLS port
            pb_grpc.SentimentServiceStub(ch).Classify(pb.ClassifyRequest(texts=["x"]), timeout=10)
    finally:
        server.close()


def test_a_taken_port_exits_2_with_one_line(tiny_bundle: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ServerProcess(tiny_bundle, "--device", "cpu", "--workers", "2", "--port", str(port))
        rc = server.wait_exit(60)
    assert rc == 2, server.log
    lines = server.log.strip().split("\n")
    assert lines == [f"sentiment-server: error: cannot listen on 127.0.0.1:{port} (gRPC): Address already in use"], \
        server.log


def test_a_bad_bundle_exits_2_with_one_line(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "nope", "--workers", "2")
    rc = server.wait_exit(60)
    assert rc == 2 and len(server.log.strip().split("\n")) == 1 and "bundle folder not found" in server.log, \
        server.log


def test_a_corrupt_bundle_exits_2_naming_its_file(tiny_bundle: Path, tmp_path: Path) -> None:
    """The parent reads only the manifest (to size the server); each worker verifies the bundle as it loads it, and
    the first one to refuse it stops the server with the file named."""
    bundle = Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))
    graph = bytearray((bundle / "model.onnx").read_bytes())
    graph[len(graph) // 2] ^= 0xFF
    (bundle / "model.onnx").write_bytes(bytes(graph))
    server = ServerProcess(bundle, "--device", "cpu", "--workers", "2")
    rc = server.wait_exit(60)
    errors = [line for line in server.log.splitlines() if line.startswith("sentiment-server: error:")]
    assert rc == 2 and errors and all(f"{bundle / 'model.onnx'}: checksum mismatch" in e for e in errors), \
        server.log
    assert "Traceback" not in server.log, server.log




STUCK = """import faulthandler, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
faulthandler.register(signal.SIGUSR1, all_threads=True)
open({ready!r}, "w").close()
time.sleep(600)  # the worker that will not drain
"""


@pytest.mark.slow  # the parent's wait is grace_s twice plus 10 s
def test_a_worker_stuck_past_its_grace_shows_its_stacks_before_it_is_killed(tiny_bundle: Path, tmp_path: Path, capfd,
                                                                            caplog) -> None:
    """Which line a stuck worker was in is what its log must say: the parent asks it for its threads' stacks
    (faulthandler, SIGUSR1) before SIGKILL, and exits 1. A worker of this kind hung once in CI with nothing to go on."""
    parent = _Parent(tiny_bundle, ServerConfig(workers=1, grace_s=0.1), "INFO")
    slot = parent.slots[0]
    ready = tmp_path / "ready"
    slot.process = multiprocessing.get_context("spawn").Process(target=exec, args=(STUCK.format(ready=str(ready)),))
    slot.process.start()
    wait_until(ready.exists, 30, what="the stuck worker's handlers set")
    with caplog.at_level(logging.INFO, logger="serving.process.workers"):
        assert parent._drain(Health()) == 1
    assert f"worker 0 (pid {slot.process.pid}) still running after the grace period: killed" in caplog.text
    assert slot.process.exitcode == -signal.SIGKILL
    err = capfd.readouterr().err
    assert "most recent call first" in err and 'File "<string>", line 5 in <module>' in err, err
