"""One admission, two protocols: the same call sent over gRPC and over HTTP to one real server on 127.0.0.1 gets the
same decision (serving/limits/admission.py), each in its own protocol's words: the gRPC code, and over HTTP the status
that serving/protocols/http/errors.py gives that code, with the code's name in the JSON body.

The cases: the token missing, wrong, or with the scheme in another case (served: RFC 6750 makes the scheme
case-insensitive, and RFC 7235 allows one space or more before the token), every model slot taken, the answers'
budget spent, a body that does not come within body_timeout_s.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from hostile import HalfOpen
from http_fixtures import classify, read_all
from serving_fixtures import HeldRuns, running_server, target, wait_until

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.process.app import SentimentServer
from serving.protocols.http.errors import STATUS

TOKEN = "admission-test-token-0123456789"
CLASSIFY = "/sentiment.v1.SentimentService/Classify"
BODY_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tiny_bundle: Path) -> Iterator[SentimentServer]:
    """One model slot and one batch worker, so that a held run holds every slot."""
    with running_server(tiny_bundle, device="cpu", http_port=0, auth_token=TOKEN, max_concurrent_rpcs=1,
                        batch_workers=1, body_timeout_s=BODY_TIMEOUT_S) as s:
        yield s


def _grpc(s: SentimentServer, authorization: str | None) -> str:
    """The code a Classify call with this `authorization` metadata (None: none) gets."""
    metadata = None if authorization is None else [("authorization", authorization)]
    with grpc.insecure_channel(target(s)) as channel:
        try:
            pb_grpc.SentimentServiceStub(channel).Classify(pb.ClassifyRequest(texts=["Un film."]), timeout=30,
                                                           metadata=metadata)
        except grpc.RpcError as e:
            return e.code().name
    return "OK"


def _http(s: SentimentServer, authorization: str | None) -> tuple[int, str]:
    """(status, code) of POST /v1/classify with this Authorization header (None: none)."""
    reply = classify(s.http_port, ["Un film."], {} if authorization is None else {"Authorization": authorization})
    return reply.status, "OK" if reply.status == 200 else reply.json["code"]


def _grpc_slow_body(s: SentimentServer) -> str:
    """The code of a call whose headers come and whose message never does."""
    late = HalfOpen(s.port, CLASSIFY, 1, metadata=[("authorization", f"Bearer {TOKEN}")])
    try:
        assert late.wait(lambda: late.open_count == 0, 10 + BODY_TIMEOUT_S), "the call waited past body_timeout_s"
        (status,) = late.ended.values()
    finally:
        late.close()
    return grpc.StatusCode.CANCELLED.name if status == str(grpc.StatusCode.CANCELLED.value[0]) else status


def _http_slow_body(s: SentimentServer) -> tuple[int, str]:
    """(status, code) of a call that sends 11 bytes of the 100 its Content-Length announces."""
    head = (f"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
            f"Authorization: Bearer {TOKEN}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", s.http_port), timeout=10) as sock:
        sock.sendall(head + b'{"texts": [')
        reply = read_all(sock, 10 + BODY_TIMEOUT_S)
    status = int(reply.split(b" ", 2)[1])
    body = reply.split(b"\r\n\r\n", 1)[1]
    return status, body.split(b'"code":"', 1)[1].split(b'"', 1)[0].decode()


@dataclass(frozen=True)
class Case:
    name: str
    authorization: str | None  # the header both protocols send
    code: str  # the decision: a gRPC code's name ("OK": served)


CASES = [
    Case("token missing", None, "UNAUTHENTICATED"),
    Case("token wrong", "Bearer wrong-token-0123456789abc", "UNAUTHENTICATED"),
    Case("token without its scheme", TOKEN, "UNAUTHENTICATED"),
    Case("no space after the scheme", f"Bearer{TOKEN}", "UNAUTHENTICATED"),
    Case("another scheme", f"Basic {TOKEN}", "UNAUTHENTICATED"),
    Case("the scheme in lower case", f"bearer {TOKEN}", "OK"),
    Case("the scheme in upper case, two spaces", f"BEARER  {TOKEN}", "OK"),
    Case("the token right", f"Bearer {TOKEN}", "OK"),
]


def _same_decision(case: Case, grpc_code: str, http: tuple[int, str]) -> None:
    want_status = 200 if case.code == "OK" else STATUS[case.code]
    assert grpc_code == case.code, f"{case.name}: gRPC said {grpc_code}"
    assert http == (want_status, case.code), f"{case.name}: HTTP said {http}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_token_is_one_rule_on_both_protocols(server: SentimentServer, case: Case) -> None:
    _same_decision(case, _grpc(server, case.authorization), _http(server, case.authorization))


def _under(s: SentimentServer, hold: Callable[[], Callable[[], None]], case: Case) -> None:
    """Both protocols asked while `hold()` holds the server in a state; its return value lets it go."""
    let_go = hold()
    try:
        _same_decision(case, _grpc(s, case.authorization), _http(s, case.authorization))
    finally:
        let_go()
    assert _grpc(s, case.authorization) == "OK" and _http(s, case.authorization) == (200, "OK")  # and after: served


def test_every_model_slot_taken_is_refused_alike(server: SentimentServer) -> None:
    """A call held inside its run holds the one model slot: the next call is refused from its headers alone."""
    with HeldRuns(server) as held, ThreadPoolExecutor(1) as pool:
        first = pool.submit(_grpc, server, f"Bearer {TOKEN}")
        assert held.wait_entered()
        wait_until(lambda: server.admission.in_progress == 1, what="the one model slot taken")
        _same_decision(Case("overload", f"Bearer {TOKEN}", "RESOURCE_EXHAUSTED"),
                       _grpc(server, f"Bearer {TOKEN}"), _http(server, f"Bearer {TOKEN}"))
        held.release()
        assert first.result(30) == "OK"


def test_the_answers_budget_spent_is_refused_alike(server: SentimentServer) -> None:
    """Answers that wait for their clients fill max_response_bytes_in_flight (held here through admission itself,
    as answers no client reads would hold it): a model call is refused before its body is read."""
    budget = server.cfg.max_response_bytes_in_flight

    def hold() -> Callable[[], None]:
        wait_until(lambda: server.admission.answer_bytes == 0, what="the answers of earlier calls delivered")
        server.admission.hold_answer(budget)
        return lambda: server.admission.answer_gone(budget)

    _under(server, hold, Case("budget spent", f"Bearer {TOKEN}", "RESOURCE_EXHAUSTED"))


def test_a_body_that_does_not_come_is_cancelled_alike(server: SentimentServer) -> None:
    """Headers and token right, the body never whole: the call ends after body_timeout_s, counted both times."""
    before = server.metrics.body_timeouts._value.get()
    grpc_code = _grpc_slow_body(server)
    # The client reads CANCELLED a moment before the server's thread gives its one model slot back: an HTTP call
    # sent in that moment was refused for want of a slot (429), once in CI.
    wait_until(lambda: server.admission.in_progress == 0, 10, what="the gRPC call's slot given back")
    _same_decision(Case("slow body", f"Bearer {TOKEN}", "CANCELLED"), grpc_code, _http_slow_body(server))
    assert server.metrics.body_timeouts._value.get() == before + 2
