"""A plain HTTP/1.1 client for the HTTP tests (the standard library's http.client: nothing between the test and the
wire), and raw sockets for the hostile ones. Imported by tests/test_http_*.py."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


def call(port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
         tls: ssl.SSLContext | None = None, timeout: float = 30.0, source: str | None = None) -> Reply:
    """One request on a new connection (from the local address `source`); `body` as JSON unless bytes (then sent
    as is)."""
    headers = dict(headers or {})
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    bind = (source, 0) if source else None
    conn = (http.client.HTTPSConnection("127.0.0.1", port, context=tls, timeout=timeout, source_address=bind) if tls
            else http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=bind))
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


def classify(port: int, texts: list[str], headers: dict[str, str] | None = None, **kw: Any) -> Reply:
    return call(port, "POST", "/v1/classify", {"texts": texts}, headers, **kw)


def infer_body(texts: list[str], **extra: Any) -> dict:
    return {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [len(texts)], "data": texts}], **extra}


def raw_exchange(port: int, data: bytes, read_for: float = 5.0, pause: float = 0.0) -> bytes:
    """Send `data` on a new socket, then read until the server closes or `read_for` s pass; everything read."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_for) as s:
        s.sendall(data)
        if pause:
            time.sleep(pause)
        return read_all(s, read_for)


def read_all(s: socket.socket, seconds: float) -> bytes:
    """Bytes until the peer closes or `seconds` pass."""
    out, end = b"", time.monotonic() + seconds
    while time.monotonic() < end:
        s.settimeout(max(0.01, end - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return out


def closed(s: socket.socket, seconds: float) -> bool:
    """True when the peer closes `s` within `seconds` (what it sent before is ignored)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.settimeout(max(0.01, end - time.monotonic()))
        try:
            if not s.recv(65536):
                return True
        except TimeoutError:
            return False
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False
