"""Hostile HTTP against the server itself (no proxy in front): what it must bound on its own. Each case gets a clear
4xx or a closed connection, and the unauthenticated get nothing, their bodies unread. Per-address limits are the
front proxy's (deploy/proxy/): tests/test_front_proxy.py. Raw sockets: each byte on the wire is the test's.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from http_fixtures import call, classify, closed, raw_exchange, read_all
from serving_fixtures import ServerProcess, running_server

from serving.process.app import SentimentServer
from serving.protocols.http.server import MAX_HEAD_BYTES, MAX_HEADERS

TOKEN = "hostile-test-token-0123456789"
BODY_TIMEOUT = 1.0
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tiny_bundle: Path):
    with running_server(tiny_bundle, device="cpu", http_port=0, body_timeout_s=BODY_TIMEOUT,
                        max_message_bytes=LIMIT) as s:
        yield s


def _head(path: str = "/v1/classify", **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json",
             *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def test_slow_headers_get_408_and_the_connection_closed(server: SentimentServer) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
        s.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\n")  # ... and never the rest
        start = time.monotonic()
        reply = read_all(s, 10)
    assert _status(reply) == 408 and b"connection: close" in reply
    assert time.monotonic() - start < 10  # closed by the server, not by the test's read


def test_a_connection_that_sends_nothing_is_closed(server: SentimentServer) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
        assert closed(s, 10)


def test_a_slow_body_gets_408_and_the_connection_closed(server: SentimentServer) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
        s.sendall(_head(Content_Length="100") + b'{"texts": [')  # 11 of 100 bytes
        reply = read_all(s, 10)
    assert _status(reply) == 408 and b"connection: close" in reply
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["code"] == "CANCELLED"
    assert server.metrics.body_timeouts._value.get() >= 1  # counted as gRPC's are (serving/limits/admission.py)
    assert server.metrics.registry.get_sample_value("sentiment_requests_total", {
        "protocol": "http", "method": "POST /v1/classify", "code": "CANCELLED"}) >= 1


def test_a_huge_declared_body_is_refused_unread(server: SentimentServer) -> None:
    reply = raw_exchange(server.http_port, _head(Content_Length=str(1 << 30)) + b"x" * 1000)
    assert _status(reply) == 413 and b"connection: close" in reply and b"max_message_bytes" in reply


def test_a_chunked_body_past_the_limit_is_refused_and_closed(server: SentimentServer) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
        s.sendall(_head(Transfer_Encoding="chunked"))
        chunk = b"%x\r\n%s\r\n" % (16 * 1024, b"a" * 16 * 1024)
        try:
            for _ in range(LIMIT // (16 * 1024) + 8):  # past the limit; the server may close before the end
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = read_all(s, 10)
    assert _status(reply) == 413 and b"connection: close" in reply


@pytest.mark.parametrize("headers", [
    {f"X-Flood-{i}": "a" for i in range(MAX_HEADERS + 5)},
    {"X-Big": "b" * (MAX_HEAD_BYTES + 1)},
], ids=["many headers", "one huge header"])
def test_a_header_flood_gets_431_and_the_connection_closed(server: SentimentServer, headers: dict) -> None:
    reply = raw_exchange(server.http_port, _head(**headers).replace(b"\r\n\r\n", b"\r\n") + b"X-More: 1\r\n" * 5000)
    assert _status(reply) == 431 and b"connection: close" in reply
    assert classify(server.http_port, ["Toujours là."]).status == 200


def test_a_huge_url_gets_431(server: SentimentServer) -> None:
    reply = raw_exchange(server.http_port, b"GET /" + b"a" * (MAX_HEAD_BYTES + 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _status(reply) == 431


def test_malformed_http_gets_400_and_a_close(server: SentimentServer) -> None:
    reply = raw_exchange(server.http_port, b"NOT HTTP AT ALL\r\n\r\n")
    assert _status(reply) == 400 and b"connection: close" in reply


def test_malformed_requests_cannot_flood_the_log(tiny_bundle: Path) -> None:
    """uvicorn writes a warning for every invalid request: 50 of them wrote 50 lines. Now at most 3 a minute, the rest
    counted (serving/telemetry/logs.py, ClientCausedLines); every one still gets its 400."""
    server = ServerProcess(tiny_bundle, "--device", "cpu", "--http-port", "0")
    try:
        server.wait_listening()
        assert server.http_port is not None
        replies = [raw_exchange(server.http_port, b"NOT HTTP AT ALL\r\n\r\n") for _ in range(50)]
        assert server.stop() == 0
    finally:
        server.close()
    assert all(_status(reply) == 400 for reply in replies)
    assert sum("Invalid HTTP request received." in line for line in server.log.splitlines()) == 3, server.log


def test_pipelined_calls_are_answered_in_order(server: SentimentServer) -> None:
    texts = [f"Livre numéro {i}." for i in range(40)]
    requests = b""
    for t in texts:
        body = json.dumps({"texts": [t]}).encode()
        requests += _head(Content_Length=str(len(body))) + body
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
        s.sendall(requests)  # every request at once, then read
        data = b""
        while data.count(b"HTTP/1.1 200 ") < len(texts):
            chunk = s.recv(65536)
            assert chunk, f"closed after {data.count(b'HTTP/1.1 ')} answers"
            data += chunk
    assert data.count(b"HTTP/1.1 ") == len(texts)
    bodies = [part.split(b"\r\n\r\n", 1)[1] for part in data.split(b"HTTP/1.1 200 OK\r\n")[1:]]
    assert [json.loads(b)["results"][0]["token_count"] for b in bodies] == [
        r["token_count"] for t in texts for r in classify(server.http_port, [t]).json["results"]]


def test_deep_json_within_the_size_limit_gets_400(server: SentimentServer) -> None:
    for body in (b"[" * (LIMIT - 100), b'{"a":' * 10_000 + b"1" + b"}" * 10_000):
        reply = call(server.http_port, "POST", "/v1/classify", body, {"Content-Type": "application/json"})
        assert (reply.status, reply.json["code"]) == (400, "INVALID_ARGUMENT")


def test_an_unauthenticated_flood_is_refused_unread_and_served_nothing(tiny_bundle: Path) -> None:
    """Each call announces a megabyte it never sends: a server that read bodies before the token would wait for
    them; here each is answered 401 from its headers and its connection closed."""
    with running_server(tiny_bundle, device="cpu", http_port=0, auth_token=TOKEN, body_timeout_s=30) as s:
        socks = []
        try:
            for _ in range(200):
                sock = socket.create_connection(("127.0.0.1", s.http_port), timeout=10)
                sock.sendall(_head(Content_Length=str(1 << 20), Authorization="Bearer wrong-token-012345678"))
                socks.append(sock)
            for sock in socks:
                reply = read_all(sock, 10)
                assert _status(reply) == 401 and b"connection: close" in reply
        finally:
            for sock in socks:
                sock.close()
        assert s.metrics.auth_failures._value.get() == 200
        assert s.core.batcher.metrics.texts._value.get() == 0 and s.core.batcher.queued == 0
        assert classify(s.http_port, ["Bon."], {"Authorization": f"Bearer {TOKEN}"}).status == 200


def test_memory_stays_flat_under_hostile_calls(tiny_bundle: Path) -> None:
    """A real server process: its resident memory after a warm-up, then after thousands of hostile calls (refused
    bodies, deep JSON, header floods, dropped connections) and after as many good ones, within a few MB."""
    server = ServerProcess(tiny_bundle, "--http-port", "0", "--device", "cpu", "--body-timeout-s", "1",
                           "--max-message-bytes", str(LIMIT), "--memory-reclaim-idle-s", "0.5")
    try:
        server.wait_listening(60)
        port = server.http_port

        def rss() -> int:
            return server._tree()[0].memory_info().rss

        def round_of_abuse() -> None:
            for _ in range(100):
                raw_exchange(port, _head(Content_Length=str(1 << 30)), read_for=2)
                call(port, "POST", "/v1/classify", b"[" * (LIMIT - 100), {"Content-Type": "application/json"})
                raw_exchange(port, _head(**{f"X-{i}": "a" * 100 for i in range(150)}), read_for=2)
                with socket.create_connection(("127.0.0.1", port)) as sock:
                    sock.sendall(_head(Content_Length="5000") + b"{")  # then gone
                classify(port, ["Un livre, un vrai."] * 8)

        round_of_abuse()
        time.sleep(1.5)  # the reclaimer's idle wait (0.5 s) and its run
        warm = rss()
        for _ in range(3):
            round_of_abuse()
        time.sleep(1.5)
        assert rss() - warm < 8 * 1024 * 1024, (warm, rss())
        assert server.stop() == 0
    finally:
        server.close()
