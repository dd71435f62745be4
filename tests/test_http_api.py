"""The HTTP API of the real server (in-process, 127.0.0.1, the tiny exported bundle) beside its gRPC API: the same
answers as the in-process predictor and as gRPC, texts of both protocols in one batch, every refusal's status and
code, the token, TLS and mutual TLS, deadlines, metrics with their protocol label, readiness and the drain, and
--workers (a real process). Hostile clients: tests/test_http_hostile.py; the OpenAPI document: test_http_openapi.py.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import json_format
from http_fixtures import call, classify, infer_body
from serving_fixtures import HeldRuns, ServerProcess, certs, reviews, running_server, target, wait_until

from serving.gen.inference import grpc_service_pb2 as kpb
from serving.gen.inference import grpc_service_pb2_grpc as kpb_grpc
from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.model.predictor import Predictor
from serving.process.app import SentimentServer
from serving.protocols.http.exchange import OFFLOAD_CHARS
from serving.protocols.kserve_v2 import decode_bytes, encode_bytes
from serving.telemetry import call_log

__all__ = ["certs"]
TOKEN = "http-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_MESSAGE = 64 * 1024


@pytest.fixture(scope="module")
def server(tiny_bundle: Path):
    with running_server(tiny_bundle, device="cpu", http_port=0, auth_token=TOKEN, max_texts=16, max_chars=5000,
                        max_message_bytes=MAX_MESSAGE, batch_workers=1) as s:
        yield s


@pytest.fixture(scope="module")
def channel(server: SentimentServer):
    with grpc.insecure_channel(target(server)) as ch:
        yield ch


META = [("authorization", f"Bearer {TOKEN}")]


# ------------------------------------------------------------------------------------- the same answers


def test_classify_equals_the_predictor_and_the_grpc_answer(server: SentimentServer, channel: grpc.Channel,
                                                          reference: Predictor, data_dir: Path) -> None:
    texts = reviews(data_dir, 10) + ["Bien.", "é" * 3]
    reply = classify(server.http_port, texts, AUTH)
    assert reply.status == 200 and reply.headers["content-type"] == "application/json"
    got = reply.json["results"]
    for g, r in zip(got, reference.predict(texts), strict=True):
        assert (g["label"], g["label_index"], g["token_count"], g["truncated"]) == (r.label, r.label_index,
                                                                                   r.token_count, r.truncated)
        np.testing.assert_allclose(g["probabilities"], r.probabilities, atol=1e-6)
    grpc_answer = pb_grpc.SentimentServiceStub(channel).Classify(pb.ClassifyRequest(texts=texts), metadata=META)
    # the gRPC message's fields, named as in the proto (its JSON mapping), hold the HTTP answer's values
    as_json = json_format.MessageToDict(grpc_answer, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
    assert [set(r) for r in as_json["results"]] == [set(r) for r in got]
    assert [r["label"] for r in as_json["results"]] == [r["label"] for r in got]
    assert any(r["truncated"] for r in got)


def test_metadata_is_the_grpc_answer_as_json(server: SentimentServer, channel: grpc.Channel) -> None:
    reply = call(server.http_port, "GET", "/v1/metadata", headers=AUTH)
    grpc_answer = pb_grpc.SentimentServiceStub(channel).GetModelMetadata(pb.GetModelMetadataRequest(), metadata=META)
    assert reply.status == 200
    assert reply.json == json_format.MessageToDict(grpc_answer, preserving_proto_field_name=True,
                                                   always_print_fields_with_no_presence=True)
    assert reply.json["max_texts"] == 16 and reply.json["labels"] == ["negative", "positive"]


def _grpc_infer(channel: grpc.Channel, texts: list[str]) -> dict:
    req = kpb.ModelInferRequest(model_name="sentiment", id="r1")
    req.inputs.add(name="TEXT", datatype="BYTES", shape=[len(texts)])
    req.raw_input_contents.append(encode_bytes([t.encode() for t in texts]))
    response = kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, metadata=META, timeout=10)
    out = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        if tensor.datatype == "BYTES":
            out[tensor.name] = (tensor.datatype, list(tensor.shape), [b.decode() for b in decode_bytes(raw, 2)])
        else:
            dtype = {"FP32": "<f4", "INT32": "<i4", "BOOL": np.bool_}[tensor.datatype]
            out[tensor.name] = (tensor.datatype, list(tensor.shape), np.frombuffer(raw, dtype).reshape(-1).tolist())
    return out


@pytest.mark.parametrize("path", ["/v2/models/sentiment/infer", "/v2/models/sentiment/versions/1/infer"])
def test_kserve_rest_infer_gives_the_grpc_outputs(server: SentimentServer, channel: grpc.Channel, path: str) -> None:
    texts = ["Un très beau livre.", "Décevant."]
    reply = call(server.http_port, "POST", path, infer_body(texts, id="r1"), AUTH)
    assert reply.status == 200, reply.body
    doc = reply.json
    assert (doc["model_name"], doc["model_version"], doc["id"]) == ("sentiment", "1", "r1")
    rest = {o["name"]: (o["datatype"], o["shape"], o["data"]) for o in doc["outputs"]}
    grpc_out = _grpc_infer(channel, texts)
    assert list(rest) == list(grpc_out) == ["probabilities", "label", "token_count", "truncated"]
    for name, (datatype, shape, data) in grpc_out.items():
        assert rest[name][:2] == (datatype, shape)
        if datatype == "FP32":
            np.testing.assert_allclose(rest[name][2], data, atol=1e-6)
        else:
            assert rest[name][2] == data


def test_kserve_rest_binary_tensors_both_ways(server: SentimentServer, reference: Predictor) -> None:
    texts = ["Superbe !", "Nul, nul, nul."]
    raw = encode_bytes([t.encode() for t in texts])
    head = json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2, 1],
                                   "parameters": {"binary_data_size": len(raw)}}],
                       "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}},
                                   {"name": "label"}]}).encode()
    reply = call(server.http_port, "POST", "/v2/models/sentiment/infer", head + raw,
                 {**AUTH, "Inference-Header-Content-Length": str(len(head)),
                  "Content-Type": "application/octet-stream"})
    assert reply.status == 200, reply.body
    n = int(reply.headers["inference-header-content-length"])
    doc, tail = json.loads(reply.body[:n]), reply.body[n:]
    probs, label = doc["outputs"]
    assert probs["parameters"]["binary_data_size"] == len(tail) == 2 * 2 * 4 and "data" not in probs
    ref = reference.predict(texts)
    np.testing.assert_allclose(np.frombuffer(tail, "<f4").reshape(2, 2), np.stack([r.probabilities for r in ref]),
                               atol=1e-6)
    assert label["data"] == [r.label for r in ref]


def test_kserve_rest_health_and_metadata(server: SentimentServer) -> None:
    port = server.http_port
    assert call(port, "GET", "/v2/health/live").json == {"live": True}  # open, as grpc.health.v1 is
    assert call(port, "GET", "/v2/health/ready").json == {"ready": True}
    assert call(port, "GET", "/v2", headers=AUTH).json["name"] == "sentiment-server"
    for path in ("/v2/models/sentiment", "/v2/models/sentiment/versions/1"):
        meta = call(port, "GET", path, headers=AUTH).json
        assert meta["platform"] == "onnxruntime_onnx" and meta["outputs"][0]["shape"] == [-1, 2]
    assert call(port, "GET", "/v2/models/sentiment/ready", headers=AUTH).json["ready"] is True
    assert call(port, "GET", "/v2/models/sentiment/versions/2/ready", headers=AUTH).status == 404
    assert call(port, "HEAD", "/v2/health/live").body == b""


# ------------------------------------------------------------------------------------- one batcher for both


def test_an_http_text_and_a_grpc_text_share_a_batch(server: SentimentServer, channel: grpc.Channel,
                                                    reference: Predictor) -> None:
    stub = pb_grpc.SentimentServiceStub(channel)
    with HeldRuns(server) as held, ThreadPoolExecutor(3) as pool:
        first = pool.submit(stub.Classify, pb.ClassifyRequest(texts=["Le premier."]), metadata=META, timeout=30)
        assert held.wait_entered()  # the one batch worker holds its run: the next two texts queue together
        over_http = pool.submit(classify, server.http_port, ["Un livre superbe."], AUTH)
        over_grpc = pool.submit(stub.Classify, pb.ClassifyRequest(texts=["Un livre affreux."]), metadata=META,
                                timeout=30)
        wait_until(lambda: server.core.batcher.queued == 2, what="both texts queued")
        held.release()
        http_answer, grpc_answer = over_http.result(30).json["results"][0], over_grpc.result(30).results[0]
        first.result(30)
    assert held.sizes[:2] == [1, 2]  # the HTTP text and the gRPC text ran in one onnxruntime run
    ref = reference.predict(["Un livre superbe.", "Un livre affreux."])
    np.testing.assert_allclose(http_answer["probabilities"], ref[0].probabilities, atol=1e-6)
    np.testing.assert_allclose(grpc_answer.probabilities, ref[1].probabilities, atol=1e-6)


def test_a_deadline_header_drops_texts_still_queued(server: SentimentServer, channel: grpc.Channel) -> None:
    stub = pb_grpc.SentimentServiceStub(channel)
    with HeldRuns(server) as held, ThreadPoolExecutor(2) as pool:
        first = pool.submit(stub.Classify, pb.ClassifyRequest(texts=["Tenu."]), metadata=META, timeout=30)
        assert held.wait_entered()
        late = classify(server.http_port, ["Trop tard."], {**AUTH, "Request-Timeout-Ms": "150"})
        triton = call(server.http_port, "POST", "/v2/models/sentiment/infer",
                      infer_body(["Trop tard."], parameters={"timeout": 150_000}), AUTH)
        held.release()
        first.result(30)
    assert (late.status, late.json["code"]) == (504, "DEADLINE_EXCEEDED")
    assert (triton.status, triton.json["code"]) == (504, "DEADLINE_EXCEEDED")
    assert held.sizes == [1]  # neither late text was computed


@pytest.mark.parametrize("path", ["/v1/classify", "/v2/models/sentiment/infer"])
def test_a_long_call_is_tokenized_off_the_event_loop(tiny_bundle: Path, path: str) -> None:
    """Texts of more than OFFLOAD_CHARS characters in all are checked and tokenized in a thread: while that call's
    tokenizer is held, the loop answers other calls (it used to wait), and the call is still the one its telemetry
    counts texts for."""
    texts = [f"Critique numéro {i} : un roman dense, lourd au début, puis haletant. " * 3 for i in range(20)]
    assert sum(map(len, texts)) > OFFLOAD_CHARS
    with running_server(tiny_bundle, device="cpu", http_port=0, max_texts=64) as server, \
            ThreadPoolExecutor(1) as pool:
        predictor, entered, release, seen = server.core.predictor, threading.Event(), threading.Event(), []
        encode = predictor.encode

        def held(batch: list[str]) -> list:
            if len(batch) > 1:
                seen.append(call_log.current())
                entered.set()
                release.wait(30)
            return encode(batch)

        predictor.encode = held
        try:
            body = {"texts": texts} if path == "/v1/classify" else infer_body(texts)
            long = pool.submit(call, server.http_port, "POST", path, body)
            assert entered.wait(30)
            short = classify(server.http_port, ["Bien."], timeout=5)  # the loop is free meanwhile
            assert short.status == 200 and not long.done()
        finally:
            release.set()
        assert long.result(30).status == 200
    assert seen[0] is not None and seen[0].texts == len(texts)


# ------------------------------------------------------------------------------------- refusals


BAD_CLASSIFY = [
    ({"texts": []}, 400, "empty list"),
    ({"texts": ["a"] * 17}, 400, "max_texts=16"),
    ({"texts": ["x" * 5001]}, 400, "max_chars=5000"),
    ({"texts": ["   "]}, 400, "blank"),
    ({"texts": ["!!!"]}, 400, "no letter or digit"),
    ({"texts": [3]}, 400, "texts[0]: expected a string"),
    ({"text": ["a"]}, 400, 'expected {"texts"'),
    ({"texts": ["a"], "mode": "fast"}, 400, "unknown field 'mode'"),
    (b"{not json", 400, "not JSON"),
    (b"\xff\xfe", 400, "not UTF-8"),
    (b"[" * 50_000, 400, "nested too deeply"),
    (b'{"texts": ["\\ud800 lone half"]}', 400, "surrogate"),  # once a 500: sentencepiece cannot read it
    (b'{"texts": ["ok"], "x": NaN}', 400, "not JSON"),  # RFC 8259 has no NaN
]


@pytest.mark.parametrize("body,status,words", BAD_CLASSIFY)
def test_a_bad_classify_call_gets_400_naming_the_problem(server: SentimentServer, body, status: int,
                                                         words: str) -> None:
    reply = call(server.http_port, "POST", "/v1/classify", body, {**AUTH, "Content-Type": "application/json"})
    assert (reply.status, reply.json["code"]) == (status, "INVALID_ARGUMENT") and words in reply.json["error"]


BAD_INFER = [
    ("/v2/models/resnet/infer", infer_body(["a"]), 404, "NOT_FOUND", "unknown model 'resnet'"),
    ("/v2/models/sentiment/versions/7/infer", infer_body(["a"]), 404, "NOT_FOUND", "no version '7'"),
    ("/v2/models/sentiment/infer", {"inputs": [{"name": "TEXT", "datatype": "FP32", "shape": [1], "data": [1.0]}]},
     400, "INVALID_ARGUMENT", "datatype must be BYTES"),
    ("/v2/models/sentiment/infer", {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": ["a"]}]},
     400, "INVALID_ARGUMENT", "holds 2 texts, got 1"),
    ("/v2/models/sentiment/infer", {"inputs": [{"name": "X", "datatype": "BYTES", "shape": [1], "data": ["a"]}]},
     400, "INVALID_ARGUMENT", "exactly one input named 'TEXT'"),
    ("/v2/models/sentiment/infer", infer_body(["a"], outputs=[{"name": "logits"}]), 400, "INVALID_ARGUMENT",
     "unknown output 'logits'"),
    ("/v2/models/sentiment/infer", infer_body(["a"], outputs=[{"name": "label"}] * 2), 400, "INVALID_ARGUMENT",
     "more than once"),
    ("/v2/models/sentiment/infer", infer_body(["a"], outputs=[{"name": "label", "parameters": {"classification": 1}}]),
     400, "INVALID_ARGUMENT", "classification extension"),
    ("/v2/models/sentiment/infer", infer_body(["a"], parameters={"timeout": -1}), 400, "INVALID_ARGUMENT",
     "timeout"),
    ("/v2/models/sentiment/infer", [1, 2], 400, "INVALID_ARGUMENT", "expected a JSON object"),
    ("/v2/models/sentiment/infer", b'{"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": '
     b'["\\udc00"]}]}', 400, "INVALID_ARGUMENT", "surrogate"),
    ("/v2/models/sentiment/infer", infer_body(["a"]) | {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape":
     [[[[[[[1]]]]]]], "data": ["a"]}]}, 400, "INVALID_ARGUMENT", "got list at shape[0]"),
    ("/v2/models/sentiment/infer", b'{"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": ' + b"[" * 1000
     + b"]" * 1000 + b', "data": ["a"]}]}', 400, "INVALID_ARGUMENT", "got list at shape[0]"),  # repr: recursion
]


@pytest.mark.parametrize("path,body,status,code,words", BAD_INFER)
def test_a_bad_infer_call_gets_the_grpc_code_and_its_http_status(server: SentimentServer, path: str, body,
                                                                 status: int, code: str, words: str) -> None:
    reply = call(server.http_port, "POST", path, body, AUTH)
    assert (reply.status, reply.json["code"]) == (status, code) and words in reply.json["error"], reply.body


def test_refusals_of_the_http_layer(server: SentimentServer) -> None:
    port = server.http_port
    wrong_type = call(port, "POST", "/v1/classify", b'{"texts": ["a"]}', {**AUTH, "Content-Type": "text/plain"})
    assert wrong_type.status == 415 and "application/json" in wrong_type.json["error"]
    form = call(port, "POST", "/v1/classify", b"texts=a", {**AUTH, "Content-Type": "application/x-www-form-urlencoded"})
    assert form.status == 415
    gzip = call(port, "POST", "/v1/classify", b"\x1f\x8b", {**AUTH, "Content-Type": "application/json",
                                                          "Content-Encoding": "gzip"})
    assert gzip.status == 415
    big = call(port, "POST", "/v1/classify", {"texts": ["a" * MAX_MESSAGE]}, AUTH)
    assert (big.status, big.json["code"]) == (413, "RESOURCE_EXHAUSTED")
    assert "max_message_bytes" in big.json["error"] and big.headers["connection"] == "close"
    get = call(port, "GET", "/v1/classify", headers=AUTH)
    assert (get.status, get.json["code"], get.headers["allow"]) == (405, "UNIMPLEMENTED", "POST")
    assert call(port, "DELETE", "/v2/health/live").headers["allow"] == "GET, HEAD"
    missing = call(port, "GET", "/v3/models", headers=AUTH)
    assert (missing.status, missing.json["code"]) == (404, "NOT_FOUND")
    timeout = classify(port, ["a"], {**AUTH, "Request-Timeout-Ms": "soon"})
    assert timeout.status == 400 and "Request-Timeout-Ms" in timeout.json["error"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token-0123456789"},
                                     {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}])
def test_a_call_without_the_token_is_refused(server: SentimentServer, headers: dict[str, str]) -> None:
    before = server.core.batcher.metrics.texts._value.get()
    for method, path, body in (("POST", "/v1/classify", {"texts": ["a"]}), ("GET", "/v1/metadata", None),
                               ("POST", "/v2/models/sentiment/infer", infer_body(["a"])), ("GET", "/v2", None)):
        reply = call(server.http_port, method, path, body, headers)
        assert (reply.status, reply.json["code"]) == (401, "UNAUTHENTICATED")
        assert reply.headers["www-authenticate"].startswith("Bearer")
    assert server.core.batcher.metrics.texts._value.get() == before
    assert classify(server.http_port, ["a"], {"Authorization": f"bearer {TOKEN}"}).status == 200  # any case


def test_http_calls_are_counted_with_their_protocol(server: SentimentServer) -> None:
    registry = server.metrics.registry
    labels = {"protocol": "http", "method": "POST /v1/classify"}
    ok = registry.get_sample_value("sentiment_requests_total", {**labels, "code": "OK"}) or 0
    bad = registry.get_sample_value("sentiment_requests_total", {**labels, "code": "INVALID_ARGUMENT"}) or 0
    classify(server.http_port, ["Bon."], AUTH)
    classify(server.http_port, [], AUTH)
    call(server.http_port, "GET", "/no/such/thing")
    assert registry.get_sample_value("sentiment_requests_total", {**labels, "code": "OK"}) == ok + 1
    assert registry.get_sample_value("sentiment_requests_total", {**labels, "code": "INVALID_ARGUMENT"}) == bad + 1
    assert registry.get_sample_value("sentiment_requests_total", {"protocol": "http", "method": "unknown path",
                                                                  "code": "NOT_FOUND"}) >= 1
    assert registry.get_sample_value("sentiment_request_seconds_count", labels) >= 2


# ------------------------------------------------------------------------------------- TLS, overload, drain


def _tls(certs: dict[str, Path], client: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs["ca"]))
    if client:
        context.load_cert_chain(certs[client], certs[f"{client}_key"])
    return context


def test_tls_and_mutual_tls_from_the_grpc_ports_files(tiny_bundle: Path, certs: dict[str, Path]) -> None:
    files = {"tls_cert": str(certs["server"]), "tls_key": str(certs["server_key"])}
    with running_server(tiny_bundle, device="cpu", http_port=0, **files) as s:
        assert classify(s.http_port, ["Bon."], tls=_tls(certs)).status == 200
        with pytest.raises((http.client.HTTPException, ConnectionError)):  # plain text on the TLS port
            classify(s.http_port, ["Bon."], timeout=5)
    with running_server(tiny_bundle, device="cpu", http_port=0, tls_client_ca=str(certs["ca"]), **files) as s:
        assert classify(s.http_port, ["Bon."], tls=_tls(certs, "client")).status == 200
        for who in (None, "rogue_client", "expired_client"):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                classify(s.http_port, ["Bon."], tls=_tls(certs, who), timeout=5)


def test_overload_is_refused_before_the_body_with_429(tiny_bundle: Path) -> None:
    with running_server(tiny_bundle, device="cpu", http_port=0, max_concurrent_rpcs=1, batch_workers=1) as s, \
            HeldRuns(s) as held, ThreadPoolExecutor(1) as pool:
        first = pool.submit(classify, s.http_port, ["Tenu."])
        assert held.wait_entered()  # its model slot is taken while its run is held
        # a second call announces a body it never sends: refused from its headers alone
        with socket.create_connection(("127.0.0.1", s.http_port), timeout=10) as sock:
            sock.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 60000\r\n\r\n")
            head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 429 ") and b"retry-after: 1" in head and b"connection: close" in head
        held.release()
        assert first.result(30).status == 200


def test_draining_says_not_ready_refuses_new_calls_and_finishes_accepted_ones(tiny_bundle: Path) -> None:
    s = SentimentServer(tiny_bundle, _cfg(http_port=0, batch_workers=1, grace_s=20)).start()
    held = HeldRuns(s)
    with ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(classify, s.http_port, ["Accepté."])
        assert held.wait_entered()
        stopping = threading.Thread(target=s.stop)
        stopping.start()
        wait_until(lambda: not s.core.ready, what="the drain")
        ready = call(s.http_port, "GET", "/v2/health/ready")
        assert (ready.status, ready.json) == (503, {"ready": False})
        refused = classify(s.http_port, ["Trop tard."])
        assert (refused.status, refused.json["code"]) == (503, "UNAVAILABLE") and refused.headers["retry-after"]
        held.release()
        assert accepted.result(30).status == 200
        stopping.join(30)
    assert not stopping.is_alive()


def _cfg(**options):
    from serving.config import ServerConfig

    return ServerConfig(port=0, device="cpu", **options)


def test_workers_share_the_http_port_and_drain_on_sigterm(tiny_bundle: Path) -> None:
    server = ServerProcess(tiny_bundle, "--workers", "2", "--http-port", "0", "--metrics-port", "0",
                           "--device", "cpu")
    try:
        server.wait_listening(90)
        assert server.http_port
        for i in range(6):  # a new connection each: the kernel spreads them over the workers
            assert classify(server.http_port, [f"Un livre {i}."]).status == 200
        wait_until(lambda: server.metric("sentiment_requests_total", {"protocol": "http", "method":
                                                                      "POST /v1/classify", "code": "OK"}) == 6,
                   what="six calls counted")
        assert server.stop() == 0
    finally:
        server.close()

