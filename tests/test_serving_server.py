"""The real server on 127.0.0.1 (in-process, any free port) with the tiny exported bundle, through both protocols.

Served answers equal the in-process predictor's, batching is real, every bad input gets its precise code and the
server keeps serving, overload refuses quickly while accepted requests are right, health, reflection, metrics.
Bearer token, TLS and mutual TLS: tests/test_reliability_security.py; hostile clients: test_reliability_attacks.py.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from serving_fixtures import HeldRuns, reviews, running_server, target, wait_until

from serving.client import SentimentClient
from serving.config import ServerConfig
from serving.gen.inference import grpc_service_pb2 as kpb
from serving.gen.inference import grpc_service_pb2_grpc as kpb_grpc
from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.model.predictor import Predictor
from serving.process.app import SentimentServer
from serving.protocols.kserve_v2 import decode_bytes, encode_bytes

MAX_MESSAGE = 64 * 1024
MAX_CHARS = 5000


@pytest.fixture(scope="module")
def server(tiny_bundle: Path):
    with running_server(tiny_bundle, device="cpu", intra_op_threads=1, max_message_bytes=MAX_MESSAGE,
                        max_chars=MAX_CHARS, max_texts=16, metrics_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def channel(server: SentimentServer):
    with grpc.insecure_channel(target(server)) as ch:
        yield ch


def infer_request(texts: list[str], model: str = "sentiment", raw: bool = True, **tensor) -> kpb.ModelInferRequest:
    req = kpb.ModelInferRequest(model_name=model, id="req-1")
    t = req.inputs.add(name="TEXT", datatype="BYTES", shape=[len(texts)])
    data = [s.encode("utf-8") for s in texts]
    if raw:
        req.raw_input_contents.append(encode_bytes(data))
    else:
        t.contents.bytes_contents.extend(data)
    for key, value in tensor.items():
        if key == "shape":
            del t.shape[:]
            t.shape.extend(value)
        else:
            setattr(t, key, value)
    return req


def outputs_of(response: kpb.ModelInferResponse) -> dict[str, np.ndarray | list[bytes]]:
    out = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        n = tensor.shape[0]
        if tensor.datatype == "BYTES":
            out[tensor.name] = decode_bytes(raw, n)
        else:
            dtype = {"FP32": "<f4", "INT32": "<i4", "BOOL": np.bool_}[tensor.datatype]
            out[tensor.name] = np.frombuffer(raw, dtype=dtype).reshape(list(tensor.shape))
    return out


# ------------------------------------------------------------------------------------- served == in-process


def test_classify_equals_the_in_process_predictor(server: SentimentServer, reference: Predictor,
                                                  data_dir: Path) -> None:
    texts = reviews(data_dir, 12) + ["Bien.", "Pas terrible, je me suis ennuyé.", "é" * 3]
    with SentimentClient(target(server)) as client:
        served = client.classify(texts)
    for s, r in zip(served, reference.predict(texts), strict=True):
        assert (s.label, s.label_index, s.token_count, s.truncated) == (r.label, r.label_index, r.token_count,
                                                                       r.truncated)
        np.testing.assert_allclose(s.probabilities, r.probabilities, atol=1e-5)
    assert any(s.truncated for s in served) and not all(s.truncated for s in served)


@pytest.mark.parametrize("raw", [True, False], ids=["raw_input_contents", "bytes_contents"])
def test_kserve_infer_equals_the_in_process_predictor(channel: grpc.Channel, reference: Predictor,
                                                      data_dir: Path, raw: bool) -> None:
    texts = reviews(data_dir, 5) + ["Superbe !", "Nul."]
    response = kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(infer_request(texts, raw=raw), timeout=10)
    assert (response.model_name, response.model_version, response.id) == ("sentiment", "1", "req-1")
    out = outputs_of(response)
    ref = reference.predict(texts)
    np.testing.assert_allclose(out["probabilities"], np.stack([r.probabilities for r in ref]), atol=1e-5)
    assert out["label"] == [r.label.encode() for r in ref]
    assert out["token_count"].tolist() == [r.token_count for r in ref]
    assert out["truncated"].tolist() == [r.truncated for r in ref]


def test_kserve_returns_only_the_requested_outputs_in_order(channel: grpc.Channel) -> None:
    req = infer_request(["Un bon livre."], shape=[1, 1])
    req.outputs.add(name="label")
    req.outputs.add(name="probabilities")
    response = kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=10)
    assert [o.name for o in response.outputs] == ["label", "probabilities"]
    assert list(response.outputs[1].shape) == [1, 2]


def test_kserve_health_and_metadata(channel: grpc.Channel, server: SentimentServer) -> None:
    stub = kpb_grpc.GRPCInferenceServiceStub(channel)
    assert stub.ServerLive(kpb.ServerLiveRequest()).live
    assert stub.ServerReady(kpb.ServerReadyRequest()).ready
    assert stub.ModelReady(kpb.ModelReadyRequest(name="sentiment")).ready
    assert stub.ModelReady(kpb.ModelReadyRequest(name="sentiment", version="1")).ready
    assert stub.ServerMetadata(kpb.ServerMetadataRequest()).name == "sentiment-server"
    meta = stub.ModelMetadata(kpb.ModelMetadataRequest(name="sentiment"))
    assert meta.platform == "onnxruntime_onnx" and list(meta.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("TEXT", "BYTES", [-1])]
    assert ("probabilities", "FP32", [-1, 2]) in [(t.name, t.datatype, list(t.shape)) for t in meta.outputs]


def test_sentiment_metadata(server: SentimentServer) -> None:
    with SentimentClient(target(server)) as client:
        meta = client.metadata()
    p = server.core.predictor
    assert meta["label_names"] == p.label_names and meta["max_tokens"] == p.max_len
    assert meta["bundle_sha256"] == p.bundle_sha256 and len(meta["bundle_sha256"]) == 64
    assert meta["execution_provider"] == p.session.get_providers()[0]
    assert (meta["max_texts"], meta["max_chars"]) == (16, MAX_CHARS)
    assert meta["long_text_policy"] == "LONG_TEXT_POLICY_TRUNCATE"


def test_concurrent_requests_share_onnxruntime_runs(server: SentimentServer, reference: Predictor,
                                                    data_dir: Path) -> None:
    """16 requests that wait together are answered by fewer onnxruntime runs than requests.

    Both batch workers are held inside a run while the 16 requests queue, so the result does not depend on how
    fast client threads start: on a busy 2-core CI machine 16 threads once arrived one by one and each ran alone.
    """
    texts = reviews(data_dir, 16)
    workers = server.cfg.batch_workers
    with grpc.insecure_channel(target(server)) as channel, HeldRuns(server) as held:
        stub = pb_grpc.SentimentServiceStub(channel)
        blockers = []
        for _ in range(workers):  # one at a time, so that no worker takes two blockers in one batch
            blockers.append(stub.Classify.future(pb.ClassifyRequest(texts=["chauffe"]), timeout=60))
            assert held.wait_entered(), "a batch worker never started its run"
        futures = [stub.Classify.future(pb.ClassifyRequest(texts=[t]), timeout=60) for t in texts]
        wait_until(lambda: server.core.batcher.queued == len(texts), what=f"{len(texts)} texts queued")
        held.release()
        results = [f.result().results[0] for f in futures]
        for b in blockers:
            b.result()
    sizes = held.sizes[workers:]  # texts per run after the blockers
    assert sum(sizes) == len(texts) and len(sizes) < len(texts), sizes
    for got, ref in zip(results, reference.predict(texts), strict=True):
        np.testing.assert_allclose(got.probabilities, ref.probabilities, atol=1e-5)


# ------------------------------------------------------------------------------------- bad inputs


def _raw_classify(channel: grpc.Channel, payload: bytes) -> None:
    call = channel.unary_unary("/sentiment.v1.SentimentService/Classify", request_serializer=None,
                               response_deserializer=pb.ClassifyResponse.FromString)
    call(payload, timeout=10)


def _bad_cases() -> dict[str, tuple[Callable[[grpc.Channel], object], grpc.StatusCode, str]]:
    S = lambda ch: pb_grpc.SentimentServiceStub(ch)  # noqa: E731
    K = lambda ch: kpb_grpc.GRPCInferenceServiceStub(ch)  # noqa: E731
    classify = lambda texts: lambda ch: S(ch).Classify(pb.ClassifyRequest(texts=texts), timeout=10)  # noqa: E731
    infer = lambda req: lambda ch: K(ch).ModelInfer(req, timeout=10)  # noqa: E731
    INVALID, bad_utf8 = grpc.StatusCode.INVALID_ARGUMENT, b"caf\xc3"
    broken_raw = infer_request(["abc"])
    broken_raw.raw_input_contents[0] = b"\x09\x00\x00\x00abc"
    utf8_req = infer_request(["x"])
    utf8_req.raw_input_contents[0] = encode_bytes([bad_utf8])
    unknown_output = infer_request(["x"])
    unknown_output.outputs.add(name="logits")
    twice = infer_request(["x"])
    for name in ("label", "probabilities", "label"):
        twice.outputs.add(name=name)
    many = infer_request(["x"])  # counted without reading the entries (each read is a Python object)
    for _ in range(3000):
        many.outputs.add(name="probabilities")
    return {
        "empty list": (classify([]), INVALID, "empty list"),
        "empty text": (classify(["ok", ""]), INVALID, "texts[1]: empty"),
        "blank text": (classify([" \n\t "]), INVALID, "texts[0]: empty or blank"),
        "text over max_chars": (classify(["a" * (MAX_CHARS + 1)]), INVALID, f"max_chars={MAX_CHARS}"),
        "too many texts": (classify(["a"] * 17), INVALID, "17 texts > max_texts=16"),
        "message over the size limit": (classify(["a " * MAX_MESSAGE]), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
        "invalid UTF-8 in a proto string": (lambda ch: _raw_classify(ch, b"\x0a\x04" + bad_utf8), INVALID,
                                            "does not parse"),
        "kserve invalid UTF-8": (infer(utf8_req), INVALID, "element 0 is not valid UTF-8"),
        "kserve wrong datatype": (infer(infer_request(["x"], datatype="FP32")), INVALID, "datatype must be BYTES"),
        "kserve wrong shape": (infer(infer_request(["x"], shape=[1, 2])), INVALID, "shape must be [n] or [n, 1]"),
        "kserve count mismatch": (infer(infer_request(["x", "y"], raw=False, shape=[3])), INVALID, "holds 3"),
        "kserve broken framing": (infer(broken_raw), INVALID, "declares 9 bytes"),
        "kserve wrong input name": (infer(infer_request(["x"], name="INPUT0")), INVALID, "named 'TEXT'"),
        "kserve unknown output": (infer(unknown_output), INVALID, "unknown output 'logits'"),
        "kserve output requested twice": (infer(twice), INVALID, "outputs ['label'] requested more than once"),
        "kserve 3,000 outputs": (infer(many), INVALID, "3000 outputs requested; the model has 4"),
        "zero-width space alone": (classify(["ok", "\u200b"]), INVALID, "texts[1]: no letter or digit"),
        "byte-order mark alone": (classify(["\ufeff"]), INVALID, "texts[0]: no letter or digit"),
        "kserve zero-width space alone": (infer(infer_request(["\u200b\u200b"])), INVALID,
                                          "texts[0]: no letter or digit"),
        "kserve byte-order mark alone": (infer(infer_request(["ok", "\ufeff"])), INVALID,
                                         "texts[1]: no letter or digit"),
        "NUL bytes alone": (classify(["Bien.", "\x00\x00\x00"]), INVALID, "texts[1]: no letter or digit"),
        "control characters alone": (classify(["\x01\x1b\x7f\x08"]), INVALID, "texts[0]: no letter or digit"),
        "punctuation alone": (classify(["?!... --"]), INVALID, "texts[0]: no letter or digit"),
        "emoji alone": (classify(["\U0001f44d\U0001f3fd\U0001f468\u200d\U0001f469"]), INVALID,
                        "texts[0]: no letter or digit"),
        "kserve NUL bytes alone": (infer(infer_request(["\x00"])), INVALID, "texts[0]: no letter or digit"),
        "kserve empty tensor": (infer(infer_request([])), INVALID, "empty list"),
        "kserve unknown model": (infer(infer_request(["x"], model="resnet")), grpc.StatusCode.NOT_FOUND,
                                 "unknown model 'resnet'"),
        "kserve unknown version": (lambda ch: K(ch).ModelReady(kpb.ModelReadyRequest(name="sentiment",
                                                                                     version="7")),
                                   grpc.StatusCode.NOT_FOUND, "no version '7'"),
        "unimplemented Triton rpc": (lambda ch: ch.unary_unary("/inference.GRPCInferenceService/ModelStatistics")(
            b"", timeout=10), grpc.StatusCode.UNIMPLEMENTED, ""),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_input_gets_its_precise_code_and_the_server_keeps_serving(server: SentimentServer, channel: grpc.Channel,
                                                                      case: str) -> None:
    call, code, message = _bad_cases()[case]
    runs = server.core.predictor.runs
    with pytest.raises(grpc.RpcError) as info:
        call(channel)
    assert info.value.code() == code, info.value.details()
    assert message in (info.value.details() or "")
    assert server.core.predictor.runs == runs  # refused before anything was computed
    ok = pb_grpc.SentimentServiceStub(channel).Classify(pb.ClassifyRequest(texts=["Très bon livre."]), timeout=10)
    assert len(ok.results) == 1 and abs(sum(ok.results[0].probabilities) - 1) < 1e-5


def test_expired_requests_are_dropped_before_compute(tiny_bundle: Path) -> None:
    """A request whose deadline passes while it waits in the queue gets DEADLINE_EXCEEDED and is never run."""
    with running_server(tiny_bundle, device="cpu", batch_workers=1) as s:
        stub = pb_grpc.SentimentServiceStub(grpc.insecure_channel(target(s)))
        stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10)
        with HeldRuns(s) as held:
            blocker = stub.Classify.future(pb.ClassifyRequest(texts=["devant"]), timeout=20)
            assert held.wait_entered(10)
            # A deadline long enough for the call to reach the queue on a loaded machine (one that expired before
            # its handler ran was never queued, and so never dropped there), short enough for the test
            expiring = stub.Classify.future(pb.ClassifyRequest(texts=["expire", "aussi"]), timeout=5)
            wait_until(lambda: s.core.batcher.queued == 2, 5, "the 2 texts queued behind the held run")
            with pytest.raises(grpc.RpcError) as info:
                expiring.result()
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            held.release()
            blocker.result()
            assert len(stub.Classify(pb.ClassifyRequest(texts=["après"]), timeout=10).results) == 1
        assert held.sizes == [1, 1]  # the blocker and the last request ran; the 2 expired texts never did
        # dropped as expired, or as cancelled when gRPC ended the call a moment before the deadline the server read
        dropped = [s.metrics.registry.get_sample_value("sentiment_dropped_texts_total",
                                                         {"model": "sentiment", "version": "1", "reason": reason}) or 0
                   for reason in ("DeadlineExpired", "Cancelled")]
        assert sum(dropped) == 2, dropped


def test_long_texts_are_refused_when_configured(tiny_bundle: Path) -> None:
    with running_server(tiny_bundle, device="cpu", long_text="refuse") as s, SentimentClient(target(s)) as c:
        assert c.metadata()["long_text_policy"] == "LONG_TEXT_POLICY_REFUSE"
        with pytest.raises(grpc.RpcError) as info:
            c.classify(["court", "un texte bien trop long " * 30])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "texts[1]" in info.value.details() and "long_text=refuse" in info.value.details()
        assert c.classify(["court"])[0].truncated is False


# ------------------------------------------------------------------------------------- overload


def test_overload_refuses_at_once_and_accepted_requests_are_correct(tiny_bundle: Path,
                                                                    reference: Predictor) -> None:
    """The worker is held inside its first run (a gate around the real predictor) while 40 callers arrive:
    the queue (8 texts) fills, the rest get RESOURCE_EXHAUSTED at once, then every accepted caller is right."""
    with running_server(tiny_bundle, device="cpu", max_queue=8, max_texts=2, batch_workers=1) as s:
        held = HeldRuns(s)
        stub = pb_grpc.SentimentServiceStub(grpc.insecure_channel(target(s)))
        first = stub.Classify.future(pb.ClassifyRequest(texts=["premier"]), timeout=20)
        assert held.wait_entered(10)
        texts = [f"Avis numéro {i} : plutôt bien." for i in range(40)]
        outcomes: list[tuple[str, object, float]] = [None] * len(texts)

        def call(i: int) -> None:
            start = time.perf_counter()
            try:
                r = stub.Classify(pb.ClassifyRequest(texts=[texts[i]]), timeout=20).results[0]
                outcomes[i] = ("OK", r, time.perf_counter() - start)
            except grpc.RpcError as e:
                outcomes[i] = (e.code().name, e.details(), time.perf_counter() - start)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(texts))]
        for t in threads:
            t.start()
        # The refusals arrive while the worker is still held.
        wait_until(lambda: sum(o is not None for o in outcomes) >= len(texts) - 8, what="32 refusals")
        refused_while_held = [o for o in outcomes if o is not None and o[0] == "RESOURCE_EXHAUSTED"]
        held.release()
        for t in threads:
            t.join()
        first.result()
    codes = [o[0] for o in outcomes]
    assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"} and codes.count("OK") == 8
    assert len(refused_while_held) == len(texts) - 8  # refused at once, not after the queue moved
    assert max(o[2] for o in refused_while_held) < 5
    for (code, result, _), text in zip(outcomes, texts, strict=True):
        if code == "OK":
            np.testing.assert_allclose(result.probabilities, reference.predict([text])[0].probabilities, atol=1e-5)


# ------------------------------------------------------------------------------------- health, reflection, metrics


def test_health_reflection_and_metrics(server: SentimentServer, channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "sentiment.v1.SentimentService", "inference.GRPCInferenceService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"sentiment.v1.SentimentService", "inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services

    stub = pb_grpc.SentimentServiceStub(channel)
    stub.Classify(pb.ClassifyRequest(texts=["Un plaisir."]), timeout=10)
    with pytest.raises(grpc.RpcError):
        stub.Classify(pb.ClassifyRequest(texts=[]), timeout=10)
    with pytest.raises(grpc.RpcError) as info:  # health sets this code without raising: counted as sent
        health.Check(health_pb2.HealthCheckRequest(service="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    page = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    assert 'sentiment_requests_total{code="OK",method="sentiment.v1.SentimentService/Classify",protocol="grpc"}' in page
    assert ('sentiment_requests_total{code="INVALID_ARGUMENT",method="sentiment.v1.SentimentService/Classify",'
            'protocol="grpc"}') in page
    assert 'sentiment_requests_total{code="NOT_FOUND",method="grpc.health.v1.Health/Check",protocol="grpc"} 1.0' in page
    for name in ("sentiment_queue_seconds_bucket", "sentiment_batch_size_bucket", "sentiment_inference_seconds_sum",
                 "sentiment_request_seconds_count", "sentiment_queue_depth", "sentiment_response_bytes_in_flight",
                 "process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        assert name in page


# ------------------------------------------------------------------------------------- client


def test_client_retries_unavailable_until_the_server_is_up(tiny_bundle: Path) -> None:
    """The server starts only once the client's channel has failed to connect (its first attempt was refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started: list[SentimentServer] = []
    failed_once = threading.Event()

    def start_late() -> None:
        assert failed_once.wait(20), "the client never tried to connect"
        started.append(SentimentServer(tiny_bundle, ServerConfig(port=port, device="cpu")).start())

    late = threading.Thread(target=start_late)
    try:
        with SentimentClient(f"127.0.0.1:{port}", timeout=20, retries=8, backoff=0.1) as client:
            client.channel.subscribe(lambda state: state == grpc.ChannelConnectivity.TRANSIENT_FAILURE
                                     and failed_once.set())
            late.start()
            assert len(client.classify(["Enfin !"])) == 1
    finally:
        if late.is_alive() or late.ident is not None:
            late.join()
        for s in started:
            s.stop(grace=1)
    with SentimentClient(f"127.0.0.1:{port}", timeout=5, retries=2, backoff=0.2) as client:
        start = time.perf_counter()
        with pytest.raises(grpc.RpcError) as info:
            client.classify(["personne"])
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.perf_counter() - start >= 0.2 * 0.5 + 0.4 * 0.5  # two backoffs, jitter >= 0.5x


# ------------------------------------------------------------------------------------- shutdown


def test_stop_reports_not_serving_serves_through_the_drain_delay_and_finishes_in_flight(tiny_bundle: Path) -> None:
    """stop() = what SIGTERM does: health NOT_SERVING and KServe not ready at once, requests still served during
    drain_delay_s, then new ones refused while a request held inside onnxruntime still completes."""
    drain = 2.0  # long enough that a loaded CI machine still sends the in-delay request inside it
    with running_server(tiny_bundle, device="cpu", drain_delay_s=drain, batch_workers=1) as s:
        ch = grpc.insecure_channel(target(s))
        stub, health = pb_grpc.SentimentServiceStub(ch), health_pb2_grpc.HealthStub(ch)
        kstub = kpb_grpc.GRPCInferenceServiceStub(ch)
        stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10)
        held = HeldRuns(s)
        in_flight = stub.Classify.future(pb.ClassifyRequest(texts=["en cours"]), timeout=20)
        assert held.wait_entered(10)
        stopper = threading.Thread(target=s.stop)
        stopping = time.monotonic()
        stopper.start()
        wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status ==
                   health_pb2.HealthCheckResponse.NOT_SERVING, what="health NOT_SERVING")
        assert time.monotonic() - stopping < drain / 2, "health still SERVING well into the drain delay"
        assert not kstub.ServerReady(kpb.ServerReadyRequest(), timeout=5).ready
        held.stop_holding()
        late_but_served = stub.Classify.future(pb.ClassifyRequest(texts=["pendant le délai"]), timeout=20)
        assert time.monotonic() - stopping < drain, "the in-delay request was sent too late to prove anything"

        def refused() -> bool:  # an empty request (nothing to compute): INVALID_ARGUMENT while accepted
            with pytest.raises(grpc.RpcError) as info:
                stub.Classify(pb.ClassifyRequest(texts=[]), timeout=5)
            return info.value.code() == grpc.StatusCode.UNAVAILABLE

        wait_until(refused, what="new requests refused")
        assert time.monotonic() - stopping >= drain, "refused before the drain delay was over"
        with pytest.raises(grpc.RpcError) as info:
            stub.Classify(pb.ClassifyRequest(texts=["trop tard"]), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        held.release()
        assert len(in_flight.result().results) == 1
        assert len(late_but_served.result().results) == 1
        stopper.join(20)
        assert not stopper.is_alive()
