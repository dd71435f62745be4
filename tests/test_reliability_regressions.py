"""Regression tests for the server bugs that the reliability suites (issue 7) found, one per bug.

1. Callers within the concurrent-RPC limit were refused. gRPC counts an RPC until its handler's thread returns,
   which is after the client has its answer; with the limit equal to the number of callers, a caller that sent its
   next request at once found its previous one still counted and got RESOURCE_EXHAUSTED "Concurrent RPC limit
   exceeded!" (bench/soak.py: 184 of 159k requests at 128 callers, max_workers 128). The race is made certain by
   letting every gRPC pool thread linger after its handler has answered (a fault injected into the thread pool,
   not a mock: the server, gRPC and onnxruntime are real).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import thread as cf_thread
from pathlib import Path

import grpc
import pytest
from serving_fixtures import HeldRuns, running_server, target

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc

LINGER = 0.3  # seconds a pool thread stays busy after its handler answered


@pytest.fixture
def lingering_pool_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    real_run = cf_thread._WorkItem.run

    def run(self: cf_thread._WorkItem) -> None:
        fn = self.fn

        def then_linger(*args: object, **kwargs: object) -> object:
            try:
                return fn(*args, **kwargs)
            finally:
                time.sleep(LINGER)

        self.fn = then_linger
        real_run(self)

    monkeypatch.setattr(cf_thread._WorkItem, "run", run)


def test_callers_within_the_rpc_limit_are_served_while_grpc_still_counts_their_last_call(
        tiny_bundle: Path, lingering_pool_threads: None) -> None:
    callers = 4
    with running_server(tiny_bundle, device="cpu", max_workers=callers) as s, \
            grpc.insecure_channel(target(s)) as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        grpc.channel_ready_future(channel).result(timeout=10)
        barrier, codes = threading.Barrier(callers), []

        def caller(i: int) -> None:
            barrier.wait()
            for k in range(2):  # the second request leaves as soon as the first is answered
                try:
                    stub.Classify(pb.ClassifyRequest(texts=[f"appel {i}.{k}"]), timeout=10)
                    codes.append("OK")
                except grpc.RpcError as e:
                    codes.append(f"{e.code().name}: {e.details()}")

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert codes == ["OK"] * 2 * callers


def test_past_the_limit_and_its_headroom_grpc_still_refuses_at_once(tiny_bundle: Path) -> None:
    """max_workers 4: headroom 8, so 12 RPCs are accepted (each holds a thread while the batcher is held) and
    the 13th and later are refused at once, not queued unseen."""
    with running_server(tiny_bundle, device="cpu", max_workers=4) as s, grpc.insecure_channel(target(s)) as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10)
        held = HeldRuns(s)
        accepted = [stub.Classify.future(pb.ClassifyRequest(texts=[f"retenu {i}"]), timeout=30) for i in range(12)]
        deadline = time.monotonic() + 10
        while s.batcher.queued + (1 if s.predictor.runs else 0) < 11 and time.monotonic() < deadline:
            time.sleep(0.01)  # the 12 are in their handlers (one inside the held run, the rest queued)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            stub.Classify(pb.ClassifyRequest(texts=["de trop"]), timeout=10)
        refused_after = time.monotonic() - start
        held.release()
        assert all(len(f.result().results) == 1 for f in accepted)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Concurrent RPC limit" in info.value.details() and refused_after < 2
