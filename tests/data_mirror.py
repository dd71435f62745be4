"""A mirror of the data sets' sources on 127.0.0.1, laid out as `data fetch --mirror` reads one (URL/HOST/PATH for a
source https://HOST/PATH), with the faults a real network has: a file cut halfway, a server that stalls, a file that
is not there. It answers HTTP Range requests (206 with Content-Range), as the sources' hosts do, and requests for an
absolute URL, as an HTTP proxy does; it keeps a log of every request (path and Range header), so that a test can
count what was downloaded."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class Mirror:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}  # "/HOST/PATH" -> bytes
        self.cut_once: set[str] = set()  # send half the file once, then close the connection
        self.stall: set[str] = set()  # send half the file, then wait without sending more
        self.log: list[tuple[str, str | None]] = []  # (path, Range header)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add(self, source_url: str, data: bytes) -> str:
        """Serve `data` where the mirror serves `source_url`; returns the mirror's path of it."""
        parts = urlsplit(source_url)
        path = f"/{parts.netloc}{parts.path}"
        self.files[path] = data
        return path

    def requests_for(self, path: str) -> list[str | None]:
        return [rng for p, rng in self.log if p == path]

    def __enter__(self) -> Mirror:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # the log is `mirror.log`
                pass

            def do_GET(self) -> None:
                if self.path.startswith("http://"):  # asked as a proxy: the absolute URL's path is the file's
                    self.path = urlsplit(self.path).path
                rng = self.headers.get("Range")
                mirror.log.append((self.path, rng))
                data = mirror.files.get(self.path)
                if data is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = data[start:]
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if self.path in mirror.stall:
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    time.sleep(30)
                    return
                if self.path in mirror.cut_once:
                    mirror.cut_once.discard(self.path)
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        return Handler
