"""deploy/proxy/haproxy.cfg, run by HAProxy in front of a real server started with `behind_proxy`: what the proxy
adds (admission at its model slots, per-address limits the server cannot apply behind it), each through the wire
from real gRPC and hand-built HTTP/2 clients. HAProxy comes from Debian (`make proxy-deps`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hostile import HalfOpen, _Connection
from procs import REPO, free_port
from serving_fixtures import PROXY_DIR, FrontProxy, HeldRuns, certs, running_server

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.process.app import SentimentServer

CLASSIFY = "/sentiment.v1.SentimentService/Classify"
TOKEN = "front-proxy-token-0123456789"
AUTH = [("authorization", f"Bearer {TOKEN}")]

__all__ = ["certs"]


def _haproxy() -> str:
    path = shutil.which("haproxy")
    if path is None:
        message = "haproxy not found: run `make proxy-deps` (apt-get install haproxy, as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@contextmanager
def proxy(server: SentimentServer | int, **settings: object) -> Iterator[int]:
    """deploy/proxy/haproxy.cfg in front of `server` (or of a port), `settings` through its environment; its port."""
    _haproxy()
    with FrontProxy(server if isinstance(server, int) else server.port, settings) as front:
        yield front.port


def _ended(conn: _Connection, sid: int) -> tuple[str, str]:
    assert conn.wait(lambda: sid in conn.ended, 10), f"stream {sid} not answered"
    return conn.ended[sid], conn.messages.get(sid, "")


def test_the_configuration_is_valid_with_and_without_tls(tmp_path: Path) -> None:
    """`haproxy -c` on the file as shipped (its defaults), and with PROXY_TLS_CERT naming a certificate."""
    pem = tmp_path / "proxy.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-days",
                    "1", "-keyout", str(pem), "-out", str(pem)], check=True, capture_output=True)
    for extra in ({}, {"PROXY_TLS_CERT": str(pem)}):
        out = subprocess.run([_haproxy(), "-c", "-f", str(PROXY_DIR / "haproxy.cfg")], capture_output=True, text=True,
                             env={**os.environ, "PROXY_DIR": str(PROXY_DIR), **extra})
        assert out.returncode == 0, out.stdout + out.stderr


def test_with_a_certificate_tls_ends_at_the_proxy(tiny_bundle: Path, certs: dict[str, Path], tmp_path: Path) -> None:
    """PROXY_TLS_CERT: a client calls the proxy over TLS (trusting the CA that signed its certificate), the proxy
    calls the server in plain text on loopback; a plain-text client gets no answer. HEALTH_BIND: health in plain
    text on a port of its own (kubelet's probes), and nothing else there."""
    pem = tmp_path / "proxy.pem"
    pem.write_bytes(certs["server"].read_bytes() + certs["server_key"].read_bytes())
    health_port = free_port()
    with running_server(tiny_bundle, device="cpu", behind_proxy=True, auth_token=TOKEN) as s, \
            proxy(s, PROXY_TLS_CERT=pem, HEALTH_BIND=f"127.0.0.1:{health_port}") as port:
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as plain:
            health = health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.SentimentServiceStub(plain).Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=5,
                                                             metadata=AUTH)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "grpc.health.v1 only" in refused.value.details()
        creds = grpc.ssl_channel_credentials(root_certificates=certs["ca"].read_bytes())
        with grpc.secure_channel(f"localhost:{port}", creds) as channel:
            stub = pb_grpc.SentimentServiceStub(channel)
            (result,) = stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10, metadata=AUTH).results
            assert result.label in s.predictor.label_names
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plain, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.SentimentServiceStub(plain).Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=5, metadata=AUTH)
        assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_past_its_model_slots_the_proxy_refuses_at_once_and_health_passes(tiny_bundle: Path) -> None:
    """MODEL_CALLS 1: a call held inside the model's run takes the one slot; the next is answered RESOURCE_EXHAUSTED
    by the proxy (its message says so) without reaching the server, and health still answers through the proxy."""
    with running_server(tiny_bundle, device="cpu", behind_proxy=True, auth_token=TOKEN, batch_workers=1) as s, \
            proxy(s, MODEL_CALLS=1) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        assert stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10, metadata=AUTH).results
        with HeldRuns(s) as held:
            running = stub.Classify.future(pb.ClassifyRequest(texts=["dans le calcul"]), timeout=60, metadata=AUTH)
            assert held.wait_entered()
            served = s.metrics.requests.labels("sentiment.v1.SentimentService/Classify", "OK")._value.get()
            start = time.perf_counter()
            with pytest.raises(grpc.RpcError) as refused:
                stub.Classify(pb.ClassifyRequest(texts=["trop"]), timeout=10, metadata=AUTH)
            assert time.perf_counter() - start < 1.0
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "(proxy)" in refused.value.details()
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert len(running.result().results) == 1
        assert s.metrics.requests.labels("sentiment.v1.SentimentService/Classify", "OK")._value.get() == served + 1


def test_a_server_that_cannot_be_reached_is_unavailable_not_overloaded() -> None:
    """Nothing listens behind the proxy: once its check (every second) has seen it, a model call is answered
    UNAVAILABLE by the proxy at once; before, the backend's 503 said RESOURCE_EXHAUSTED "every model slot is busy",
    after 3 s of retries, to a client that should try another replica."""
    with proxy(free_port()) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        time.sleep(2.5)  # two failed checks
        start = time.perf_counter()
        with pytest.raises(grpc.RpcError) as refused:
            stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10, metadata=AUTH)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        assert "cannot be reached (proxy)" in refused.value.details() and time.perf_counter() - start < 1.0
        with pytest.raises(grpc.RpcError) as health:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.value.code() == grpc.StatusCode.UNAVAILABLE


def test_calls_withholding_their_body_without_the_token_free_their_model_slot_at_once(tiny_bundle: Path) -> None:
    """MODEL_CALLS 2: HAProxy passes a call on, and counts its slot, from its headers. 4 calls without the token whose
    body never comes: the server refuses each on its headers (UNAUTHENTICATED), so the slots are free again and a
    client's call is served. (With the token, or a server without one, such calls keep their slots until the
    server's body_timeout_s: docs/RELIABILITY.md, "A front proxy".)"""
    with running_server(tiny_bundle, device="cpu", behind_proxy=True, auth_token=TOKEN) as s, \
            proxy(s, MODEL_CALLS=2) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        withheld = HalfOpen(port, CLASSIFY, 4)
        try:
            assert withheld.wait(lambda: withheld.open_count == 0, 10)
            # UNAUTHENTICATED from the server; or RESOURCE_EXHAUSTED from the proxy, for those that came while the
            # first two held the slots
            assert "16" in withheld.ended.values() and set(withheld.ended.values()) <= {"16", "8"}, withheld.ended
            stub = pb_grpc.SentimentServiceStub(channel)
            assert stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10, metadata=AUTH).results
        finally:
            withheld.close()


def test_wrong_tokens_from_one_address_are_answered_by_the_proxy(tiny_bundle: Path) -> None:
    """AUTH_FAILURES_PER_SOURCE 3: from 127.0.0.2, the server answers the first wrong tokens (UNAUTHENTICATED); past
    3 in 10 s the proxy answers them itself. The server, behind the proxy, blocks nobody (one address for all), so
    the authorised client on 127.0.0.1 is served throughout."""
    with running_server(tiny_bundle, device="cpu", behind_proxy=True, auth_token=TOKEN) as s, \
            proxy(s, AUTH_FAILURES_PER_SOURCE=3) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        attacker = _Connection(port, source="127.0.0.2")
        attacker.start_reading()
        try:
            answers = [_ended(attacker, attacker.open_stream(CLASSIFY, [("authorization", "Bearer wrong")], end=True))
                       for _ in range(10)]
        finally:
            attacker.close()
        assert all(code == "16" for code, _ in answers), answers  # UNAUTHENTICATED
        by_proxy = [message for _, message in answers if "(proxy)" in message]
        assert len(by_proxy) == 6, answers  # the 5th and after: 4 failures in the window are past 3
        assert "missing or wrong bearer token" in answers[0][1]
        assert s.metrics.auth_failures._value.get() == 4
        assert stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10, metadata=AUTH).results


def test_connections_past_the_per_address_limit_are_closed(tiny_bundle: Path) -> None:
    """CONNS_PER_SOURCE 2: a third connection from 127.0.0.2 is closed at once; 127.0.0.3 still connects."""
    with running_server(tiny_bundle, device="cpu", behind_proxy=True) as s, proxy(s, CONNS_PER_SOURCE=2) as port:
        kept = [_Connection(port, source=source) for source in ("127.0.0.2", "127.0.0.2", "127.0.0.3")]
        try:
            for c in kept:
                c.start_reading()
            time.sleep(0.2)  # the proxy has counted them
            try:  # reset at once: while it sends its preface, or as the first read
                third = _Connection(port, source="127.0.0.2")
                third.start_reading()
                assert third.closed.wait(5), "the third connection from one address stayed open"
                third.close()
            except ConnectionResetError:
                pass
            time.sleep(0.5)
            assert not any(c.closed.is_set() for c in kept)
        finally:
            for c in kept:
                c.close()


def test_a_call_whose_headers_never_end_loses_its_connection_an_idle_client_keeps_its_own(tiny_bundle: Path) -> None:
    """HEADERS_TIMEOUT 1s: a connection that sends a HEADERS frame without its end (a slow-headers attack) is closed
    within about that long; a client's connection idle between calls for twice as long is kept (its idle limit is
    the server's, 300 s)."""
    with running_server(tiny_bundle, device="cpu", behind_proxy=True) as s, proxy(s, HEADERS_TIMEOUT="1s") as port:
        client = _Connection(port)
        client.start_reading()
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            sid = client.open_stream(CLASSIFY)
            client.send_message(sid, pb.ClassifyRequest(texts=["prêt"]).SerializeToString())
            assert _ended(client, sid)[0] == "0"
            # the preface, an empty SETTINGS, then HEADERS (type 1) on stream 1 without END_HEADERS: 3 bytes of it
            slow.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(3) + b"\x04" + bytes(5)
                         + b"\x00\x00\x03\x01\x00\x00\x00\x00\x01" + b"\x83\x86\x84")
            start = time.monotonic()
            while slow.recv(4096):
                pass
            assert time.monotonic() - start < 5, "the slow headers held their connection"
            time.sleep(max(0.0, start + 2.0 - time.monotonic()))
            assert not client.closed.is_set(), "an idle client's connection was closed"
            sid = client.open_stream(CLASSIFY)
            client.send_message(sid, pb.ClassifyRequest(texts=["encore"]).SerializeToString())
            assert _ended(client, sid)[0] == "0"
        finally:
            slow.close()
            client.close()


def test_behind_a_proxy_the_server_limits_no_address(tiny_bundle: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Wrong tokens from one address are counted but never block it: per-address limits are the proxy's. With
    behind_proxy, listening beyond loopback gives no warning of a missing proxy."""
    caplog.set_level(logging.WARNING)
    with running_server(tiny_bundle, device="cpu", behind_proxy=True, auth_token=TOKEN, host="0.0.0.0") as s, \
            grpc.insecure_channel(f"127.0.0.1:{s.port}") as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        for _ in range(15):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10, metadata=[("authorization", "Bearer x")])
            assert "missing or wrong bearer token" in refused.value.details()
        assert stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10, metadata=AUTH).results
        assert s.metrics.auth_failures._value.get() == 15
    assert not [r.getMessage() for r in caplog.records if "front proxy" in r.getMessage()]


@pytest.mark.slow
def test_an_overload_through_the_proxy_is_refused_by_the_proxy(tiny_bundle: Path, tmp_path: Path) -> None:
    """bench/protocol_attacks.py's overload-rate through deploy/proxy (`--via-haproxy 8`), shortened: the load's
    refusals and the authorised client's are the proxy's (its message), and every call is answered or refused
    within a second (docs/RELIABILITY.md, "A front proxy", has the figures: 8.6-8.9 ms p99)."""
    _haproxy()
    report = tmp_path / "proxy-overload.json"
    run = subprocess.run([sys.executable, "bench/protocol_attacks.py", "--bundle", str(tiny_bundle), "--attacks",
                          "overload-rate", "--seconds", "6", "--via-haproxy", "8", "--json", str(report)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (result,) = json.loads(report.read_text())["results"]
    load, authorised = result["attacker"], result["authorised"]
    assert load["RESOURCE_EXHAUSTED"]["calls"] > 0 and "(proxy)" in load["RESOURCE_EXHAUSTED"]["message"], load
    assert load["RESOURCE_EXHAUSTED"]["max_ms"] < 1000 and load["OK"]["p50_ms"] < 1000, load
    assert set(load) == {"OK", "RESOURCE_EXHAUSTED"}, load
    assert authorised["errors"].get("RESOURCE_EXHAUSTED", 0) > 0 and authorised["refused_p99_ms"] < 1000, authorised
