"""bench/protocol_attacks.py's attacks on time limits: connections that idle, never send a byte, send their headers
a byte a second, withhold their bodies, or never read their answers."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable
from pathlib import Path

from attacks import ATTACKER, AUTH, CLASSIFY


def idle(port: int, seconds: float, tls_ca: Path | None, count: int = 500, sources: list[str] | None = None) -> dict:
    """`count` connections that finish the handshake and idle for `seconds`, from `sources` in turn (100 from each
    before the next: the proxy's CONNS_PER_SOURCE); how many were kept."""
    from hostile import Raw

    sources = sources or [ATTACKER]
    start = time.monotonic()
    conns = []
    for i in range(count):
        try:
            conns.append(Raw(port, tls_ca=tls_ca, source=sources[min(i // 100, len(sources) - 1)], timeout=2))
        except OSError:
            break
    time.sleep(max(0.0, seconds - (time.monotonic() - start)))
    kept = sum(not c.closed.is_set() for c in conns)
    for c in conns:
        c.close()
    return {"opened": len(conns), "kept_after_s": round(time.monotonic() - start, 1), "kept": kept}


def idle_many(port: int, seconds: float, tls_ca: Path | None) -> dict:
    """1,000 idle connections from 10 addresses, 100 each: what that many connections cost."""
    return idle(port, seconds, tls_ca, 1000, [f"127.0.0.{2 + k}" for k in range(10)])


def _watch_closes(socks: list[socket.socket], seconds: float, start: float,
                  tick: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds after `start` at which the other side closed each socket (its EOF or reset), within `seconds`;
    `tick()` runs every 0.1 s meanwhile."""
    closed: dict[int, float] = {}
    poller = select.poll()
    by_fd = {s.fileno(): s for s in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    while time.monotonic() - start < seconds and len(closed) < len(socks):
        for fd, _ in poller.poll(100):
            try:
                data = by_fd[fd].recv(65536)
            except OSError:
                data = b""
            if not data:
                closed[fd] = time.monotonic() - start
                poller.unregister(fd)
        tick()
    return sorted(closed.values())


def _closes(closed: list[float], opened: int, seconds: float) -> dict:
    return {"opened": opened, "closed": len(closed), "within_s": round(seconds, 1),
            "first_closed_s": round(closed[0], 2) if closed else None,
            "median_closed_s": round(closed[len(closed) // 2], 2) if closed else None}


def _connect(port: int, count: int, tls_ca: Path | None, handshake: bool) -> list[socket.socket]:
    """`count` connections from the attacker's address (TLS completed when `handshake` and tls_ca), until one is not
    accepted."""
    import ssl

    socks = []
    for _ in range(count):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2, source_address=(ATTACKER, 0))
            if tls_ca is not None and handshake:
                context = ssl.create_default_context(cafile=str(tls_ca))
                context.set_alpn_protocols(["h2"])
                s = context.wrap_socket(s, server_hostname="localhost")
        except OSError:
            break
        socks.append(s)
    return socks


def half_open(port: int, seconds: float, tls_ca: Path | None) -> dict:
    """500 TCP connections that never send a byte (not even a TLS hello): when the other side closes them."""
    start = time.monotonic()
    socks = _connect(port, 500, tls_ca, handshake=False)
    out = _closes(_watch_closes(socks, seconds, start), len(socks), seconds)
    for s in socks:
        s.close()
    return out


def slow_headers(port: int, seconds: float, tls_ca: Path | None) -> dict:
    """100 connections, each a call's HEADERS without END_HEADERS, then its header block one byte of CONTINUATION a
    second (each byte resets an inactivity timeout): when the other side closes them."""
    from hostile import HEADERS, PREFACE, SETTINGS, frame, request_block

    block = request_block(CLASSIFY, AUTH)
    start = time.monotonic()
    socks = _connect(port, 100, tls_ca, handshake=True)
    for s in socks:
        try:
            s.sendall(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, 0, 1, block[:1]))
        except OSError:
            pass
    sent = [1]
    next_byte = [time.monotonic() + 1]

    def trickle() -> None:
        if time.monotonic() < next_byte[0] or sent[0] >= len(block):
            return
        for s in socks:
            try:
                s.sendall(frame(0x9, 0, 1, block[sent[0]:sent[0] + 1]))  # CONTINUATION, never END_HEADERS
            except OSError:
                pass
        sent[0] += 1
        next_byte[0] += 1

    out = _closes(_watch_closes(socks, seconds, start, trickle), len(socks), seconds)
    for s in socks:
        s.close()
    return out


def _withheld(port: int, seconds: float, tls_ca: Path | None, metadata: list[tuple[str, str]]) -> dict:
    """Calls whose body never comes, 100 on a connection; once the other side has ended them all (or the
    connection), another connection of 100. Counts the calls and how they ended."""
    from hostile import HalfOpen

    start, conns, codes = time.monotonic(), [], {}
    while time.monotonic() - start < seconds:
        if not conns or conns[-1].open_count == 0 or conns[-1].closed.is_set():
            try:
                conns.append(HalfOpen(port, CLASSIFY, 100, tls_ca=tls_ca, metadata=metadata, source=ATTACKER))
            except OSError:
                time.sleep(0.1)
        time.sleep(0.05)
    for c in conns:
        for code in c.ended.values():
            codes[code] = codes.get(code, 0) + 1
        c.close()
    return {"connections": len(conns), "calls": 100 * len(conns), "stream_ends": codes}


def withheld_body(port: int, seconds: float, tls_ca: Path | None) -> dict:
    return _withheld(port, seconds, tls_ca, AUTH)


def withheld_body_anon(port: int, seconds: float, tls_ca: Path | None) -> dict:
    return _withheld(port, seconds, tls_ca, [])


def zero_window(port: int, seconds: float, tls_ca: Path | None) -> dict:
    from hostile import Unread

    from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb

    message = pb.ClassifyRequest(texts=["Une réponse qui ne partira jamais."]).SerializeToString()
    start = time.monotonic()
    conns = [Unread(port, tls_ca=tls_ca, source=ATTACKER) for _ in range(10)]
    for c in conns:
        for _ in range(100):
            if c.closed.is_set():
                break
            try:
                c.call(CLASSIFY, message, AUTH)
            except (OSError, TimeoutError):
                break
    time.sleep(max(0.0, seconds - (time.monotonic() - start)))
    ended = [c.closed.is_set() for c in conns]
    codes: dict[str, int] = {}
    for c in conns:
        for code in c.ended.values():
            codes[code] = codes.get(code, 0) + 1
        c.close()
    return {"connections_ended": sum(ended), "of": len(conns), "stream_ends": codes,
            "elapsed_s": round(time.monotonic() - start, 2)}

