"""Hand-built HTTP/2 clients that behave as an attacker would, for the attack tests (tests/test_reliability_attacks.py).

A gRPC library client always sends its request body and reads its responses; these do not:
  - `HalfOpen`: one connection, many gRPC streams whose HEADERS are sent and whose body (DATA) never is;
  - `Unread`: one connection that sends whole requests but never lets the server send a response byte
    (HTTP/2 flow-control window 0), so that every response stays queued in the server;
  - `Raw`: frames written by hand at full speed (PING floods, rapid reset, WINDOW_UPDATE past 2^31-1), no rule
    obeyed, what comes back counted.
Built on the `h2` package (HTTP/2 framing and HPACK only: every frame is chosen here). A reader thread answers
the server's PINGs and SETTINGS and records how each stream ended.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
import time
from pathlib import Path
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings


def _close(sock: socket.socket, reader: threading.Thread) -> None:
    """Shut the socket down both ways (the reader then sees its end), close it, and let the reader finish."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
    if reader.is_alive():
        reader.join(5)


class _Connection:
    """An h2 client connection on a real socket, with a reader thread that records each stream's end."""

    def __init__(self, port: int, *, tls_ca: Path | None = None, window: int | None = None,
                 source: str | None = None) -> None:
        raw = socket.create_connection(("127.0.0.1", port), timeout=10,
                                       source_address=(source, 0) if source else None)
        if tls_ca is not None:
            context = ssl.create_default_context(cafile=str(tls_ca))
            context.set_alpn_protocols(["h2"])
            raw = context.wrap_socket(raw, server_hostname="localhost")
        raw.settimeout(None)
        self.sock = raw
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        if window is not None:  # the window the server may send into on each stream (0 = not one byte)
            self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.lock = threading.Lock()
        self.ended: dict[int, str] = {}  # stream id -> grpc-status (or "RST <code>") once it ended
        self.messages: dict[int, str] = {}  # stream id -> grpc-message of its end
        self.resets: dict[int, int] = {}  # stream id -> the error code of an RST_STREAM received, even after its end
        self.max_streams: int | None = None  # the server's SETTINGS_MAX_CONCURRENT_STREAMS
        self.pings_acked = 0
        self.closed = threading.Event()
        self._changed = threading.Condition()
        self._flush()
        self._reader = threading.Thread(target=self._read, daemon=True)

    def start_reading(self) -> None:
        self._reader.start()

    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def _read(self) -> None:
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                with self.lock:
                    events = self.h2.receive_data(data)
                    for e in events:
                        self._on(e)
                    self._flush()
                with self._changed:
                    self._changed.notify_all()
        except (OSError, h2.exceptions.ProtocolError):
            pass
        finally:
            self.closed.set()
            with self._changed:
                self._changed.notify_all()

    def _on(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RemoteSettingsChanged):
            changed = event.changed_settings.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS)
            if changed is not None:
                self.max_streams = changed.new_value
        elif isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            headers = dict(event.headers)
            if "grpc-status" in headers:
                self.ended[event.stream_id] = headers["grpc-status"]
                self.messages[event.stream_id] = unquote(headers.get("grpc-message", ""))
        elif isinstance(event, h2.events.StreamReset):
            self.ended.setdefault(event.stream_id, f"RST {int(event.error_code)}")
            self.resets[event.stream_id] = int(event.error_code)
        elif isinstance(event, h2.events.PingAckReceived):
            self.pings_acked += 1

    def open_stream(self, path: str, metadata: list[tuple[str, str]] = (), end: bool = False) -> int:
        """Send the HEADERS of one gRPC call (no deadline); returns the stream id."""
        with self.lock:
            sid = self.h2.get_next_available_stream_id()
            headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"),
                       ("content-type", "application/grpc"), ("te", "trailers"), *metadata]
            self.h2.send_headers(sid, headers, end_stream=end)
            self._flush()
        return sid

    def ping(self, timeout: float = 10.0) -> bool:
        """A PING; True once it is acknowledged: the other side has read every frame sent before it."""
        with self.lock:
            sent = self.pings_acked
            self.h2.ping(b"barrier!")
            self._flush()
        return self.wait(lambda: self.pings_acked > sent, timeout)

    def send_message(self, sid: int, message: bytes, timeout: float = 60.0) -> None:
        """The gRPC body: one length-prefixed message, then the end of the stream (as fast as the server's
        flow-control windows allow: the reader thread applies its WINDOW_UPDATEs). A stream the server ends first
        (a refusal at admission, answered before the body is read) gets no more of it, as a gRPC client does."""
        body = b"\x00" + struct.pack(">I", len(message)) + message
        while body:
            with self.lock:
                if sid in self.ended:  # h2 may keep a closed stream's window (0) until it cleans it up
                    return  # answered: its status is in its trailers
                try:
                    n = min(len(body), self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
                    if n:
                        self.h2.send_data(sid, body[:n], end_stream=n == len(body))
                        body = body[n:]
                        self._flush()
                except h2.exceptions.StreamClosedError:
                    return  # answered: its status is in its trailers
            if not n and not self.wait(lambda: self._window_opened(sid), timeout):
                raise TimeoutError(f"stream {sid}: the server's flow-control window stayed closed")

    def _window_opened(self, sid: int) -> bool:
        """Whether stream `sid` may send again: its window opened, or the server ended it (the loop then stops)."""
        try:
            return sid in self.ended or self.h2.local_flow_control_window(sid) > 0
        except h2.exceptions.StreamClosedError:
            return True

    def wait(self, condition, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: condition() or self.closed.is_set(), timeout)

    def close(self) -> None:
        """Closes the socket (the server sees every open stream cancelled)."""
        _close(self.sock, self._reader)


class HalfOpen(_Connection):
    """`n` streams to `path` on one connection: HEADERS only, the body never sent, no deadline."""

    def __init__(self, port: int, path: str, n: int, *, tls_ca: Path | None = None,
                 metadata: list[tuple[str, str]] = (), source: str | None = None) -> None:
        super().__init__(port, tls_ca=tls_ca, source=source)
        # All sent before the server's SETTINGS are read: h2 would otherwise keep to the server's
        # MAX_CONCURRENT_STREAMS itself, and an attacker does not.
        self.streams = [self.open_stream(path, metadata) for _ in range(n)]
        self.start_reading()

    @property
    def open_count(self) -> int:
        """Streams the server has not ended (it still holds them)."""
        with self.lock:
            return sum(sid not in self.ended for sid in self.streams)


class Unread(_Connection):
    """Whole requests sent, responses never read: the server may not send one byte of DATA (window 0)."""

    def __init__(self, port: int, *, tls_ca: Path | None = None, source: str | None = None) -> None:
        super().__init__(port, tls_ca=tls_ca, window=0, source=source)
        self.start_reading()

    def call(self, path: str, message: bytes, metadata: list[tuple[str, str]] = ()) -> int:
        sid = self.open_stream(path, metadata)
        self.send_message(sid, message)
        return sid


# ------------------------------------------------------------------------------------- raw frames, at full speed

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
CANCEL, FLOW_CONTROL_ERROR, ENHANCE_YOUR_CALM = 0x8, 0x3, 0xB
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 9 octets of header (length 24 bits, type, flags, stream id 31 bits), then the payload."""
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def request_block(path: str, metadata: list[tuple[str, str]] = ()) -> bytes:
    """The HPACK block of a gRPC call's HEADERS, encoded once by a fresh encoder: it refers to no entry of the
    dynamic table, so the same bytes are valid on any stream, any number of times."""
    import hpack

    return hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                   (":authority", "localhost"), ("content-type", "application/grpc"),
                                   ("te", "trailers"), *metadata])


class Raw:
    """An HTTP/2 client connection that writes frames built by hand, as fast as the socket takes them, and obeys
    nothing (no flow control, no stream limit, no GOAWAY). A reader thread acknowledges the server's SETTINGS and
    counts what comes back: frames by type, PING acknowledgements before and after a GOAWAY, the GOAWAY's error
    code and when it came, and when the server closed the connection."""

    def __init__(self, port: int, *, tls_ca: Path | None = None, settings: dict[int, int] | None = None,
                 host: str = "127.0.0.1", source: str | None = None, timeout: float = 10.0) -> None:
        """source: the local address to connect from (another loopback address, 127.0.0.2, stands for another
        machine: the server's limits and bans are per address)."""
        raw = socket.create_connection((host, port), timeout=timeout,
                                       source_address=(source, 0) if source else None)
        if tls_ca is not None:
            context = ssl.create_default_context(cafile=str(tls_ca))
            context.set_alpn_protocols(["h2"])
            raw = context.wrap_socket(raw, server_hostname="localhost")
        self.sock = raw
        self.sock.settimeout(None)
        self._send_lock = threading.Lock()
        self.received: dict[int, int] = {}  # frame type -> count
        self.acks = 0  # PING acknowledgements received
        self.acks_after_goaway = 0
        self.goaway_code: int | None = None
        self.goaway_at: float | None = None  # time.monotonic()
        self.closed_at: float | None = None  # time.monotonic() when the server's side ended (EOF or reset)
        self.reset_streams: dict[int, int] = {}  # stream id -> RST_STREAM error code received
        self.closed = threading.Event()
        body = b"".join(struct.pack(">HI", k, v) for k, v in (settings or {}).items())
        self.send(PREFACE + frame(SETTINGS, 0, 0, body))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def wait_settings(self, timeout: float = 10.0) -> bool:
        """True once the server's SETTINGS have arrived (and been acknowledged): gRPC closes a connection that
        floods before that itself."""
        end = time.monotonic() + timeout
        while not self.received.get(SETTINGS) and not self.closed.is_set() and time.monotonic() < end:
            time.sleep(0.005)
        return bool(self.received.get(SETTINGS))

    def send(self, data: bytes) -> bool:
        """Write bytes; False once the server has closed the connection, or when the socket's timeout passed (the
        server no longer reads: not a close)."""
        try:
            with self._send_lock:
                self.sock.sendall(data)
            return True
        except TimeoutError:
            return False
        except OSError:
            self._closed()
            return False

    def _closed(self) -> None:
        if self.closed_at is None:
            self.closed_at = time.monotonic()
        self.closed.set()

    def _read(self) -> None:
        buffer = b""
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    break
                buffer += data
                while len(buffer) >= 9:
                    length = int.from_bytes(buffer[:3], "big")
                    if len(buffer) < 9 + length:
                        break
                    kind, flags, stream = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                    payload, buffer = buffer[9:9 + length], buffer[9 + length:]
                    self._on(kind, flags, stream, payload)
        except (OSError, ValueError):
            pass
        finally:
            self._closed()

    def _on(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        self.received[kind] = self.received.get(kind, 0) + 1
        if kind == SETTINGS and not flags & ACK:
            self.send(frame(SETTINGS, ACK, 0))
        elif kind == PING and flags & ACK:
            self.acks += 1
            if self.goaway_at is not None:
                self.acks_after_goaway += 1
        elif kind == GOAWAY and self.goaway_at is None:
            self.goaway_at = time.monotonic()
            self.goaway_code = int.from_bytes(payload[4:8], "big")
        elif kind == RST_STREAM:
            self.reset_streams[stream] = int.from_bytes(payload[:4], "big")

    def close(self) -> None:
        _close(self.sock, self._reader)
