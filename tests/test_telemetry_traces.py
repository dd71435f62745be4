"""Traces through a real server process, exported by the OpenTelemetry SDK to a real OTLP receiver
(tests/otlp_receiver.py) over gRPC and over HTTP/protobuf, as the standard OTEL_* variables say: the spans' parents,
links and attributes; the client's trace continued; two calls sharing one batch; --workers; sampling; bad variables.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import http_fixtures
import psutil
import pytest
from opentelemetry.sdk.trace import TracerProvider
from otlp_receiver import BATCH_PAIRS, OtlpReceiver, Span, paired_calls
from procs import REPO, free_port
from serving_fixtures import HeldRuns, ServerProcess, flood_and_one_more_are_refused, running_server, wait_until

from serving.client import SentimentClient
from serving.errors import ServerConfigError
from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.telemetry import call_log, otlp, tracing

CLASSIFY = "sentiment.v1.SentimentService/Classify"
TEXT = "Un roman lumineux, des personnages attachants."
TOKEN = "a-test-token-of-some-length"


def _tracer():
    """A tracer of this test process (its own provider, not the global one): the client's spans."""
    return TracerProvider().get_tracer("test-client")


def _server_spans(spans: list[Span], parents: set[str]) -> list[Span]:
    return [s for s in spans if s.name == CLASSIFY and s.parent_id in parents]


def test_spans_arrive_over_grpc_with_parents_links_and_attributes(tiny_bundle: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    with OtlpReceiver() as receiver:
        server = ServerProcess(tiny_bundle, "--device", "cpu", "--auth-token-file", str(token), *BATCH_PAIRS,
                               env=receiver.env("grpc"))
        try:
            port = server.wait_listening()
            for _ in range(3):  # a pair that missed one another (a loaded machine) is sent again
                contexts = paired_calls(f"127.0.0.1:{port}", TEXT, token=TOKEN)
                parents = {format(c.span_id, "016x") for c in contexts}
                calls = receiver.wait_for(lambda spans, p=parents: len(found := _server_spans(spans, p)) == 2 and found,
                                          what="both calls' server spans")
                ids = {c.span_id for c in calls}
                runs = receiver.wait_for(lambda spans, ids=ids: [s for s in spans if s.name == "onnxruntime run"
                                                                 and {sid for _, sid in s.links} & ids],
                                         what="the runs that served the calls")
                if any({sid for _, sid in r.links} == ids for r in runs):
                    break
            else:
                pytest.fail(f"no two calls shared a run in 3 attempts: {[r.links for r in runs]}")
            # Each server span continues its client's trace, under the client's span.
            for call, context in zip(sorted(calls, key=lambda s: s.parent_id),
                                     sorted(contexts, key=lambda c: format(c.span_id, "016x")), strict=True):
                assert call.trace_id == format(context.trace_id, "032x")
                assert call.parent_id == format(context.span_id, "016x")
                assert call.kind == "SERVER" and call.transport == "grpc"
                assert call.attributes["rpc.system.name"] == "grpc"
                assert call.attributes["rpc.method"] == CLASSIFY
                assert call.attributes["rpc.response.status_code"] == "OK"
                assert call.attributes["network.peer.address"] == "127.0.0.1"
                assert call.attributes["sentiment.texts"] == 1 and call.attributes["sentiment.tokens"] > 2
                assert (call.attributes["sentiment.model"], call.attributes["sentiment.model_version"]) == \
                    ("sentiment", "1")
                assert call.resource["service.name"] == "sentiment-server"
                assert call.resource["process.pid"] == server.proc.pid
            run = next(r for r in runs if {sid for _, sid in r.links} == ids)
            # The run: under one of the calls it served, linked to both, saying what ran.
            assert run.parent_id in ids and run.trace_id in {c.trace_id for c in calls}
            assert {(t, s) for t, s in run.links} == {(c.trace_id, c.span_id) for c in calls}
            a = run.attributes
            assert (a["sentiment.batch.texts"], a["sentiment.batch.calls"]) == (2, 2)
            assert a["sentiment.batch.padded_tokens"] == a["sentiment.batch.tokens"] == 2 * calls[0].attributes[
                "sentiment.tokens"]
            assert (a["sentiment.graph"], a["sentiment.precision"], a["sentiment.provider"]) == \
                ("model.onnx", "fp32", "CPUExecutionProvider")
            assert (a["sentiment.model"], a["sentiment.model_version"]) == ("sentiment", "1")
            # Every call's children: auth, admission, tokenize, queue wait (linked to the run), inside the call.
            spans = receiver.wait_for(lambda spans: len([s for s in spans if s.parent_id in ids]) >= 2 * 4 + 1 and
                                      spans, what="the calls' child spans")
            for call in calls:
                kids = {s.name: s for s in spans if s.parent_id == call.span_id and s.name != "onnxruntime run"}
                assert set(kids) == {"auth", "admission", "tokenize", "queue wait"}, kids
                assert kids["queue wait"].links == [(run.trace_id, run.span_id)]
                assert kids["queue wait"].end_ns <= run.start_ns + 1000  # the wait ends where the run starts
                for kid in kids.values():
                    assert kid.trace_id == call.trace_id and kid.kind == "INTERNAL"
                    assert call.start_ns <= kid.start_ns <= kid.end_ns
        finally:
            server.close()


def test_spans_arrive_over_http_protobuf_and_the_request_id_is_returned(tiny_bundle: Path) -> None:
    tracer = _tracer()
    with OtlpReceiver() as receiver:
        server = ServerProcess(tiny_bundle, "--device", "cpu", env=receiver.env("http/protobuf"))
        try:
            port = server.wait_listening()
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, \
                    tracer.start_as_current_span("client") as client:
                stub = pb_grpc.SentimentServiceStub(channel)
                _, call = stub.Classify.with_call(pb.ClassifyRequest(texts=[TEXT]),
                                                  metadata=[("x-request-id", "req-42")], timeout=30)
                assert ("x-request-id", "req-42") in tuple(call.trailing_metadata())
                with pytest.raises(grpc.RpcError) as refused:  # an error: a new id, returned all the same
                    stub.Classify(pb.ClassifyRequest(texts=[" "]), timeout=30)
                made = dict(refused.value.trailing_metadata())["x-request-id"]
                assert len(made) == 36 and made != "req-42"
            parent = format(client.get_span_context().span_id, "016x")
            # Not through SentimentClient: without its propagation, a raw stub's call starts a trace of its own.
            spans = receiver.wait_for(lambda spans: len([s for s in spans if s.name == CLASSIFY]) == 2 and spans)
            ok, bad = sorted((s for s in spans if s.name == CLASSIFY), key=lambda s: s.start_ns)
            assert ok.parent_id == "" and ok.transport == "http" and receiver.requests["grpc"] == 0
            assert ok.parent_id != parent
            assert bad.attributes["rpc.response.status_code"] == "INVALID_ARGUMENT"
            assert bad.status == 0  # the client's error: not the server span's (semantic conventions for gRPC)
            log = server.log
            assert f"request_id=req-42 trace_id={ok.trace_id}" in log
            assert f"request_id={made} trace_id={bad.trace_id}" in log
        finally:
            server.close()


def test_each_worker_exports_its_own_spans(tiny_bundle: Path) -> None:
    with OtlpReceiver() as receiver:
        server = ServerProcess(tiny_bundle, "--device", "cpu", "--workers", "2", env=receiver.env("grpc"))
        try:
            port = server.wait_listening()
            workers = {p.pid for p in psutil.Process(server.proc.pid).children()}
            for _ in range(6):  # a channel per call: the kernel spreads connections over both workers
                with SentimentClient(f"127.0.0.1:{port}", timeout=30) as client:
                    client.classify([TEXT])
            spans = receiver.wait_for(lambda spans: len([s for s in spans if s.name == CLASSIFY]) == 6 and spans)
            calls = [s for s in spans if s.name == CLASSIFY]
            assert {s.resource["process.pid"] for s in calls} <= workers
            assert {s.resource["sentiment.worker"] for s in calls} <= {0, 1}
            for s in calls:  # a worker's runs are in its own process' export
                runs = [r for r in spans if r.name == "onnxruntime run" and r.parent_id == s.span_id]
                assert runs and all(r.resource == s.resource for r in runs)
        finally:
            server.close()


def test_sampling_follows_the_variables_and_the_client(tiny_bundle: Path) -> None:
    """parentbased_traceidratio at 0: no trace of its own is sampled, a client's sampled one is followed, an unsampled
    one is not; the calls are answered either way."""
    tracer = _tracer()
    with OtlpReceiver() as receiver:
        env = receiver.env("grpc", OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG="0")
        server = ServerProcess(tiny_bundle, "--device", "cpu", env=env)
        try:
            port = server.wait_listening()
            unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.SentimentServiceStub(channel)
                stub.Classify(pb.ClassifyRequest(texts=[TEXT]), timeout=30)
                stub.Classify(pb.ClassifyRequest(texts=[TEXT]), metadata=[("traceparent", unsampled)], timeout=30)
            with SentimentClient(f"127.0.0.1:{port}", timeout=30) as client, \
                    tracer.start_as_current_span("sampled client") as span:
                client.classify([TEXT])
            trace_id = format(span.get_span_context().trace_id, "032x")
            spans = receiver.wait_for(lambda spans: any(s.name == "onnxruntime run" for s in spans) and spans)
            server.stop()  # its last spans are exported on the way out
            assert {s.trace_id for s in receiver.spans} == {trace_id}
            assert {s.name for s in spans} >= {CLASSIFY, "tokenize", "queue wait", "onnxruntime run"}
        finally:
            server.close()


@pytest.mark.parametrize(("variables", "named"), [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "udp"},
     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='udp'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER='sometimes'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"},
     "OTEL_TRACES_SAMPLER_ARG='1.5'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"},
     "OTEL_TRACES_SAMPLER_ARG='half'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_MAX_QUEUE_SIZE": "-1"}, "OTEL_BSP_MAX_QUEUE_SIZE='-1'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "lots"},
     "OTEL_BSP_MAX_EXPORT_BATCH_SIZE='lots'"),
])
def test_a_bad_variable_is_named(variables: dict[str, str], named: str) -> None:
    with pytest.raises(ServerConfigError, match=named.replace("(", r"\(")):
        tracing.check(variables)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_bad_variable_exits_2_with_one_line(tiny_bundle: Path, workers: str) -> None:
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    done = subprocess.run([sys.executable, "-m", "serving.server", str(tiny_bundle), "--port", "0", "--no-metrics",
                           "--workers", workers], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["sentiment-server: error: OTEL_EXPORTER_OTLP_PROTOCOL='http/json': the trace exporter speaks "
                      "grpc or http/protobuf"], done.stderr


def test_the_resource_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder (in the span export process) hashes every span's resource: ours equals the SDK's own and hashes
    alike, without a JSON dump of its attributes each time (a quarter of the encoding's time); the server's
    attributes and the user's are in it."""
    from opentelemetry.sdk import resources

    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    made = tracing._resource("9.9", 3, os.environ)
    ours = otlp.hashed_once(made)
    assert ours == made and hash(ours) == hash(made)
    assert (ours.attributes["deployment.environment"], ours.attributes["sentiment.worker"]) == ("test", 3)
    monkeypatch.setattr(resources, "dumps", lambda *a, **k: pytest.fail("the resource was hashed again"))
    hash(ours)


def test_off_without_the_variables_imports_no_sdk(tiny_bundle: Path) -> None:
    """No OTEL_TRACES_EXPORTER (or `none`, or OTEL_SDK_DISABLED): no SDK, no span, the request path's hooks idle."""
    code = f"""
import sys
from serving.process.app import SentimentServer, configure_process
from serving.config import ServerConfig
from serving.client import SentimentClient
cfg = ServerConfig(port=0)
configure_process(cfg)
with SentimentServer({str(tiny_bundle)!r}, cfg) as server, SentimentClient(f"127.0.0.1:{{server.port}}") as client:
    assert client.classify(["{TEXT}"])[0].label
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    for extra in ({}, {"OTEL_TRACES_EXPORTER": "none"}, {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}):
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | extra
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "[]", (extra, done.stdout)


def test_a_collector_that_is_down_holds_the_exit_only_a_bounded_while(tiny_bundle: Path) -> None:
    """Spans for an unreachable collector: the calls are answered, and on SIGTERM the server gives up on them after
    its bound (a warning says so) rather than after the exporter's retries (which the SDK's exit hook waited for)."""
    dead = free_port()  # nothing listens there, and no server's port 0 lands there meanwhile (tests/procs.py)
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{dead}", "OTEL_BSP_SCHEDULE_DELAY": "60000"}
    server = ServerProcess(tiny_bundle, "--device", "cpu", "--grace-s", "1", env=env)
    try:
        with SentimentClient(f"127.0.0.1:{server.wait_listening()}", timeout=30) as client:
            assert client.classify([TEXT])[0].label
        assert server.stop() == 0
        assert "spans not exported within 5 s of stopping (is the collector reachable?): dropped" in server.log
    finally:
        server.close()


def no_call_left() -> None:
    """No call record left once every call is answered. Its answer reaches the client while the server's thread still
    runs the call's last lines, which hold its record: under a loaded CI that moment was seen, so this waits up to
    10 s. A call record that lives on is still caught."""
    def none() -> bool:
        gc.collect()
        return not [o for o in gc.get_objects() if isinstance(o, call_log.Call)]
    wait_until(none, 10, what="no call record left")


def test_no_call_outlives_its_answer_when_traced(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches and their spans hold span contexts, never a call: once answered, no call record is left (the
    batcher's requests of two batched calls, the spans still queued for export)."""
    with OtlpReceiver() as receiver:
        for key, value in receiver.env("grpc", OTEL_BSP_SCHEDULE_DELAY="60000").items():
            monkeypatch.setenv(key, value)
        tracing.configure("test")
        try:
            with running_server(tiny_bundle, device="cpu", max_queue_delay_ms=1000, batch_workers=1) as server:
                paired_calls(f"127.0.0.1:{server.port}", TEXT)
                no_call_left()
        finally:
            tracing.shutdown()
    assert any(s.name == "onnxruntime run" and len(s.links) == 2 for s in receiver.spans)


def test_http_calls_are_traced_and_batched_with_grpc_calls(tiny_bundle: Path) -> None:
    """An HTTP call with a W3C traceparent header continues its client's trace (semantic conventions for HTTP
    servers), returns its x-request-id, and shares a run with a gRPC call (one batcher for both protocols)."""
    client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with OtlpReceiver() as receiver:
        server = ServerProcess(tiny_bundle, "--device", "cpu", "--http-port", "0", *BATCH_PAIRS,
                               env=receiver.env("http/protobuf"))
        try:
            port = server.wait_listening()
            for attempt in range(3):  # a pair that missed one another (a loaded machine) is sent again
                client_span = f"00f067aa0ba902b{attempt}"
                with SentimentClient(f"127.0.0.1:{port}", timeout=30) as client:
                    client.classify([TEXT, TEXT])  # the previous batch: two texts (BATCH_PAIRS)
                    with futures.ThreadPoolExecutor(2) as pool:
                        over_grpc = pool.submit(client.classify, [TEXT])
                        reply = http_fixtures.classify(server.http_port, [TEXT], headers={
                            "traceparent": f"00-{client_trace}-{client_span}-01", "x-request-id": "http-1"})
                        over_grpc.result()
                assert reply.status == 200 and reply.headers["x-request-id"] == "http-1"
                (call,) = receiver.wait_for(lambda spans, p=client_span: [s for s in spans if s.parent_id == p])
                spans = receiver.wait_for(lambda spans, c=call: {s.name for s in spans if s.parent_id == c.span_id}
                                          >= {"admission", "tokenize", "queue wait"} and spans)
                runs = [s for s in spans if s.name == "onnxruntime run" and (client_trace, call.span_id) in s.links]
                grpc_calls = {s.span_id for s in spans if s.name == CLASSIFY}
                if any({sid for _, sid in r.links} & grpc_calls for r in runs):
                    break
            else:
                pytest.fail("no run served an HTTP and a gRPC call in 3 attempts")
            assert (call.name, call.kind, call.trace_id) == ("POST /v1/classify", "SERVER", client_trace)
            a = call.attributes
            assert (a["http.request.method"], a["http.route"], a["url.path"], a["http.response.status_code"]) == \
                ("POST", "/v1/classify", "/v1/classify", 200)
            assert a["client.address"] == "127.0.0.1" and a["sentiment.texts"] == 1
            refused = http_fixtures.classify(server.http_port, [])
            assert refused.status == 400 and len(refused.headers["x-request-id"]) == 36
            bad = receiver.wait_for(lambda spans: [s for s in spans if s.attributes.get("http.response.status_code")
                                                   == 400])
            assert bad[0].status == 0  # a 4xx is the client's: not an error of the server span
            access = [line for line in server.log.splitlines() if "serving.access: POST /v1/classify" in line]
            assert any(" 200 texts=1 " in line and f"request_id=http-1 trace_id={client_trace}" in line
                       for line in access), access
            assert any(" 400 texts=0 " in line and refused.headers["x-request-id"] in line for line in access)
        finally:
            server.close()


def test_a_clients_bad_trace_headers_cannot_flood_the_log(tiny_bundle: Path) -> None:
    """Malformed tracestate, traceparent and baggage, 40 calls of each: every call is answered, and OpenTelemetry's
    propagators, which warn once per bad list member (some lines quoting the client's text whole), write at most 3
    lines a minute for each of their warnings, each cut short. Before, these 200 calls wrote 6,160 warning lines, 40 of
    them over 3,000 characters."""
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    hostile = [
        [("traceparent", good), ("tracestate", ",".join(f"k{i}=v{i}" for i in range(40)))],  # over 32 members
        [("traceparent", good), ("tracestate", ",".join(f"K{i}=v {i}" for i in range(30)))],  # 30 invalid members
        [("traceparent", good + "-" + "x" * 600)],  # over 512 characters
        [("baggage", ",".join(f"member-without-a-value-{i}" for i in range(150)))],  # 150 invalid members
        [("baggage", "x" * 3000)],  # quoted whole in its warning
    ]
    with OtlpReceiver(keep=False) as receiver:
        server = ServerProcess(tiny_bundle, "--device", "cpu", env=receiver.env("grpc"))
        try:
            with grpc.insecure_channel(f"127.0.0.1:{server.wait_listening()}") as channel:
                stub = pb_grpc.SentimentServiceStub(channel)
                answers = [stub.Classify(pb.ClassifyRequest(texts=[TEXT]), metadata=metadata, timeout=30)
                           for metadata in hostile for _ in range(40)]
            assert server.stop() == 0
        finally:
            server.close()
    assert len(answers) == 200 and all(a.results[0].label for a in answers)
    lines = [line for line in server.log.splitlines() if "opentelemetry" in line]
    assert all("a client's trace header: " in line and len(line) < 500 for line in lines), lines[:3]
    assert 4 <= len(lines) <= 4 * 3, lines  # each of the 4 warnings, at most 3 times


def test_an_overloaded_traced_server_refuses_at_admission_and_keeps_no_call(tiny_bundle: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A traced server under an overload made here, as tests/test_reliability_protocol.py makes it (the one batch
    worker held inside a run, the queue behind it without room for a request of max_texts): 201 calls refused
    RESOURCE_EXHAUSTED. Each refusal is one server span with its code, not an error of the server's (OpenTelemetry's
    gRPC conventions: the client's to retry), whose only child is its admission: its trace shows that it was refused
    before its body was read or tokenized. Once all are answered no call record is left, and the two calls held
    behind the model are traced as any other."""
    with OtlpReceiver() as receiver:
        for key, value in receiver.env("grpc").items():
            monkeypatch.setenv(key, value)
        tracing.configure("test")
        try:
            with running_server(tiny_bundle, device="cpu", batch_workers=1, max_queue=6, max_texts=4) as server:
                channels = [grpc.insecure_channel(f"127.0.0.1:{server.port}",
                                                  options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(5)]
                try:
                    stubs = [pb_grpc.SentimentServiceStub(c) for c in channels]
                    stubs[0].Classify(pb.ClassifyRequest(texts=[TEXT]), timeout=30)
                    with HeldRuns(server) as held:
                        running = stubs[0].Classify.future(pb.ClassifyRequest(texts=[TEXT]), timeout=60)
                        assert held.wait_entered()
                        queued = stubs[0].Classify.future(pb.ClassifyRequest(texts=["a", "b", "c", "d"]), timeout=60)
                        wait_until(lambda: server.core.batcher.queued == 4, what="4 texts queued")
                        flood_and_one_more_are_refused(stubs, pb.ClassifyRequest(texts=[TEXT] * 4), [],
                                                       pb.ClassifyRequest(texts=["un"]),
                                                       "no room for a request of up to 4 texts")
                    assert len(running.result().results) == 1 and len(queued.result().results) == 4
                finally:
                    for c in channels:
                        c.close()
                no_call_left()
        finally:
            tracing.shutdown()
    spans = receiver.wait_for(lambda spans: len([s for s in spans if s.name == CLASSIFY]) == 1 + 2 + 201 and spans,
                              what="every call's server span")
    server_spans = [s for s in spans if s.name == CLASSIFY]
    codes = sorted(s.attributes["rpc.response.status_code"] for s in server_spans)
    assert codes == ["OK"] * 3 + ["RESOURCE_EXHAUSTED"] * 201, codes
    for refused in [s for s in server_spans if s.attributes["rpc.response.status_code"] == "RESOURCE_EXHAUSTED"]:
        assert refused.status != 2, refused  # not the server's error
        assert [k.name for k in spans if k.parent_id == refused.span_id] == ["admission"]
    runs = [s for s in spans if s.name == "onnxruntime run"]
    assert sum(r.attributes["sentiment.batch.texts"] for r in runs) == 1 + 1 + 4  # the three calls answered
