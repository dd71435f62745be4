"""The HTTP listener: uvicorn (the httptools parser; uvloop when installed) on an event loop in a thread of its own,
inside the server process beside gRPC, on `http_port` (shared with the other workers of serving/process/workers.py
through SO_REUSEPORT, as gRPC's port is). HTTP/1.1, keep-alive and pipelining; TLS and mutual TLS from the gRPC
port's files.

Bounds of its own, before a call reaches serving/protocols/http/exchange.py (uvicorn with httptools sets none of the
first three): a request's line and headers at most MAX_HEAD_BYTES and MAX_HEADERS headers (else 431, connection
closed), arriving within body_timeout_s of their first byte, or of the connection's start (else 408, closed); a
connection idle for max_connection_idle_s is closed; past max_connections connections or calls in progress, uvicorn
answers 503. Per-address limits are the front proxy's (deploy/proxy/). uvicorn's own lines (one warning per invalid
request) are rate-limited like the server's per-call lines (serving/telemetry/logs.py, ClientCausedLines).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from serving.config import ServerConfig
from serving.errors import ServerConfigError
from serving.telemetry.logs import ClientCausedLines

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024  # request line + header names and values (a long bearer token fits many times)
MAX_HEADERS = 100
_uvicorn_lines = ClientCausedLines()  # "Invalid HTTP request received." for every malformed request


class _HeadTooLarge(Exception):
    pass


def _loop_factory() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # optional: asyncio's own loop serves too, slower
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _BoundedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on each request's head, in bytes, headers and time."""

    head_timeout_s = 10.0  # set per server (body_timeout_s)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = self._headers_seen = 0
        self._too_large = False
        super().connection_made(transport)
        self._arm()  # a connection that sends nothing is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self._reply_and_close(408, b"request headers not received within body_timeout_s")

    def _reply_and_close(self, status: int, message: bytes) -> None:
        self.transport.write(STATUS_LINE[status] + b"content-type: text/plain; charset=utf-8\r\ncontent-length: "
                             + str(len(message)).encode() + b"\r\nconnection: close\r\n\r\n" + message)
        self.transport.close()

    def _count(self, nbytes: int, headers: int = 0) -> None:
        self._head_bytes += nbytes
        self._headers_seen += headers
        if self._head_bytes > MAX_HEAD_BYTES or self._headers_seen > MAX_HEADERS:
            self._too_large = True
            raise _HeadTooLarge  # out of the parser as an HttpParserError: send_400_response below

    def on_message_begin(self) -> None:
        self._head_bytes = self._headers_seen = 0
        self._arm()
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value), 1)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if self._too_large:
            self._reply_and_close(431, f"request line and headers over {MAX_HEAD_BYTES} bytes or {MAX_HEADERS} "
                                  "headers".encode())
        else:
            super().send_400_response(msg)


class HttpServer:
    """Binds in the constructor (ServerConfigError naming the port when it is taken); serves `app` from `start()`
    until `stop()`."""

    def __init__(self, app: Any, cfg: ServerConfig, port: int, shared_port: bool = False) -> None:
        """shared_port: one of several worker processes on `port` (SO_REUSEPORT)."""
        family, kind, proto, _, address = socket.getaddrinfo(cfg.host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        self._socket = socket.socket(family, kind, proto)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if shared_port:
                self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            self._socket.bind(address)
        except OSError as e:
            self._socket.close()
            raise ServerConfigError(f"cannot listen on {cfg.host}:{port} (HTTP): {e.strerror or e}") from None
        self.port: int = self._socket.getsockname()[1]
        protocol = type("Protocol", (_BoundedProtocol,), {"head_timeout_s": cfg.body_timeout_s})
        tls = {}
        if cfg.tls_cert:
            tls = {"ssl_certfile": cfg.tls_cert, "ssl_keyfile": cfg.tls_key, "ssl_ca_certs": cfg.tls_client_ca,
                   "ssl_cert_reqs": ssl.CERT_REQUIRED if cfg.tls_client_ca else ssl.CERT_NONE}
        config = uvicorn.Config(
            app, http=protocol, loop="none", lifespan="off", log_config=None, access_log=False,
            server_header=False, timeout_keep_alive=cfg.max_connection_idle_s, limit_concurrency=cfg.max_connections,
            backlog=1024, timeout_graceful_shutdown=cfg.grace_s, **tls)
        try:
            config.load()
        except (ssl.SSLError, OSError) as e:  # the gRPC port's check names the files; this is a safety net
            self._socket.close()
            raise ServerConfigError(f"HTTP TLS: {e}") from None
        self._server = uvicorn.Server(config)
        _uvicorn_lines.attach("uvicorn.error")
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        self._loop = loop = _loop_factory()
        try:
            loop.run_until_complete(self._server.serve(sockets=[self._socket]))
        finally:
            loop.close()

    def start(self) -> None:
        self._socket.listen(1024)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, close idle connections, let calls in progress finish (up to grace_s), stop."""
        if self._thread.is_alive():
            self._server.should_exit = True
            self._thread.join(self._server.config.timeout_graceful_shutdown + 5)
        self._socket.close()

