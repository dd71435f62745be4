"""The proxy's image (Containerfile.proxy: Debian trixie's HAProxy with deploy/proxy/haproxy.cfg) in front of a real
server started with `behind_proxy`: what the proxy adds (admission at its model slots, an overload refused there, a
server down, TLS at the proxy, HTTP under the same rules), each through the wire from real gRPC and hand-built HTTP/2
clients. The per-address attacks through it: tests/test_edge.py. The image is built and run with buildah
(tests/images.py; `make container-deps`), as the deployments run it."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hostile import _Connection
from http_fixtures import call, classify
from images import config, ok, proxy_image
from procs import free_port, run
from serving_fixtures import FrontProxy, HeldRuns, certs, flood_and_one_more_are_refused, running_server, wait_until

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.process.app import SentimentServer

CLASSIFY = "/sentiment.v1.SentimentService/Classify"
TOKEN = "front-proxy-token-0123456789"
AUTH = [("authorization", f"Bearer {TOKEN}")]

__all__ = ["certs"]


@contextmanager
def proxy(server: SentimentServer | int, **settings: object) -> Iterator[int]:
    """The proxy's image in front of `server` (or of a port), `settings` through its environment; its port."""
    with FrontProxy(server if isinstance(server, int) else server.port, settings) as front:
        yield front.port


@contextmanager
def http_proxy(server: SentimentServer, **settings: object) -> Iterator[int]:
    """The proxy's image in front of `server`'s HTTP port too; the proxy's HTTP port."""
    with FrontProxy(server.port, settings, http_backend=server.http_port) as front:
        yield front.http_port


def _ended(conn: _Connection, sid: int) -> tuple[str, str]:
    assert conn.wait(lambda: sid in conn.ended, 10), f"stream {sid} not answered"
    return conn.ended[sid], conn.messages.get(sid, "")


def test_the_configuration_is_valid_with_and_without_tls(tmp_path: Path) -> None:
    """`haproxy -c` in the image, on its file as shipped (its defaults), and with PROXY_TLS_CERT naming a PEM."""
    pem = tmp_path / "proxy.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-days",
                    "1", "-keyout", str(pem), "-out", str(pem)], check=True, capture_output=True)
    pem.chmod(0o644)  # readable by the image's user, as deploy/proxy/tls's Secret is (0440, the pod's fsGroup)
    image = proxy_image()
    ctr = ok(["buildah", "from", "--pull-never", image], timeout=120).stdout.strip()
    try:
        for extra in ([], ["--volume", f"{pem}:/run/proxy.pem:ro", "--env", "PROXY_TLS_CERT=/run/proxy.pem"]):
            out = run(["buildah", "run", "--isolation", "chroot", *extra, ctr, "--", *config(image)["Entrypoint"],
                       "-c"], timeout=120)
            assert out.returncode == 0, out.stdout + out.stderr
    finally:
        run(["buildah", "rm", ctr], timeout=120)


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
            assert result.label in s.core.predictor.label_names
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plain, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.SentimentServiceStub(plain).Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=5, metadata=AUTH)
        assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_an_overload_through_the_proxy_is_refused_by_the_proxy(tiny_bundle: Path) -> None:
    """An overload made here rather than raced against the machine: MODEL_CALLS 2 and the server's one batch worker
    held inside a run (HeldRuns) with a call in it and a second queued behind it, so that both of the proxy's slots
    are taken and stay taken. A flood of 200 calls of 64 texts at once on 4 connections, and the authorised
    client's call on its own: every one is refused RESOURCE_EXHAUSTED by the proxy (its message) while the run is
    still held, so none waited behind the model, and none reached the server (the calls it holds are still the
    two); health answers through the proxy. Released, the two held calls are answered."""
    with running_server(tiny_bundle, device="cpu", behind_proxy=True, auth_token=TOKEN, batch_workers=1) as s, \
            proxy(s, MODEL_CALLS=2) as port:
        channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(5)]
        try:
            stubs = [pb_grpc.SentimentServiceStub(c) for c in channels]
            assert stubs[0].Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10, metadata=AUTH).results
            answered = s.metrics.requests.labels("grpc", CLASSIFY.lstrip("/"), "OK")._value.get()
            with HeldRuns(s) as held:
                running = stubs[0].Classify.future(pb.ClassifyRequest(texts=["dans le calcul"]), timeout=60,
                                                   metadata=AUTH)
                assert held.wait_entered()
                queued = stubs[0].Classify.future(pb.ClassifyRequest(texts=["en attente"]), timeout=60,
                                                  metadata=AUTH)
                wait_until(lambda: s.core.batcher.queued == 1, what="the second call queued")
                load = pb.ClassifyRequest(texts=[f"Un livre {i}, assez long pour compter." for i in range(64)])
                flood_and_one_more_are_refused(stubs, load, AUTH, pb.ClassifyRequest(texts=["trop"]),
                                               "every model slot is busy (proxy)")
                assert s.admission.in_progress == 2 and not running.done() and not queued.done()
                health = health_pb2_grpc.HealthStub(channels[0]).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert len(running.result().results) == 1 and len(queued.result().results) == 1
            assert s.metrics.requests.labels("grpc", CLASSIFY.lstrip("/"), "OK")._value.get() == answered + 2
        finally:
            for c in channels:
                c.close()


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


@pytest.mark.parametrize("answered_by", ["server", "proxy"])
def test_a_call_answered_before_its_request_ends_is_reset_with_no_error(answered_by: str, tiny_bundle: Path) -> None:
    """A call answered on its headers, before its body has ended (the server's UNAUTHENTICATED; the proxy's own
    answer on its health-only port): the proxy then resets the stream with NO_ERROR, as the server does when called
    directly (RFC 9113, 8.1), so a gRPC client keeps the answer. Debian bookworm's HAProxy 2.6.12 reset it with
    CANCEL, which a client that reads the reset first reports as CANCELLED (HAProxy's issue 1219;
    docs/RELIABILITY.md, "A front proxy")."""
    health_port = free_port()
    with running_server(tiny_bundle, device="cpu", behind_proxy=True, auth_token=TOKEN) as s, \
            proxy(s, HEALTH_BIND=f"127.0.0.1:{health_port}") as port:
        conn = _Connection(health_port if answered_by == "proxy" else port)
        conn.start_reading()
        try:
            sid = conn.open_stream(CLASSIFY)  # no token
            if answered_by == "server":  # 20 KB of a body that never ends: past the proxy's wait for it (16 KB)
                with conn.lock:
                    for part in (bytes(16384), bytes(4000)):
                        conn.h2.send_data(sid, part)
                    conn._flush()
            assert _ended(conn, sid)[0] == {"server": "16", "proxy": "12"}[answered_by]
            assert conn.wait(lambda: sid in conn.resets, 5), "the answered stream was never reset"
            assert conn.resets[sid] == 0, f"RST_STREAM code {conn.resets[sid]}, not NO_ERROR"
        finally:
            conn.close()


def test_http_calls_pass_through_the_proxy_under_the_same_rules(tiny_bundle: Path) -> None:
    """The HTTP port (KServe v2 REST, /v1/classify) behind the proxy: calls and health pass; MODEL_CALLS 1: with the
    one slot held in the model, the next call is answered 429 by the proxy in the server's JSON shape, health still
    200. (Wrong tokens and the other per-address rules on this port: tests/test_edge.py.)"""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with running_server(tiny_bundle, device="cpu", behind_proxy=True, auth_token=TOKEN, http_port=0,
                        batch_workers=1) as s, http_proxy(s, MODEL_CALLS=1) as port:
        served = classify(port, ["prêt"], auth)
        assert served.status == 200 and served.json["results"][0]["label"] in s.core.predictor.label_names
        with HeldRuns(s) as held:
            with ThreadPoolExecutor(1) as pool:
                running = pool.submit(classify, port, ["dans le calcul"], auth)
                assert held.wait_entered()
                refused = classify(port, ["trop"], auth)
                assert refused.status == 429, refused
                assert refused.json["code"] == "RESOURCE_EXHAUSTED" and "(proxy)" in refused.json["error"]
                assert call(port, "GET", "/v2/health/ready").status == 200
                held.release()
                assert running.result().status == 200


def test_http_calls_to_a_server_that_cannot_be_reached_are_503() -> None:
    """Nothing behind the proxy's HTTP port: once its check has seen it, a call is answered 503 UNAVAILABLE by the
    proxy, in the server's JSON shape."""
    with FrontProxy(free_port(), http_backend=free_port()) as front:
        time.sleep(2.5)  # two failed checks
        reply = classify(front.http_port, ["prêt"], {"Authorization": f"Bearer {TOKEN}"})
        assert reply.status == 503 and reply.json["code"] == "UNAVAILABLE" and "(proxy)" in reply.json["error"]


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
