"""The connection guard's judgement of a connection that gRPC closed itself (serving/guard.py `_flooded`), on real
sockets of this process: a listener the guard watches, a peer from 127.0.0.2, the server's end closed as gRPC closes
a connection after GOAWAY too_many_pings, and the guard's ticks run by hand (no thread, no timing race).

Found under load (docs/RELIABILITY.md, "Protocol attacks"): gRPC may close a PING flood's connection within a tick
or two, before the guard's bucket is half spent; its address was then not banned, and the flooder opened the next
connection at once. A client that sent a request and hung up must not be banned for it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import serving.guard as guard_module
from serving.guard import FLOOD_PERSIST_S, Guard
from serving.metrics import Metrics
from serving.sockets import cut_socket

RATE = 16 * 1024  # max_control_bytes_per_s, the default


@contextmanager
def connection() -> Iterator[tuple[Guard, socket.socket, socket.socket]]:
    """(guard, the peer's socket, the server's end of its connection), the guard not having looked yet."""
    listener = socket.create_server(("127.0.0.1", 0))
    guard = Guard([listener.getsockname()[1]], Metrics(), max_connections_per_peer=100, max_control_bytes_per_s=RATE,
                  max_cancels_per_s=200, send_stall_s=1.0, ban_s=10.0, max_message_bytes=4 * 1024 * 1024)
    peer = socket.socket()
    peer.bind(("127.0.0.2", 0))
    peer.connect(listener.getsockname())
    server_end, _ = listener.accept()
    try:
        yield guard, peer, server_end
    finally:
        for s in (peer, server_end, listener):
            s.close()


@contextmanager
def watched_connection() -> Iterator[tuple[Guard, socket.socket, socket.socket]]:
    """`connection()`, the guard having seen it once (nothing sent yet)."""
    with connection() as (guard, peer, server_end):
        guard.tick()  # first sight
        assert len(guard.connections) == 1
        yield guard, peer, server_end


def _arrived(server_end: socket.socket, size: int) -> None:
    """Wait until `size` bytes wait unread on the server's end (the kernel's count, as the guard reads it)."""
    end = time.monotonic() + 5
    while len(server_end.recv(size, socket.MSG_PEEK)) < size:
        assert time.monotonic() < end, "the bytes did not arrive"
        time.sleep(0.01)


def test_a_flood_that_grpc_closed_before_half_the_bucket_was_spent_is_banned() -> None:
    with watched_connection() as (guard, peer, server_end):
        peer.sendall(b"\0" * 20_000)  # a fifth of a second's flood at 100 kB/s: no call explains it
        _arrived(server_end, 20_000)
        guard.tick()
        assert not guard.banned  # a third of the bucket (64 KiB): not a flood yet
        server_end.close()  # gRPC closes it (GOAWAY too_many_pings)
        guard.tick()
        assert "127.0.0.2" in guard.banned


def test_a_peer_that_sent_a_little_and_hung_up_is_not_banned() -> None:
    with watched_connection() as (guard, peer, server_end):
        peer.sendall(b"\0" * 2_000)  # a few frames: under half a second's allowance
        _arrived(server_end, 2_000)
        guard.tick()
        server_end.close()
        guard.tick()
        assert not guard.banned


def test_a_request_read_after_the_last_look_is_credited_when_its_connection_ends() -> None:
    """A client sends a 20 kB request, is answered and hangs up between two ticks: the guard saw the bytes before
    the gate read (and credited) the message; the credit still counts when the connection is judged gone."""
    with watched_connection() as (guard, peer, server_end):
        peer.sendall(b"\0" * 20_000)
        _arrived(server_end, 20_000)
        guard.tick()
        address, port = peer.getsockname()
        guard.message(f"ipv4:{address}:{port}", 20_000)  # the gate read its message
        server_end.close()
        guard.tick()
        assert not guard.banned


def _calls(guard: Guard, peer: socket.socket, started: int, cancelled: int, premature: bool) -> None:
    """What the gate reports for `started` calls of the peer's connection, `cancelled` of them by their client."""
    address, port = peer.getsockname()
    for _ in range(started):
        guard.call(f"ipv4:{address}:{port}")
    for _ in range(cancelled):
        guard.cancelled(f"ipv4:{address}:{port}", premature=premature)


def test_a_connection_whose_calls_are_mostly_reset_at_once_is_cut_at_a_quarter_of_the_cancel_limit() -> None:
    """Rapid reset with a valid token: 60 calls, all cancelled by the client within a second of their start. Before,
    only more than max_cancels_per_s (200) cancels in a second cut, which a reset flood reached after 0.55 s, and
    an authorised client's calls beside it waited up to 190 ms."""
    with watched_connection() as (guard, peer, _server_end):
        _calls(guard, peer, started=60, cancelled=60, premature=True)
        guard.tick()
        assert "127.0.0.2" in guard.banned
        assert guard.metrics.registry.get_sample_value("sentiment_connections_cut_total", {"reason": "resets"}) == 1


def test_a_client_whose_calls_mostly_complete_or_end_late_is_not_cut_for_its_cancels() -> None:
    with watched_connection() as (guard, peer, _server_end):
        _calls(guard, peer, started=300, cancelled=60, premature=True)  # a fifth of its calls
        guard.tick()
        _calls(guard, peer, started=60, cancelled=60, premature=False)  # cancelled after a second (or by deadline)
        guard.tick()
        assert not guard.banned


def test_a_flood_from_its_first_byte_is_judged_at_first_sight() -> None:
    """Bytes a connection sent before the guard first looked at it count: they were the baseline, and a PING flood
    that started at once was judged a tick later (cut 0.6-0.8 s after it began, about a core busy meanwhile)."""
    with connection() as (guard, peer, server_end):
        peer.sendall(b"\0" * 100_000)  # more than the bucket (64 KiB) before the guard's first look
        _arrived(server_end, 100_000)
        guard.tick()
        assert len(guard.connections) == 1
        (conn,) = guard.connections.values()
        assert conn.empty_since is not None, "the bytes before the first look were not counted"
        time.sleep(FLOOD_PERSIST_S)
        guard.tick()
        assert conn.cut == "flood"
        assert "127.0.0.2" in guard.banned


def test_a_cut_discards_what_the_kernel_queued_for_the_server() -> None:
    """What the peer sent before the cut and the server had not read yet is dropped: gRPC read, decrypted and
    answered that backlog (megabytes of PINGs: a core busy for a second after the cut, over TLS)."""
    with connection() as (_guard, peer, server_end):
        peer.sendall(b"\0" * 100_000)
        _arrived(server_end, 100_000)
        assert cut_socket(server_end.fileno(), os.fstat(server_end.fileno()).st_ino)
        server_end.settimeout(1)
        assert server_end.recv(65536) == b"", "the queued bytes were still there to be read"


def test_a_tick_asks_nothing_again_of_the_sockets_it_knows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each tick reads every descriptor of the process; a socket it has already placed (the watched connection, and
    here the peer's own end, on a port the guard does not watch) is not asked its addresses again. Before, every
    socket but the watched connections was looked at anew at every tick: with 1,000 connections a tick took 24 ms
    (docs/RELIABILITY.md, "What the watching costs")."""
    looked: list[int] = []
    real = guard_module.peer_on
    monkeypatch.setattr(guard_module, "peer_on", lambda fd, ports: looked.append(fd) or real(fd, ports))
    with watched_connection() as (guard, _peer, _server_end):
        guard.tick()
        looked.clear()
        guard.tick()
        assert looked == []
        assert len(guard.connections) == 1
