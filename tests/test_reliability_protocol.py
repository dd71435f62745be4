"""Protocol-level abuse against the real server (docs/RELIABILITY.md, "Protocol attacks"), each test one attack of
bench/protocol_attacks.py made small. Per-address attacks (floods, resets, wrong tokens, connections per address)
are the front proxy's to stop (tests/test_edge.py runs them through deploy/proxy); the server keeps what only it can
do:

  - WINDOW_UPDATE past 2^31-1: gRPC does not answer FLOW_CONTROL_ERROR; the server keeps serving;
  - connections beyond max_connections: gRPC closes them at accept;
  - a full server refuses a call at admission, before its body is read, and a call its queue cannot take before
    its texts are tokenized; under an overload, calls are refused at once rather than after queueing;
  - every bad start is one line and exit 2; a server beyond loopback warns.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from hostile import WINDOW_UPDATE, HalfOpen, Raw, Unread, frame
from procs import REPO
from serving_fixtures import (
    HeldRuns,
    ServerProcess,
    certs,
    flood_and_one_more_are_refused,
    running_server,
    target,
    wait_until,
)

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc

TOKEN = "protocol-token-0123456789abcdef"
GOOD = [("authorization", f"Bearer {TOKEN}")]
CLASSIFY = "/sentiment.v1.SentimentService/Classify"
ATTACKER = "127.0.0.2"
__all__ = ["certs"]  # a fixture


def _served(channel: grpc.Channel) -> float:
    """An authorised Classify from 127.0.0.1 is answered; its latency in seconds."""
    start = time.monotonic()
    answer = pb_grpc.SentimentServiceStub(channel).Classify(pb.ClassifyRequest(texts=["Un bon livre."]), timeout=10,
                                                            metadata=GOOD)
    assert len(answer.results) == 1
    return time.monotonic() - start


def test_a_window_update_past_the_limit_does_no_harm(tiny_bundle: Path) -> None:
    """RFC 9113 6.9.1: a WINDOW_UPDATE that takes the connection window past 2^31-1 is a FLOW_CONTROL_ERROR.
    gRPC (1.85) answers nothing; what matters here: it costs nothing, and the server goes on serving everyone."""
    with running_server(tiny_bundle, device="cpu", auth_token=TOKEN) as s, \
            grpc.insecure_channel(target(s)) as channel:
        c = Raw(s.port, source=ATTACKER)
        try:
            time.sleep(0.3)
            c.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)) * 4)
            time.sleep(0.5)
            assert _served(channel) < 1.0
        finally:
            c.close()


def test_connections_beyond_max_connections_are_closed_at_accept(tiny_bundle: Path) -> None:
    """12 connections from four addresses with max_connections 8: gRPC keeps the first 8 and closes the rest."""
    with running_server(tiny_bundle, device="cpu", max_connections=8) as s:
        many = [Raw(s.port, source=f"127.0.0.{3 + i % 4}") for i in range(12)]
        try:
            wait_until(lambda: sum(c.closed.is_set() for c in many) == 4, 10, "4 connections closed by gRPC")
            assert not any(c.closed.is_set() for c in many[:8])
        finally:
            for c in many:
                c.close()


# ------------------------------------------------------------------------------------- admission


def test_a_full_queue_refuses_at_admission_before_the_body_is_read(tiny_bundle: Path) -> None:
    """The batching queue without room for a request of max_texts (4 texts wait, max_queue 6, max_texts 4, its one
    worker held inside a run): a call that sends its headers and never its body is refused RESOURCE_EXHAUSTED at
    once, and so is a call of one text, which would have fit: a call's size is known only once its body is read,
    and admission does not wait for it. Before, the first was admitted, waited for its body (up to body_timeout_s,
    600 s here), then was tokenized, and only then refused."""
    with running_server(tiny_bundle, device="cpu", batch_workers=1, max_queue=6, max_texts=4,
                        body_timeout_s=600) as s, grpc.insecure_channel(target(s)) as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10)
        with HeldRuns(s) as held:
            running = stub.Classify.future(pb.ClassifyRequest(texts=["dans le calcul"]), timeout=60)
            assert held.wait_entered()
            queued = stub.Classify.future(pb.ClassifyRequest(texts=["a", "b", "c", "d"]), timeout=60)
            wait_until(lambda: s.core.batcher.queued == 4, what="4 texts queued")
            late = HalfOpen(s.port, CLASSIFY, 1)
            try:
                assert late.wait(lambda: late.open_count == 0, 10), "the call waited for its body"
                assert list(late.ended.values()) == ["8"]  # RESOURCE_EXHAUSTED
                # worded as the batcher's own refusal, with its figures (bench/soak.py tells the two apart by them)
                message = next(iter(late.messages.values()))
                assert "queue full: 4 texts waiting, no room for a request of up to 4 texts (max_queue 6)" in message
            finally:
                late.close()
            with pytest.raises(grpc.RpcError) as refused:
                stub.Classify(pb.ClassifyRequest(texts=["un"]), timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "no room for a request of up to 4 texts" in refused.value.details()
        assert len(running.result().results) == 1 and len(queued.result().results) == 4


def test_a_call_refused_while_its_body_is_on_its_way_ends_at_once(tiny_bundle: Path) -> None:
    """The queue full, a call whose body is larger than a stream's window (64 KiB) is refused at admission while its
    client still sends it: its stream ends RESOURCE_EXHAUSTED with the rest of the body unsent, the connection stays
    open. The hostile client of the memory test (tests/hostile.py `send_message`) once raised StreamClosedError here,
    waiting for a window on a stream the server had already ended (make test, 2026-11-27)."""
    with running_server(tiny_bundle, device="cpu", batch_workers=1, max_queue=4, max_texts=4) as s, \
            grpc.insecure_channel(target(s)) as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        with HeldRuns(s) as held:
            running = stub.Classify.future(pb.ClassifyRequest(texts=["dans le calcul"]), timeout=60)
            assert held.wait_entered()
            queued = stub.Classify.future(pb.ClassifyRequest(texts=["a", "b", "c", "d"]), timeout=60)
            wait_until(lambda: s.core.batcher.queued == 4, what="the queue full")
            client = Unread(s.port)
            try:
                big = pb.ClassifyRequest(texts=["mot " * 12_000] * 4).SerializeToString()  # 192 KB: 3 windows
                sid = client.call(CLASSIFY, big)
                assert client.wait(lambda: sid in client.ended, 10), "the call was not answered"
                assert client.ended[sid] == "8"  # RESOURCE_EXHAUSTED
                assert not client.closed.is_set()
            finally:
                client.close()
        assert len(running.result().results) == 1 and len(queued.result().results) == 4

def test_a_call_the_queue_cannot_take_is_refused_before_its_texts_are_tokenized(tiny_bundle: Path) -> None:
    """A call admitted while the queue had room for a request of max_texts (max_queue 8, max_texts 4, the one
    worker held inside a run) sends its body of 2 texts only once 7 texts have filled the queue behind it: they do
    not fit. It is refused with the batcher's figures before its texts are tokenized; before, they were tokenized
    first, work thrown away at `submit`."""
    with running_server(tiny_bundle, device="cpu", batch_workers=1, max_queue=8, max_texts=4) as s, \
            grpc.insecure_channel(target(s)) as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=10)
        encoded: list[int] = []
        encode = s.core.predictor.encode
        s.core.predictor.encode = lambda texts: encoded.append(len(texts)) or encode(texts)
        with HeldRuns(s) as held:
            running = stub.Classify.future(pb.ClassifyRequest(texts=["dans le calcul"]), timeout=60)
            assert held.wait_entered()
            late = HalfOpen(s.port, CLASSIFY, 1)  # admitted: no text waits yet
            try:
                wait_until(lambda: s.admission.in_progress == 2, what="the late call admitted")
                queued = [stub.Classify.future(pb.ClassifyRequest(texts=list(texts)), timeout=60)
                          for texts in ("abcd", "efg")]
                wait_until(lambda: s.core.batcher.queued == 7, what="7 texts queued")
                (sid,) = late.streams
                late.send_message(sid, pb.ClassifyRequest(texts=["trop", "tard"]).SerializeToString())
                assert late.wait(lambda: sid in late.ended, 10), "the late call was not answered"
                assert late.ended[sid] == "8"  # RESOURCE_EXHAUSTED
                assert "queue full: 7 texts waiting + 2 new > max_queue 8" in late.messages[sid]
            finally:
                late.close()
            assert sorted(encoded) == [1, 3, 4], "the refused call's texts were tokenized"
        assert len(running.result().results) == 1 and [len(q.result().results) for q in queued] == [4, 3]


def test_an_overload_is_refused_at_admission_not_after_queueing(tiny_bundle: Path) -> None:
    """An overload made here rather than raced against the machine: the one batch worker held inside a run
    (HeldRuns) and the queue behind it filled to where it has no room for a request of max_texts (4 texts waiting,
    max_queue 6, max_texts 4). A flood of 200 calls of 4 texts at once on 4 connections, and the authorised client's
    call of one text on its own: every one is refused RESOURCE_EXHAUSTED at admission (the batcher's wording for a
    refusal before the body is read, none after it) while the run is still held, so none queued behind the model,
    and the calls in progress are still the two. Released, those two are answered. (Before admission asked for room
    for a full request, the load's 64-text calls were admitted, read, parsed and only then refused; before that,
    calls waited seconds in gRPC's queue: docs/RELIABILITY.md, "Overload".)"""
    with running_server(tiny_bundle, device="cpu", auth_token=TOKEN, batch_workers=1, max_queue=6,
                        max_texts=4) as s:
        channels = [grpc.insecure_channel(target(s), options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(5)]
        try:
            stubs = [pb_grpc.SentimentServiceStub(c) for c in channels]
            _served(channels[0])
            with HeldRuns(s) as held:
                running = stubs[0].Classify.future(pb.ClassifyRequest(texts=["dans le calcul"]), timeout=60,
                                                   metadata=GOOD)
                assert held.wait_entered()
                queued = stubs[0].Classify.future(pb.ClassifyRequest(texts=["a", "b", "c", "d"]), timeout=60,
                                                  metadata=GOOD)
                wait_until(lambda: s.core.batcher.queued == 4, what="4 texts queued")
                load = pb.ClassifyRequest(texts=["Un livre, assez long pour compter."] * 4)
                flood_and_one_more_are_refused(stubs, load, GOOD, pb.ClassifyRequest(texts=["un"]),
                                               "no room for a request of up to 4 texts")
                assert s.admission.in_progress == 2 and not running.done() and not queued.done()
            assert len(running.result().results) == 1 and len(queued.result().results) == 4
        finally:
            for c in channels:
                c.close()


# ------------------------------------------------------------------------------------- bad starts


def _start(bundle: Path | str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m serving.server` to its end, without the capabilities that let root read any file (so that a
    file of another owner with mode 0600 is as unreadable to it as to any other user): as root, started by util-linux's
    `setpriv` with an empty capability bounding set, which root's exec then takes its capabilities from (no
    CAP_DAC_OVERRIDE, no CAP_DAC_READ_SEARCH). Not a `preexec_fn`: that forks this process, in which gRPC runs (the
    in-process servers of other tests), and runs Python in the child, where gRPC's fork handlers most likely aborted it
    (SIGABRT, "epoll_wait error: Bad file descriptor", make test 2026-11-27)."""
    metrics = [] if "--metrics-port" in args else ["--no-metrics"]
    # HTTP on a port of its own: the default 8000 may be another test's (CI 2026-11-28: a taken 8000 was the error)
    http = [] if {"--http-port", "--no-http"} & set(args) else ["--http-port", "0"]
    drop = ["setpriv", "--bounding-set=-all", "--"] if os.geteuid() == 0 else []
    cmd = [*drop, sys.executable, "-m", "serving.server", str(bundle), "--port", "0", *metrics, "--device", "cpu",
           *http, *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _unreadable(path: Path, mode: int) -> None:
    """Owned by another user (nobody) with `mode`: unreadable to the server's user."""
    os.chown(path, 65534, 65534)
    path.chmod(mode)


def _one_line_exit_2(out: subprocess.CompletedProcess[str], *names: str) -> None:
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert out.returncode == 2 and len(errors) == 1, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr and all(n in errors[0] for n in names), errors


@pytest.mark.parametrize("damage", ["folder 0700", "model 0600", "missing folder"])
def test_an_unreadable_or_missing_bundle_is_one_line(tiny_bundle: Path, tmp_path: Path, damage: str) -> None:
    """Files of another owner the server may not read. Before: the 0700 folder gave a PermissionError traceback
    from contract/bundle.py, exit 1."""
    bundle = Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))
    if damage == "missing folder":
        shutil.rmtree(bundle)
    elif os.geteuid() != 0:
        pytest.skip("changes a file's owner (root only)")
    elif damage == "folder 0700":
        _unreadable(bundle, 0o700)
    else:
        _unreadable(bundle / "model.onnx", 0o600)
    _one_line_exit_2(_start(bundle), str(bundle))


@pytest.mark.parametrize("bad", ["garbage cert", "key of another certificate", "unreadable key", "garbage CA"])
def test_bad_tls_files_are_one_line(tiny_bundle: Path, certs: dict[str, Path], tmp_path: Path, bad: str) -> None:
    """Before: a file that is not PEM, or a key that is not the certificate's, started the server (gRPC failed at
    the first handshake, or its C core aborted); an unreadable one was a PermissionError traceback."""
    cert, key, ca = certs["server"], certs["server_key"], None
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    if bad == "garbage cert":
        cert = garbage
    elif bad == "key of another certificate":
        key = certs["client_key"]
    elif bad == "garbage CA":
        ca = garbage
    else:
        if os.geteuid() != 0:
            pytest.skip("changes a file's owner (root only)")
        key = Path(shutil.copy(key, tmp_path / "key.pem"))
        _unreadable(key, 0o600)
    args = ["--tls-cert", str(cert), "--tls-key", str(key), *(["--tls-client-ca", str(ca)] if ca else [])]
    _one_line_exit_2(_start(tiny_bundle, *args), "tls_")


def test_a_taken_port_is_one_line_and_binds_nothing_else(tiny_bundle: Path) -> None:
    """The gRPC port taken: exit 2 naming it, and the health port given beside it is free again at once (each port
    is bound once by its listener, and released when a later one fails)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            health = probe.getsockname()[1]
        out = _start(tiny_bundle, "--health-port", str(health), "--metrics-port", str(taken))
        _one_line_exit_2(out, f"127.0.0.1:{taken}", "metrics")
        with socket.socket() as again:
            again.bind(("127.0.0.1", health))


def test_serving_beyond_loopback_warns_once_of_each_missing_protection(tiny_bundle: Path) -> None:
    """Beyond loopback: one warning without a front proxy (naming the command that puts it in front), one without
    a token or TLS; with --workers 2, still once each (the parent's), not once per process."""
    server = ServerProcess(tiny_bundle, "--device", "cpu", "--host", "0.0.0.0", "--workers", "2")
    try:
        server.wait_listening()
        assert server.log.count("with neither a bearer token nor TLS") == 1, server.log
        assert server.log.count("without a front proxy") == 1, server.log
        assert "docker compose up -d" in server.log and "podman-compose up -d" in server.log
    finally:
        server.close()
    quiet = ServerProcess(tiny_bundle, "--device", "cpu", "--host", "0.0.0.0", "--behind-proxy",
                          env={"SENTIMENT_AUTH_TOKEN": TOKEN})
    try:
        quiet.wait_listening()
        assert "neither a bearer token nor TLS" not in quiet.log and "without a front proxy" not in quiet.log
    finally:
        quiet.close()
