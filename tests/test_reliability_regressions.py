"""Regression tests for the server bugs that the reliability suites found, one per bug.

1. Callers within the concurrent-RPC limit were refused. gRPC counts an RPC until its handler's thread returns,
   which is after the client has its answer; with the limit equal to the number of callers, a caller that sent its
   next request at once found its previous one still counted and got RESOURCE_EXHAUSTED "Concurrent RPC limit
   exceeded!" (bench/soak.py: 184 of 159k requests at 128 callers, max_workers 128). The server now counts calls
   itself (serving/limits/admission.py) and gives a call's slot back before its answer leaves.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from serving_fixtures import HeldRuns, running_server, target, wait_until

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc


def test_callers_within_the_rpc_limit_are_served_back_to_back(tiny_bundle: Path) -> None:
    """4 callers = max_workers, each sending its next request as soon as the last is answered: never refused. The
    model slot of a call is given back before its answer leaves the server (serving/limits/admission.py's permit), so a
    caller cannot find its own previous call still counted (what gRPC's own count, kept until the handler thread
    returned, did)."""
    callers = 4
    with running_server(tiny_bundle, device="cpu", max_workers=callers) as s, \
            grpc.insecure_channel(target(s)) as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        grpc.channel_ready_future(channel).result(timeout=10)
        barrier, codes = threading.Barrier(callers), []

        def caller(i: int) -> None:
            barrier.wait()
            for k in range(20):
                try:
                    stub.Classify(pb.ClassifyRequest(texts=[f"appel {i}.{k}"]), timeout=10)
                    codes.append("OK")
                except grpc.RpcError as e:
                    codes.append(f"{e.code().name}: {e.details()}")

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert codes == ["OK"] * 20 * callers


def test_past_the_limit_calls_are_refused_at_once_and_a_freed_slot_serves_the_next(tiny_bundle: Path) -> None:
    """max_workers 4: 4 calls are accepted (held: one inside the run, three queued), the 5th is refused at once;
    as soon as one answer has arrived, a new call is accepted."""
    with running_server(tiny_bundle, device="cpu", max_workers=4, batch_workers=1) as s, \
            grpc.insecure_channel(target(s)) as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10)
        held = HeldRuns(s)
        accepted = [stub.Classify.future(pb.ClassifyRequest(texts=[f"retenu {i}"]), timeout=30) for i in range(4)]
        wait_until(lambda: s.admission.in_progress == 4, what="4 calls in progress")
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            stub.Classify(pb.ClassifyRequest(texts=["de trop"]), timeout=10)
        refused_after = time.monotonic() - start
        held.stop_holding()
        held.release()
        assert len(accepted[0].result().results) == 1
        assert len(stub.Classify(pb.ClassifyRequest(texts=["ensuite"]), timeout=10).results) == 1
        assert all(len(f.result().results) == 1 for f in accepted)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4 model calls in progress" in info.value.details() and refused_after < 2
