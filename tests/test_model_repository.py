"""The model repository (serving/model/repository.py, serving/model/models.py): its layout and version policy, load
and unload over both protocols' repository API, a version swapped in under load with no failed call, a bad bundle
refused while the old version serves, two models with their own queues and shares, and cancelled calls that never
reach the model. Real servers on 127.0.0.1 (tests/test_repository_attacks.py attacks the same API)."""

from __future__ import annotations

import gc
import shutil
import threading
import time
import weakref
from pathlib import Path

import grpc
import pytest
from http_fixtures import call
from serving_fixtures import HeldRuns, wait_until

from serving.config import ServerConfig
from serving.gen.inference import grpc_service_pb2 as kpb
from serving.gen.inference import grpc_service_pb2_grpc as kpb_grpc
from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.model.repository import Policy, RepositoryError, read_model, read_policy
from serving.model.turns import Turns
from serving.process.app import SentimentServer

TOKEN = "repository-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GRPC_AUTH = (("authorization", f"Bearer {TOKEN}"),)


def add_version(repo: Path, name: str, version: int, bundle: Path) -> Path:
    """Copy `bundle` in under a temporary name, then rename it into place: how a version is published."""
    (repo / name).mkdir(parents=True, exist_ok=True)
    incoming = repo / name / f".incoming-{version}"
    shutil.copytree(bundle, incoming)
    return incoming.rename(repo / name / str(version))


def serve(repo: Path, **options: object) -> SentimentServer:
    cfg = dict(port=0, http_port=0, metrics_port=None, device="cpu", model_repository=str(repo),
               model_control="explicit", auth_token=TOKEN, grace_s=5.0)
    return SentimentServer(None, ServerConfig(**{**cfg, **options}))  # started by `with`


def index(server: SentimentServer) -> dict[tuple[str, str], tuple[str, str]]:
    reply = call(server.http_port, "POST", "/v2/repository/index", headers=AUTH)
    assert reply.status == 200, reply.body
    return {(r["name"], r["version"]): (r["state"], r["reason"]) for r in reply.json}


def classify_http(server: SentimentServer, **model: str) -> dict:
    reply = call(server.http_port, "POST", "/v1/classify", {"texts": ["Un livre magnifique."], **model},
                 headers=AUTH)
    assert reply.status == 200, reply.body
    return reply.json


def test_layout_and_version_policy(tmp_path: Path) -> None:
    """Versions are digit-only folders; other names (a copy in progress, a file) are not versions; the policy
    picks among them; a policy file that cannot be used is one line naming it."""
    model = tmp_path / "m"
    for v in ("1", "2", "10", ".incoming-11", "abc", "07"):
        (model / v).mkdir(parents=True)
    (model / "4").write_text("not a folder")
    found = read_model(tmp_path, "m")
    assert sorted(found.versions_on_disk) == [1, 2, 10] and found.refused["4"] == f"{model / '4'} is not a folder"
    assert "not a version number as written" in found.refused["07"]  # 07 and 7 would be one version
    assert Policy().pick([1, 2, 10]) == [10]
    (model / "model.json").write_text('{"version_policy": {"latest": {"num_versions": 2}}}')
    assert read_policy(model / "model.json").pick([1, 2, 10]) == [10, 2]
    (model / "model.json").write_text('{"version_policy": {"specific": {"versions": [1, 7]}}}')
    assert read_model(tmp_path, "m").policy.pick([1, 2, 7, 10]) == [7, 1]
    (model / "model.json").write_text('{"version_policy": {"all": {}}}')
    assert read_policy(model / "model.json").pick([2, 1]) == [2, 1]
    for bad in ('{"version_policy": {"newest": {}}}', '{"version_policy": {"latest": {"num_versions": 0}}}',
                '{"version_policy": {"specific": {"versions": []}}}', "[1, 2]", "{", "[" * 100_000,
                '{"version_policy": {"latest": {"num_version": 2}}}', " " * 70_000):
        (model / "model.json").write_text(bad)
        with pytest.raises(RepositoryError, match="model.json") as e:
            read_policy(model / "model.json")
        assert "\n" not in str(e.value)


def test_load_swap_unload_over_http_and_grpc_and_answers_name_the_version(tmp_path: Path, tiny_bundle: Path) -> None:
    repo = tmp_path / "repo"
    add_version(repo, "fr", 1, tiny_bundle)
    with serve(repo, metrics_port=0) as server:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        kserve, sentiment = kpb_grpc.GRPCInferenceServiceStub(channel), pb_grpc.SentimentServiceStub(channel)
        assert index(server) == {("fr", "1"): ("READY", "")}
        assert classify_http(server)["model_version"] == "1"

        add_version(repo, "fr", 2, tiny_bundle)
        assert index(server)[("fr", "1")] == ("READY", "")  # explicit control: nothing changes until asked
        reply = call(server.http_port, "POST", "/v2/repository/models/fr/load", headers=AUTH)
        assert reply.status == 200, reply.body
        assert index(server) == {("fr", "1"): ("UNAVAILABLE", "unloaded"), ("fr", "2"): ("READY", "")}
        # every surface says which version answered
        assert classify_http(server) ["model_version"] == "2"
        answer = sentiment.Classify(pb.ClassifyRequest(texts=["Super."]), metadata=GRPC_AUTH)
        assert (answer.model_name, answer.model_version) == ("fr", "2")
        infer = call(server.http_port, "POST", "/v2/models/fr/infer", {"inputs": [
            {"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["Bien."]}]}, headers=AUTH)
        assert (infer.json["model_name"], infer.json["model_version"]) == ("fr", "2")
        meta = sentiment.GetModelMetadata(pb.GetModelMetadataRequest(), metadata=GRPC_AUTH)
        assert (meta.model_name, meta.model_version) == ("fr", "2")
        with pytest.raises(grpc.RpcError) as gone:  # the unloaded version, named: not found
            sentiment.Classify(pb.ClassifyRequest(texts=["Super."], model_version="1"), metadata=GRPC_AUTH)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND and "versions: ['2']" in gone.value.details()
        # the old version's series are gone, the new one's there
        page = call(server.metrics_port, "GET", "/metrics").body.decode()
        assert 'sentiment_texts_total{model="fr",version="2"}' in page
        assert 'version="1"' not in page.replace('result=', '')
        assert 'sentiment_model_loads_total{model="fr",result="unloaded"} 1.0' in page

        # gRPC: index, unload (calls then get UNAVAILABLE naming the model), load back
        rows = kserve.RepositoryIndex(kpb.RepositoryIndexRequest(ready=True), metadata=GRPC_AUTH).models
        assert [(r.name, r.version, r.state) for r in rows] == [("fr", "2", "READY")]
        kserve.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name="fr"), metadata=GRPC_AUTH)
        with pytest.raises(grpc.RpcError) as down:
            sentiment.Classify(pb.ClassifyRequest(texts=["Super."]), metadata=GRPC_AUTH)
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE and "no model is loaded" in down.value.details()
        assert call(server.http_port, "GET", "/v2/health/ready").status == 503
        kserve.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name="fr"), metadata=GRPC_AUTH)
        assert classify_http(server)["model_version"] == "2"
        channel.close()


def test_an_unloaded_version_is_freed_at_once_not_by_the_cyclic_collector(tmp_path: Path, tiny_bundle: Path) -> None:
    """A version's graph is the server's largest allocation: once unloaded and drained, nothing may keep it in a
    reference cycle, which only Python's collector frees (an idle server runs none). The metrics' gauges read the
    version at each scrape: their functions let go of it when it is unloaded."""
    repo = tmp_path / "repo"
    add_version(repo, "fr", 1, tiny_bundle)
    with serve(repo, metrics_port=0, memory_reclaim_idle_s=0) as server:  # no reclaimer: its collections neither
        classify_http(server)
        assert "sentiment_queue_depth" in call(server.metrics_port, "GET", "/metrics").body.decode()
        version = weakref.ref(server.models.get("fr").predictor)
        gc.collect()
        gc.disable()
        try:
            assert call(server.http_port, "POST", "/v2/repository/models/fr/unload", headers=AUTH).status == 200
            wait_until(lambda: version() is None, 10, what="the unloaded version's predictor freed")
        finally:
            gc.enable()


def test_swap_under_load_fails_no_call_and_traffic_moves_to_the_new_version(tmp_path: Path,
                                                                            tiny_bundle: Path) -> None:
    """Polled: three versions renamed in one after another while four clients (gRPC and HTTP) call without pause."""
    repo = tmp_path / "repo"
    add_version(repo, "fr", 1, tiny_bundle)
    with serve(repo, model_control="poll", repository_poll_s=0.1) as server:
        stop, failures, seen = threading.Event(), [], []
        stub = pb_grpc.SentimentServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))

        def grpc_client() -> None:
            while not stop.is_set():
                try:
                    seen.append(stub.Classify(pb.ClassifyRequest(texts=["Très bon."]), metadata=GRPC_AUTH,
                                              timeout=10).model_version)
                except grpc.RpcError as e:
                    failures.append(f"{e.code()}: {e.details()}")

        def http_client() -> None:
            while not stop.is_set():
                reply = call(server.http_port, "POST", "/v1/classify", {"texts": ["Nul."]}, headers=AUTH)
                if reply.status == 200:
                    seen.append(reply.json["model_version"])
                else:
                    failures.append(reply.body.decode())

        clients = [threading.Thread(target=f) for f in (grpc_client, grpc_client, http_client, http_client)]
        for c in clients:
            c.start()
        try:
            for v in (2, 3, 4):
                add_version(repo, "fr", v, tiny_bundle)
                wait_until(lambda v=v: index(server).get(("fr", str(v - 1))) == ("UNAVAILABLE", "unloaded"),
                           what=f"version {v} swapped in")
                time.sleep(0.3)
        finally:
            stop.set()
            for c in clients:
                c.join(30)
        assert failures == []
        assert {"1", "2", "3", "4"} <= set(seen) and seen[-1] == "4"
        assert [c.version for c in server.models.cores] == ["4"]


def test_a_bad_bundle_is_refused_and_the_old_version_keeps_serving(tmp_path: Path, tiny_bundle: Path) -> None:
    repo = tmp_path / "repo"
    add_version(repo, "fr", 1, tiny_bundle)
    with serve(repo, metrics_port=0) as server:
        bad = add_version(repo, "fr", 2, tiny_bundle)
        onnx = bad / "model.onnx"
        data = bytearray(onnx.read_bytes())
        data[len(data) // 2] ^= 0xFF
        onnx.write_bytes(bytes(data))
        reply = call(server.http_port, "POST", "/v2/repository/models/fr/load", headers=AUTH)
        assert reply.status == 400 and reply.json["code"] == "FAILED_PRECONDITION", reply.body
        assert "version 2 refused" in reply.json["error"] and "model.onnx" in reply.json["error"]
        assert "version 1 keeps serving" in reply.json["error"]
        state, reason = index(server)[("fr", "2")]
        assert state == "UNAVAILABLE" and reason.startswith("fr/2/model.onnx: checksum mismatch"), reason
        assert str(tmp_path) not in reason + reply.json["error"]  # the server's own paths stay in its log
        assert index(server)[("fr", "1")] == ("READY", "")
        assert classify_http(server)["model_version"] == "1"
        assert server.metrics.registry.get_sample_value("sentiment_model_loads_total",
                                                        {"model": "fr", "result": "failed"}) == 1
        # a fixed bundle under a new version number goes in
        add_version(repo, "fr", 3, tiny_bundle)
        assert call(server.http_port, "POST", "/v2/repository/models/fr/load", headers=AUTH).status == 200
        assert classify_http(server)["model_version"] == "3"


def test_two_models_each_with_its_queue_and_share(tmp_path: Path, tiny_bundle: Path) -> None:
    """A flooded model holds at most its share of the model calls: the other's calls still get in."""
    repo = tmp_path / "repo"
    add_version(repo, "a", 1, tiny_bundle)
    add_version(repo, "b", 1, tiny_bundle)
    with serve(repo, max_concurrent_rpcs=8, max_workers=8, fair_calls=8) as server:  # room for b's calls beside a's
        sentiment = pb_grpc.SentimentServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        with pytest.raises(grpc.RpcError) as which:
            sentiment.Classify(pb.ClassifyRequest(texts=["Bien."]), metadata=GRPC_AUTH)
        assert which.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "['a', 'b']: name one" in \
            which.value.details()
        assert classify_http(server, model_name="b")["model_name"] == "b"
        a = server.models.get("a")
        server.models.get("b").batcher.turns = None  # a's held runs hold the process' run slots: b runs beside them
        share = a.max_active
        assert share == 6  # 8 calls, 2 kept for the other model
        with HeldRuns(a.batcher) as held:
            calls = [sentiment.Classify.future(pb.ClassifyRequest(texts=["Bien."], model_name="a"),
                                               metadata=GRPC_AUTH, timeout=30) for _ in range(share)]
            wait_until(lambda: a._active == share, what="a's share taken")
            with pytest.raises(grpc.RpcError) as refused:
                sentiment.Classify(pb.ClassifyRequest(texts=["Bien."], model_name="a"), metadata=GRPC_AUTH)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "share" in refused.value.details()
            for _ in range(2):  # b still gets in, while a holds all it may
                assert sentiment.Classify(pb.ClassifyRequest(texts=["Bien."], model_name="b"),
                                          metadata=GRPC_AUTH).model_name == "b"
            held.release()
            assert all(c.result().model_name == "a" for c in calls)


def test_a_hundred_cancelled_calls_never_reach_the_model(tmp_path: Path, tiny_bundle: Path) -> None:
    """Queued behind a held run, then cancelled by their client: the server's own counters show none computed."""
    repo = tmp_path / "repo"
    add_version(repo, "fr", 1, tiny_bundle)
    with serve(repo, batch_workers=1) as server:  # one run at a time: the held one
        # two connections: one holds at most max_streams_per_connection (100) calls at once
        stubs = [pb_grpc.SentimentServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}",
                                                                    options=[("grpc.use_local_subchannel_pool", 1)]))
                 for _ in range(2)]
        stub = stubs[0]
        core = server.core
        texts = server.metrics.registry.get_sample_value
        labels = {"model": "fr", "version": "1"}
        before = texts("sentiment_texts_total", labels) or 0
        with HeldRuns(core.batcher) as held:
            first = stub.Classify.future(pb.ClassifyRequest(texts=["Premier."]), metadata=GRPC_AUTH)
            assert held.wait_entered()
            queued = [stubs[i % 2].Classify.future(pb.ClassifyRequest(texts=[f"Texte {i}."]), metadata=GRPC_AUTH)
                      for i in range(100)]
            wait_until(lambda: core.batcher.queued == 100, what="100 calls queued")
            for f in queued:
                f.cancel()
            assert all(f.cancelled() for f in queued)
            wait_until(lambda: all(row.request.cancelled() for row in core.batcher._pending),
                       what="the server sees every queued call cancelled")
            held.release()
            assert first.result(timeout=10).results
        wait_until(lambda: texts("sentiment_dropped_texts_total", {**labels, "reason": "Cancelled"}) == 100,
                   what="100 dropped as cancelled")
        assert texts("sentiment_texts_total", labels) - before == 1  # the first call's text alone was computed
        assert core.batcher.queued == 0


def test_turns_share_the_runs_between_two_busy_models_whatever_their_callers() -> None:
    """Two slots, model a with 6 workers and b with 2, each run 10 ms: b gets half the runs, not a quarter; and a
    model alone takes every slot."""
    turns, runs, stop = Turns(2), {"a": 0, "b": 0}, threading.Event()

    def worker(model: str) -> None:
        while not stop.is_set():
            turns.take(model)
            time.sleep(0.01)
            runs[model] += 1
            turns.give(model, 0.01)

    threads = [threading.Thread(target=worker, args=(m,)) for m in "aaaaaabb"]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(5)
    assert 0.4 < runs["b"] / (runs["a"] + runs["b"]) < 0.6, runs
    waited = Turns(1)  # a call that gives up waiting leaves no trace: the next take goes in at once
    assert waited.take("a")
    assert not waited.take("b", until=time.monotonic() + 0.2)
    assert not waited.take("b", gone=lambda: True)
    waited.give("a", 1.0)
    assert waited.take("b", until=time.monotonic()) and not waited.shared
    alone = Turns(2)
    alone.take("a")
    alone.take("a")  # a model alone takes every slot: the second take does not wait for the first give
    alone.give("a", 0.0)
    alone.give("a", 0.0)


def test_a_models_calls_take_their_turns_in_arrival_order_while_they_poll_for_their_clients() -> None:
    """A waiting call wakes every 0.1 s to ask whether its client has gone; it keeps its place in its model's line.
    Threads sharing one Condition went to the back of it at each such wake, behind every later call: waits then grow
    without bound for some calls while a flood of the other model lasts (the p99 of bench/model_swap_bench.py's
    two-model phase)."""
    turns, order = Turns(1), []
    def waiting(model: str) -> int:  # a count of threads before the line, a line of them after
        w = turns._waiting.get(model, 0)
        return w if isinstance(w, int) else len(w)

    assert turns.take("a")
    threads = []
    for i in range(7):
        def wait(i: int = i) -> None:
            assert turns.take("b", gone=lambda: False)
            order.append(i)
            turns.give("b", 1.0)
        threads.append(threading.Thread(target=wait))
        threads[-1].start()
        wait_until(lambda n=i + 1: waiting("b") == n, what=f"waiter {i} in line")
        time.sleep(0.037)  # a spacing that sets the threads' 0.1 s wakes in another order than their arrivals
    time.sleep(0.35)  # each has woken to poll a few times
    turns.give("a", 1.0)
    for t in threads:
        t.join(5)
    assert order == list(range(7)), order
