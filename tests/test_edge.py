"""Attacks on the edge: each per-address attack of bench/protocol_attacks.py made small, through the proxy's image
(Containerfile.proxy with deploy/proxy/haproxy.cfg, run by buildah: tests/images.py) in front of a real server
started behind_proxy. The attacker connects from 127.0.0.2; the authorised client from 127.0.0.1, another address
to the proxy, is served throughout. Each test asserts on states (a connection closed, a status and who sent it, the
server's counts), never on a duration: the proxy's limits are set small, its timeouts to a second, and a test waits
for what they must bring about. docs/RELIABILITY.md ("A front proxy") has the full attacks' figures."""

from __future__ import annotations

import http.client
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from hostile import (
    CANCEL,
    END_HEADERS,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    HalfOpen,
    Raw,
    Unread,
    _Connection,
    frame,
    request_block,
)
from http_fixtures import classify
from serving_fixtures import FrontProxy, running_server, wait_until

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.process.app import SentimentServer

TOKEN = "edge-token-0123456789abcdef"
AUTH = [("authorization", f"Bearer {TOKEN}")]
HTTP_AUTH = {"Authorization": f"Bearer {TOKEN}"}
CLASSIFY = "/sentiment.v1.SentimentService/Classify"
ATTACKER = "127.0.0.2"
WAIT = 30.0  # how long a test waits for a state the proxy must bring about (its timeouts here: 1 s)
CANCELLED, RESOURCE_EXHAUSTED, UNAUTHENTICATED = "1", "8", "16"  # grpc-status values


@pytest.fixture(scope="module")
def server(tiny_bundle: Path) -> Iterator[SentimentServer]:
    """The server as deployed behind the proxy: a token, gRPC and HTTP on loopback, --behind-proxy."""
    with running_server(tiny_bundle, device="cpu", behind_proxy=True, auth_token=TOKEN, http_port=0) as s:
        yield s


@contextmanager
def edge(server: SentimentServer, **settings: object) -> Iterator[FrontProxy]:
    """The proxy's image in front of both of `server`'s ports, `settings` through its environment."""
    with FrontProxy(server.port, settings, http_backend=server.http_port) as front:
        yield front


def calls(server: SentimentServer, protocol: str) -> float:
    """Every call the server has answered on `protocol`, whatever its method and code."""
    return sum(sample.value for family in server.metrics.registry.collect() for sample in family.samples
               if sample.name == "sentiment_requests_total" and sample.labels["protocol"] == protocol)


def served(port: int) -> None:
    """An authorised Classify from 127.0.0.1 on a new channel, answered."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        assert len(stub.Classify(pb.ClassifyRequest(texts=["Un bon livre."]), timeout=10, metadata=AUTH).results) == 1


def served_or_refused(port: int) -> bool:
    """`served(port)`, False where the proxy refused the call for want of a model slot."""
    try:
        served(port)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return False
    return True


def closed_by_peer(sock: socket.socket) -> bytes:
    """What the other side sent until it closed `sock`; fails when it is still open after WAIT s."""
    sock.settimeout(WAIT)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"still open after {WAIT} s")
    return data


def closed_at_accept(port: int, greeting: bytes, source: str = ATTACKER) -> bool:
    """Whether a new connection from `source` that sends `greeting` is closed with no byte of answer (the proxy's
    `tcp-request connection reject`); False when it answers (an HTTP/2 port sends its SETTINGS at once)."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT, source_address=(source, 0))
    except ConnectionResetError:
        return True  # the proxy's reset came before connect() returned (a loaded machine): refused at accept
    with sock:
        try:
            sock.sendall(greeting)
        except OSError:
            pass  # reset while sending: closed at accept
        return closed_by_peer(sock) == b""


def rapid_reset(port: int, n: int, metadata: list[tuple[str, str]]) -> Raw:
    """`n` Classify calls opened and reset at once (HEADERS, RST_STREAM CANCEL) from 127.0.0.2 in one burst on one
    connection, which the proxy must end; that connection, closed."""
    block, reset = request_block(CLASSIFY, metadata), struct.pack(">I", CANCEL)
    attacker = Raw(port, source=ATTACKER)
    try:
        assert attacker.wait_settings()
        attacker.send(b"".join(frame(HEADERS, END_HEADERS, sid, block) + frame(RST_STREAM, 0, sid, reset)
                               for sid in range(1, 2 * n, 2)))
        assert attacker.closed.wait(WAIT), "the rapid reset's connection was kept"
    finally:
        attacker.close()
    return attacker


HEALTH = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n"
HEALTH_GET = HEALTH + b"Connection: close\r\n\r\n"  # answered, then closed by the proxy


# ------------------------------------------------------------------------------------- floods


@pytest.mark.parametrize("kind", ["PING", "SETTINGS"])
def test_a_control_frame_flood_is_answered_by_the_proxy_while_another_address_is_served(
        server: SentimentServer, kind: str) -> None:
    """20,000 PING (or SETTINGS) frames from 127.0.0.2, in bursts between the authorised client's calls: the proxy
    acknowledges every one itself (the server, behind HTTP/2 of its own with the proxy, never reads them), and each
    authorised call is answered. (What such a flood costs the proxy: docs/RELIABILITY.md.)"""
    burst = (frame(PING, 0, 0, b"attacker") if kind == "PING" else frame(SETTINGS, 0, 0)) * 1000
    with edge(server) as front:
        before = calls(server, "grpc")
        attacker = Raw(front.port, source=ATTACKER)
        try:
            assert attacker.wait_settings()
            for _ in range(20):
                assert attacker.send(burst)
                served(front.port)
            # the proxy's own SETTINGS, then an ack of each of ours (the first, of the handshake, too)
            acks = (lambda: attacker.acks) if kind == "PING" else (lambda: attacker.received.get(SETTINGS, 0) - 2)
            wait_until(lambda: acks() >= 20_000, WAIT, "the flood acknowledged")
            assert acks() == 20_000
            assert not attacker.closed.is_set()
        finally:
            attacker.close()
        assert calls(server, "grpc") - before == 20


@pytest.mark.parametrize("token", [True, False], ids=["with the token", "without"])
def test_a_rapid_reset_is_dropped_by_the_proxy_while_another_address_is_served(server: SentimentServer,
                                                                                token: bool) -> None:
    """CALLS_PER_SOURCE_S 50, HEADERS_TIMEOUT 1s: 200 calls opened and reset at once (HEADERS, RST_STREAM CANCEL)
    from 127.0.0.2 in one burst: no call of it reaches the server (a call waits for its body at the proxy, and these
    never send one), and the proxy, its address past the call rate, ends the connection (a GOAWAY once
    HEADERS_TIMEOUT has passed; with the rate lifted the connection stays); the authorised client is served."""
    with edge(server, CALLS_PER_SOURCE_S=50, HEADERS_TIMEOUT="1s") as front:
        before = calls(server, "grpc")
        assert rapid_reset(front.port, 200, AUTH if token else []).goaway_code is not None
        assert calls(server, "grpc") == before
        served(front.port)


def test_an_address_past_the_call_rate_is_banned_on_both_ports_while_another_is_served(
        server: SentimentServer) -> None:
    """CALLS_PER_SOURCE_S 20, BAN_S at its default (10), HEADERS_TIMEOUT 1s: a rapid reset of 300 calls from
    127.0.0.2 in one burst loses its connection, and the address is banned: its next connections, on the gRPC port
    and the HTTP port (one table), are closed at accept, where 127.0.0.3 is answered and the authorised client on
    127.0.0.1 served. Before, the proxy dropped the connection alone, and the attacker reconnected at once
    (bench/protocol_attacks.py's rapid-reset: 411 connections in 5 s, where the server's own guard banned it)."""
    with edge(server, CALLS_PER_SOURCE_S=20, HEADERS_TIMEOUT="1s") as front:
        assert not closed_at_accept(front.http_port, HEALTH_GET)  # not banned yet
        rapid_reset(front.port, 300, [])
        assert closed_at_accept(front.port, PREFACE + frame(SETTINGS, 0, 0)), "the attacker reconnected"
        assert closed_at_accept(front.http_port, HEALTH_GET), "the attacker reconnected over HTTP"
        assert classify(front.http_port, ["prêt"], HTTP_AUTH, source="127.0.0.3").status == 200
        served(front.port)


def test_a_ban_ends(server: SentimentServer) -> None:
    """CALLS_PER_SOURCE_S 5, BAN_S 1: an address banned for a burst of 10 HTTP calls on one connection, which tries a
    connection every 0.5 s (slower than 5 a second, which would keep it banned), is closed at accept, then answered
    once the ban is over (within 2 s; tried for 30)."""
    with edge(server, CALLS_PER_SOURCE_S=5, BAN_S=1) as front:
        with socket.create_connection(("127.0.0.1", front.http_port), timeout=WAIT,
                                      source_address=(ATTACKER, 0)) as s:
            s.sendall((HEALTH + b"\r\n") * 10)
            closed_by_peer(s)
        assert closed_at_accept(front.http_port, HEALTH_GET), "not banned"
        for _ in range(60):
            time.sleep(0.5)
            if not closed_at_accept(front.http_port, HEALTH_GET):
                break
        else:
            pytest.fail("still banned after 30 s")


# ------------------------------------------------------------------------------------- wrong tokens


def test_wrong_tokens_past_the_limit_are_answered_by_the_proxy_over_grpc(server: SentimentServer) -> None:
    """AUTH_FAILURES_PER_SOURCE 3: from 127.0.0.2 the server answers the first wrong tokens (UNAUTHENTICATED); past
    3 in 10 s the proxy answers them itself, unseen by the server. The server, behind the proxy, blocks nobody (one
    address for all), so the authorised client on 127.0.0.1 is served throughout."""
    with edge(server, AUTH_FAILURES_PER_SOURCE=3) as front:
        failures = server.metrics.auth_failures._value.get()
        attacker = _Connection(front.port, source=ATTACKER)
        attacker.start_reading()
        answers = []
        try:
            for _ in range(10):
                sid = attacker.open_stream(CLASSIFY, [("authorization", "Bearer wrong")], end=True)
                assert attacker.wait(lambda sid=sid: sid in attacker.ended, WAIT), "a wrong token not answered"
                answers.append((attacker.ended[sid], attacker.messages.get(sid, "")))
                served(front.port)
        finally:
            attacker.close()
        assert all(code == UNAUTHENTICATED for code, _ in answers), answers
        assert "missing or wrong bearer token" in answers[0][1]
        assert [message for _, message in answers if "(proxy)" in message] == [answers[-1][1]] * 6, answers
        assert server.metrics.auth_failures._value.get() - failures == 4  # the 5th and after: 4 in the window > 3


def test_wrong_tokens_past_the_limit_are_answered_by_the_proxy_over_http(server: SentimentServer) -> None:
    """The same on the HTTP port: 401 from the server, then 401 from the proxy (its message says so) in the server's
    JSON shape; an authorised client on 127.0.0.1 gets 200 throughout."""
    with edge(server, AUTH_FAILURES_PER_SOURCE=3) as front:
        failures = server.metrics.auth_failures._value.get()
        answers = []
        for _ in range(6):
            answers.append(classify(front.http_port, ["prêt"], {"Authorization": "Bearer wrong"}, source=ATTACKER))
            assert classify(front.http_port, ["prêt"], HTTP_AUTH).status == 200
        assert {a.status for a in answers} == {401} and {a.json["code"] for a in answers} == {"UNAUTHENTICATED"}
        assert ["(proxy)" in a.json["error"] for a in answers] == [False] * 4 + [True] * 2, [a.json for a in answers]
        assert server.metrics.auth_failures._value.get() - failures == 4


# ------------------------------------------------------------------------------------- connections


def test_connections_past_the_per_address_limit_are_refused_on_both_ports(server: SentimentServer) -> None:
    """CONNS_PER_SOURCE 2, one count for both protocols: two gRPC connections from 127.0.0.2 are kept (each still
    answers a call afterwards); a third from it, on the HTTP port, is closed at once; 127.0.0.3 is served there."""
    with edge(server, CONNS_PER_SOURCE=2) as front:
        kept = [_Connection(front.port, source=ATTACKER) for _ in range(2)]
        try:
            for c in kept:
                c.start_reading()
                assert c.ping(), "a connection within the limit was not answered"  # the proxy has counted it
            assert closed_at_accept(front.http_port, HEALTH_GET)
            other = classify(front.http_port, ["prêt"], HTTP_AUTH, source="127.0.0.3")
            assert other.status == 200
            for c in kept:
                sid = c.open_stream(CLASSIFY, AUTH)
                c.send_message(sid, pb.ClassifyRequest(texts=["encore"]).SerializeToString())
                assert c.wait(lambda c=c, sid=sid: sid in c.ended, WAIT) and c.ended[sid] == "0"
        finally:
            for c in kept:
                c.close()


@pytest.mark.parametrize("silence", ["no byte", "a handshake and no call"])
def test_a_connection_that_says_nothing_is_closed(server: SentimentServer, silence: str) -> None:
    """CLIENT_TIMEOUT 1s, HEADERS_TIMEOUT 1s: a connection that never sends a byte, or one that finishes the HTTP/2
    handshake and makes no call, is closed by the proxy (before, one that never sent a byte was kept for 300 s, at
    most CONNS_PER_SOURCE of them an address: 40 addresses held the proxy's 4,000 connections for 5 minutes)."""
    with edge(server, CLIENT_TIMEOUT="1s", HEADERS_TIMEOUT="1s") as front:
        with socket.create_connection(("127.0.0.1", front.port), timeout=WAIT, source_address=(ATTACKER, 0)) as s:
            if silence != "no byte":
                s.sendall(PREFACE + frame(SETTINGS, 0, 0))
            closed_by_peer(s)
        served(front.port)


def test_slow_headers_lose_their_connection_and_an_idle_client_keeps_its_own(server: SentimentServer) -> None:
    """HEADERS_TIMEOUT 1s: a call's HEADERS without their end, then a byte of CONTINUATION at a time (each resets
    an inactivity timeout), lose their connection; a gRPC client and an HTTP client (keep-alive), each idle since
    its first call, made before the slow headers began, keep their connections (idle between calls: 300 s) and
    answer again on them."""
    block = request_block(CLASSIFY, AUTH)
    with edge(server, HEADERS_TIMEOUT="1s") as front:
        client = _Connection(front.port)
        client.start_reading()
        web = http.client.HTTPConnection("127.0.0.1", front.http_port, timeout=WAIT)
        slow = socket.create_connection(("127.0.0.1", front.port), timeout=WAIT, source_address=(ATTACKER, 0))
        try:
            sid = client.open_stream(CLASSIFY, AUTH)
            client.send_message(sid, pb.ClassifyRequest(texts=["prêt"]).SerializeToString())
            assert client.wait(lambda: sid in client.ended, WAIT) and client.ended[sid] == "0"
            web.request("POST", "/v1/classify", body=b'{"texts": ["pret"]}', headers=HTTP_AUTH)
            assert web.getresponse().read() and web.sock is not None
            web_sock = web.sock
            slow.sendall(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, 0, 1, block[:1]))
            slow.settimeout(0.5)
            for i in range(1, len(block)):  # a byte of CONTINUATION (type 9) whenever the proxy is silent 0.5 s
                try:
                    if not slow.recv(65536):
                        break
                except TimeoutError:
                    slow.sendall(frame(0x9, 0, 1, block[i:i + 1]))
                except ConnectionResetError:
                    break
            else:
                pytest.fail("the slow headers outlived their whole header block")
            assert not client.closed.is_set()
            sid = client.open_stream(CLASSIFY, AUTH)
            client.send_message(sid, pb.ClassifyRequest(texts=["encore"]).SerializeToString())
            assert client.wait(lambda: sid in client.ended, WAIT) and client.ended[sid] == "0"
            web.request("POST", "/v1/classify", body=b'{"texts": ["encore"]}', headers=HTTP_AUTH)
            assert web.getresponse().status == 200 and web.sock is web_sock  # the same connection
        finally:
            slow.close()
            web.close()
            client.close()


def test_slow_http_headers_get_408_and_their_connection_closed(server: SentimentServer) -> None:
    """HEADERS_TIMEOUT 1s on the HTTP port: a request line and a header, then nothing: 408 from the proxy, closed."""
    with edge(server, HEADERS_TIMEOUT="1s") as front, \
            socket.create_connection(("127.0.0.1", front.http_port), timeout=WAIT, source_address=(ATTACKER, 0)) as s:
        s.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\n")
        assert closed_by_peer(s).startswith(b"HTTP/1.1 408 ")


# ------------------------------------------------------------------------------------- bodies and answers


@pytest.mark.parametrize("token", [True, False], ids=["with the token", "without"])
def test_a_grpc_call_withholding_its_body_never_takes_a_model_slot(server: SentimentServer, token: bool) -> None:
    """MODEL_CALLS 1, BODY_TIMEOUT 1s: 4 calls from 127.0.0.2 whose body never comes wait at the proxy, not in a
    model slot: the authorised client's calls, made once the proxy has read them, are served; the proxy ends each
    CANCELLED (its message), and the server never sees them. Before, the proxy passed a call on from its headers: one
    such call with the token held the one slot until the server's body_timeout_s (10 s), and 8 held all 8 of the
    deployment's (the authorised client refused RESOURCE_EXHAUSTED meanwhile)."""
    with edge(server, MODEL_CALLS=1) as front:
        before = calls(server, "grpc")
        withheld = HalfOpen(front.port, CLASSIFY, 4, metadata=AUTH if token else [], source=ATTACKER)
        try:
            assert withheld.ping(), "the proxy did not answer"  # it has read the 4 calls' headers
            for _ in range(3):
                served(front.port)
            assert withheld.wait(lambda: withheld.open_count == 0, WAIT), "the withheld calls were kept"
            assert set(withheld.ended.values()) == {CANCELLED}, withheld.ended
            assert all("(proxy)" in withheld.messages[sid] for sid in withheld.streams), withheld.messages
        finally:
            withheld.close()
        assert calls(server, "grpc") - before == 3


@pytest.mark.parametrize("token", [True, False], ids=["with the token", "without"])
def test_an_http_call_withholding_its_body_never_takes_a_model_slot(server: SentimentServer, token: bool) -> None:
    """The same on the HTTP port: 11 of 100 announced bytes, then nothing: the authorised client's calls are served
    with MODEL_CALLS 1; the proxy answers 408 CANCELLED in the server's JSON shape (and, CLIENT_TIMEOUT 1s, closes
    the connection its client keeps silent); the server never sees the call."""
    with edge(server, MODEL_CALLS=1, CLIENT_TIMEOUT="1s") as front:
        before = calls(server, "http")
        head = ["POST /v1/classify HTTP/1.1", "Host: x", "Content-Type: application/json", "Content-Length: 100",
                *([f"Authorization: Bearer {TOKEN}"] if token else [])]
        with socket.create_connection(("127.0.0.1", front.http_port), timeout=WAIT,
                                      source_address=(ATTACKER, 0)) as s:
            s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + b'{"texts": [')
            for _ in range(3):
                assert classify(front.http_port, ["prêt"], HTTP_AUTH).status == 200
            reply = closed_by_peer(s)
        assert reply.startswith(b"HTTP/1.1 408 ") and b'"code": "CANCELLED"' in reply and b"(proxy)" in reply, reply
        assert calls(server, "http") - before == 3


def test_answers_a_client_never_reads_are_dropped_with_their_streams(server: SentimentServer) -> None:
    """CLIENT_TIMEOUT 1s: 3 authorised calls on a connection whose window is 0 (no answer can leave): the server
    answers each (its answers' budget is not held), the proxy holds the answers and, the client silent, resets the
    streams; the authorised client is served. Before, they were held for 300 s."""
    with edge(server, CLIENT_TIMEOUT="1s") as front:
        answered = server.metrics.requests.labels("grpc", CLASSIFY.lstrip("/"), "OK")._value.get()
        unread = Unread(front.port, source=ATTACKER)
        try:
            sids = [unread.call(CLASSIFY, pb.ClassifyRequest(texts=["jamais lu"]).SerializeToString(), AUTH)
                    for _ in range(3)]
            assert unread.wait(lambda: all(sid in unread.ended for sid in sids) or unread.closed.is_set(), WAIT), \
                "the unread answers were kept"
            assert all(unread.ended.get(sid, "").startswith("RST") for sid in sids) or unread.closed.is_set()
        finally:
            unread.close()
        assert server.metrics.requests.labels("grpc", CLASSIFY.lstrip("/"), "OK")._value.get() - answered == 3
        assert server.admission.answer_bytes == 0
        served(front.port)


def test_an_answer_its_client_never_reads_gives_its_model_slot_back(server: SentimentServer) -> None:
    """MODEL_CALLS 1: an authorised call from 127.0.0.2 on a connection whose window is 0, answered by the server: its
    slot is free again though the proxy still holds the answer, and the authorised client's calls are served. Before,
    the proxy counted a call's slot until its client had read the answer: the unread one held the only slot for
    CLIENT_TIMEOUT, and the authorised client was refused RESOURCE_EXHAUSTED meanwhile (bench/protocol_attacks.py's
    zero-window: the server alone answered every call)."""
    with edge(server, MODEL_CALLS=1, CLIENT_TIMEOUT="60s") as front:
        answered = server.metrics.requests.labels("grpc", CLASSIFY.lstrip("/"), "OK")._value.get()
        unread = Unread(front.port, source=ATTACKER)
        try:
            sid = unread.call(CLASSIFY, pb.ClassifyRequest(texts=["jamais lu"]).SerializeToString(), AUTH)
            wait_until(lambda: server.metrics.requests.labels("grpc", CLASSIFY.lstrip("/"), "OK")._value.get()
                       - answered == 1, WAIT, "the server's answer to the unread call")
            wait_until(lambda: served_or_refused(front.port), WAIT, "the slot given back")  # the proxy saw the answer
            assert sid not in unread.ended and not unread.closed.is_set(), "the unread answer was dropped"
            for _ in range(3):
                served(front.port)
        finally:
            unread.close()


def test_a_large_body_passes_the_proxys_wait(server: SentimentServer) -> None:
    """The wait for the body ends when HAProxy's buffer (16 KB) is full: a call of 800 KB, more than the buffer, is
    passed on and answered (its slot taken once the buffer is full, the rest streamed to the server)."""
    with edge(server, MODEL_CALLS=1) as front, grpc.insecure_channel(f"127.0.0.1:{front.port}") as channel:
        request = pb.ClassifyRequest(texts=["mot " * 5000] * 40)
        assert len(request.SerializeToString()) > 800_000
        answer = pb_grpc.SentimentServiceStub(channel).Classify(request, timeout=60, metadata=AUTH)
        assert len(answer.results) == 40
