"""Attacks on the serving deployment, each against a fresh server process (and a fresh proxy in front of it), with an
authorised client calling beside the attacker: what each attack costs the server, the proxy and that client. The
tables of docs/RELIABILITY.md ("A front proxy") come from this script.

    python bench/protocol_attacks.py --bundle BUNDLE [--attacks ping-flood,rapid-reset,...] [--seconds 5] [--tls]
        [--via-haproxy [MODEL_CALLS]] [--before-repo DIR] [--server-cpus 0 --client-cpus 1] [--json out.json]
    python bench/protocol_attacks.py --table run1.json run2.json   # the rows of docs/RELIABILITY.md
    python bench/soak.py --make-bundle BUNDLE --size tiny         # once: a bundle to attack (random weights)

The deployment: `--via-haproxy` runs it as deployed, the proxy's image (Containerfile.proxy: HAProxy with
deploy/proxy/haproxy.cfg, its per-address limits at the file's defaults, MODEL_CALLS 8 unless given) run by buildah
in front of `python -m serving.server BUNDLE --behind-proxy` on loopback; TLS, with --tls, ends at the proxy. Without
it, the clients call the server itself (TLS at the server). `--before-repo DIR` adds, alternated attack by attack, the
server of another checkout called directly (an older tree, for a "before" column: its own defences, whatever they
were); both run with PYTHONPATH at their own tree and serve BUNDLE, which must be in a format both read (make it
with the older tree's bench/soak.py). The server has a bearer token.

The authorised client: another process that calls Classify (one text) every 20 ms from 127.0.0.1 for the whole
attack and reports its latencies and refusals. The attacker: this process, from 127.0.0.2 (another address: per-
address limits apply to it alone), with the raw HTTP/2 clients of tests/hostile.py. Measured per attack: the CPU of
the server and of the proxy (user + system seconds from /proc over the attack's wall time, in cores), their largest
resident memory, the server's most threads, the calls the server answered (by code, from its metrics), what became
of the attacker's connections, and the authorised client's p50/p99/max and refusals. Attacks:
  none              no attack: the authorised client alone (what an attack's CPU adds is the difference)
  ping-flood        PING frames (batches of 1,000) as fast as the socket takes them, on one connection at a time,
                    a new one at once when the other side ends it
  settings-flood    the same with SETTINGS frames, each of which the other side must acknowledge
  rapid-reset       the same with HEADERS of an authorised Classify then RST_STREAM(CANCEL) (batches of 500)
  rapid-reset-anon  the same without the token
  wrong-tokens      10,000 calls with a wrong bearer token (HEADERS with END_STREAM, 100 at a time per connection)
  idle              500 connections that finish the HTTP/2 handshake and then idle
  idle-many         1,000 such connections from 10 addresses (127.0.0.2-11, 100 each)
  half-open         500 TCP connections that never send a byte
  slow-headers      100 connections whose call's HEADERS never end: a byte of CONTINUATION a second
  withheld-body     authorised calls whose body never comes, 100 on a connection, a new connection of 100 each time
                    the other side has ended them all
  withheld-body-anon  the same without the token
  zero-window       10 connections with SETTINGS_INITIAL_WINDOW_SIZE 0: 100 authorised Classify calls each, whose
                    answers can never be sent
  window-overflow   WINDOW_UPDATE on the connection past 2^31-1 (RFC 9113 6.9.1: a FLOW_CONTROL_ERROR GOAWAY)
  overload          another process: 500 callers x 64 texts, closed loop (each sends again as soon as it is answered
                    or refused): a flood of calls
  overload-rate     another process: calls of 64 texts at a fixed rate (`--overload-rate`, 200/s: about twice what
                    this machine's server answers), whatever became of the earlier ones
                    In both overloads, the load comes from 127.0.0.1 and stands for many clients: through the proxy,
                    its per-address call rate (CALLS_PER_SOURCE_S) is lifted unless --haproxy-source-limit is given;
                    the figure is the latency of the authorised client's refusals (a call every 20 ms)
The attacks on time limits (idle*, half-open, slow-headers, withheld-body*, zero-window) run for at least 12 s, past
the 10 s that the server's and the proxy's timeouts allow. `--server-cpus` and `--client-cpus` pin the server and the
proxy, and everything else (this process, the authorised client, the load generator), to cores of their own (Linux
CPU affinity): on a machine with few cores the attackers otherwise take the server's cores, and an attacker on
another machine would not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

TOKEN = "protocol-attack-token-0123456789"
AUTH = [("authorization", f"Bearer {TOKEN}")]
CLASSIFY = "/sentiment.v1.SentimentService/Classify"
ATTACKER = "127.0.0.2"
ATTACKS = ["none", "ping-flood", "settings-flood", "rapid-reset", "rapid-reset-anon", "wrong-tokens", "idle",
           "idle-many", "half-open", "slow-headers", "withheld-body", "withheld-body-anon", "zero-window",
           "window-overflow", "overload", "overload-rate"]
TIMED = ("idle", "idle-many", "half-open", "slow-headers", "withheld-body", "withheld-body-anon", "zero-window")
TIMED_S = 12.0  # past the 10 s of the server's body_timeout_s and handshake_timeout_s, and the proxy's timeouts


# ------------------------------------------------------------------------------------- the clients


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(values)
    pick = lambda q: round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)  # noqa: E731
    return {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": round(1000 * ordered[-1], 2)}


def probe_main(args: argparse.Namespace) -> None:
    """The authorised client: one Classify every `interval` s for `seconds` s; prints its figures as JSON."""
    import grpc

    from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
    from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc

    target = f"localhost:{args.probe}" if args.tls_ca else f"127.0.0.1:{args.probe}"
    channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes())) \
        if args.tls_ca else grpc.insecure_channel(target)
    stub = pb_grpc.SentimentServiceStub(channel)
    stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=30, metadata=AUTH)
    print("ready", flush=True)
    latencies, refusals, errors, messages = [], [], {}, {}
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        try:
            stub.Classify(pb.ClassifyRequest(texts=["Un bon livre."]), timeout=10, metadata=AUTH)
            latencies.append(time.perf_counter() - start)
        except grpc.RpcError as e:
            errors[e.code().name] = errors.get(e.code().name, 0) + 1
            messages.setdefault(e.code().name, (e.details() or "")[:120])
            refusals.append(time.perf_counter() - start)
        time.sleep(max(0.0, args.interval - (time.perf_counter() - start)))
    refused = {f"refused_{k}": v for k, v in percentiles(refusals).items()} if refusals else {}
    print(json.dumps({"calls": len(latencies) + sum(errors.values()), "errors": errors, "messages": messages,
                      **percentiles(latencies), **refused}))


def load_main(args: argparse.Namespace) -> None:
    """The overload: `callers` closed-loop callers of `texts` texts each on 8 channels (grpc.aio), for `seconds`, or
    calls at `rate` a second; prints the latency of answers and of refusals as JSON."""
    import grpc

    from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
    from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc

    async def run() -> dict:
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{args.load}", options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(8)]
        stubs = [pb_grpc.SentimentServiceStub(c) for c in channels]
        request = pb.ClassifyRequest(texts=[f"Un livre {i}, assez long pour compter." for i in range(args.texts)])
        times: dict[str, list[float]] = {}
        messages: dict[str, str] = {}  # the first message of each code but OK: why the load was refused
        stages: dict[str, list[float]] = {}  # the queue's refusals by where they were made (`refused_where`)
        end = time.monotonic() + args.seconds

        async def call(stub: pb_grpc.SentimentServiceStub) -> None:
            start = time.perf_counter()
            try:
                await stub.Classify(request, timeout=30, metadata=AUTH)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
                messages.setdefault(code, (e.details() or "")[:200])
                where = refused_where(e.details() or "")
                if where:
                    stages.setdefault(where, []).append(time.perf_counter() - start)
            times.setdefault(code, []).append(time.perf_counter() - start)

        async def caller(i: int) -> None:
            while time.monotonic() < end:
                await call(stubs[i % len(stubs)])

        async def open_loop() -> None:  # a call every 1/rate s whatever became of the others
            tasks, n, start = set(), 0, time.monotonic()
            while time.monotonic() < end:
                task = asyncio.ensure_future(call(stubs[n % len(stubs)]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                n += 1
                await asyncio.sleep(max(0.0, start + n / args.rate - time.monotonic()))
            await asyncio.gather(*tasks)

        await (open_loop() if args.rate else asyncio.gather(*(caller(i) for i in range(args.callers))))
        for c in channels:
            await c.close()
        out = {code: {"calls": len(v), **percentiles(v), **({"message": messages[code]} if code in messages else {})}
               for code, v in times.items()}
        if "RESOURCE_EXHAUSTED" in out:
            out["RESOURCE_EXHAUSTED"].update({where: {"calls": len(v), **percentiles(v)}
                                              for where, v in stages.items()})
        return out

    print(json.dumps(asyncio.run(run())))


def refused_where(details: str) -> str | None:
    """Where a call was refused for want of room, from the wording of the refusal: 'proxy' (its model slots,
    deploy/proxy/overloaded.http), 'at_admission' (the server, before the body was read) or 'after_body' (the server,
    once the texts were counted: a call admitted while there was room for a full request, overtaken by others)."""
    if "(proxy)" in details:
        return "proxy"
    if "no room for" in details:
        return "at_admission"
    if "texts waiting +" in details:
        return "after_body"
    return None


def helper(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, cwd=REPO)


# ------------------------------------------------------------------------------------- attacks


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


def window_overflow(port: int, seconds: float, tls_ca: Path | None) -> dict:
    from hostile import WINDOW_UPDATE, Raw, frame

    c = Raw(port, tls_ca=tls_ca, source=ATTACKER)
    c.wait_settings()
    start = time.monotonic()
    c.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)) * 2)
    c.closed.wait(seconds)
    return _outcome(c, start)


def no_attack(port: int, seconds: float, tls_ca: Path | None) -> dict:
    """The authorised client alone: the CPU without an attacker, to subtract from the attacks' figures."""
    time.sleep(seconds)
    return {}


def _outcome(c, start: float) -> dict:
    closed = c.closed_at - start if c.closed_at is not None else None
    goaway = c.goaway_at - start if c.goaway_at is not None else None
    c.close()
    return {"goaway_code": c.goaway_code, "goaway_after_s": None if goaway is None else round(goaway, 3),
            "closed_after_s": None if closed is None else round(closed, 3), "acks": c.acks,
            "acks_after_goaway": c.acks_after_goaway}


RUN = {"none": no_attack, "ping-flood": ping_flood, "settings-flood": settings_flood, "rapid-reset": rapid_reset,
       "rapid-reset-anon": rapid_reset_anon, "wrong-tokens": wrong_tokens, "idle": idle, "idle-many": idle_many,
       "half-open": half_open, "slow-headers": slow_headers, "withheld-body": withheld_body,
       "withheld-body-anon": withheld_body_anon, "zero-window": zero_window, "window-overflow": window_overflow}


# ------------------------------------------------------------------------------------- the run


NO_LIMIT = 1_000_000_000  # a per-address limit of the proxy's that nothing reaches


class Setup:
    """Where the clients call: the server of `repo` alone, or behind the proxy's image (`model_calls` set)."""

    def __init__(self, name: str, repo: Path, model_calls: int | None = None, source_limit: int | None = None,
                 server_args: str = "") -> None:
        self.name, self.repo, self.model_calls, self.source_limit = name, repo, model_calls, source_limit
        self.server_args = server_args.split()

    def proxy_settings(self, attack: str, pem: Path | None) -> dict[str, object]:
        """deploy/proxy/haproxy.cfg's settings: its defaults but MODEL_CALLS, and the call rate per address lifted
        for the overloads (their load is one address standing for many clients) unless a limit is given."""
        settings: dict[str, object] = {"MODEL_CALLS": self.model_calls}
        if self.source_limit is not None:
            settings["CALLS_PER_SOURCE_S"] = self.source_limit
        elif attack.startswith("overload"):
            settings["CALLS_PER_SOURCE_S"] = NO_LIMIT
        if pem is not None:
            settings["PROXY_TLS_CERT"] = pem
        return settings


def rss_mib(processes: list) -> float:
    import psutil

    total = 0
    for p in processes:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def run_attack(name: str, setup: Setup, args: argparse.Namespace, certs: dict[str, Path] | None) -> dict:
    from serving_fixtures import FrontProxy, ServerProcess

    proxied = setup.model_calls is not None
    tls = ["--tls-cert", str(certs["server"]), "--tls-key", str(certs["server_key"])] if certs and not proxied else []
    behind = ["--behind-proxy"] if proxied else []  # as deployed (deploy/proxy/haproxy.cfg)
    server = ServerProcess(args.bundle, "--metrics-port", "0", "--device", "cpu", *tls, *behind,
                           *setup.server_args, repo=setup.repo, env={"SENTIMENT_AUTH_TOKEN": TOKEN},
                           cpus=args.server_cpus)
    server.wait_listening()
    tls_ca = certs["ca"] if certs else None
    proxy = None
    try:
        port = server.port
        if proxied:
            proxy = FrontProxy(server.port, setup.proxy_settings(name, certs["proxy_pem"] if certs else None),
                               cpus=args.server_cpus)
            port = proxy.port
        seconds = max(args.seconds, TIMED_S) if name in TIMED else args.seconds
        overload = name.startswith("overload")
        probe = helper("--probe", str(port), "--seconds", str(seconds + 2), "--interval", str(args.probe_interval),
                       *(["--tls-ca", str(tls_ca)] if tls_ca else []))
        assert probe.stdout is not None and probe.stdout.readline().strip() == "ready", "the probe did not start"
        load = None
        if overload:
            rate = ["--rate", str(args.overload_rate)] if name == "overload-rate" else []
            load = helper("--load", str(port), "--callers", "500", "--texts", "64", "--seconds", str(seconds), *rate)
        codes0, auth0 = server.codes(), server.metric("sentiment_auth_failures_total") or 0.0
        proxy_cpu0 = proxy.cpu_seconds() if proxy else 0.0
        cpu0, t0, threads = server.cpu_seconds(), time.monotonic(), [server.threads()]
        peaks = {"server": 0.0, "proxy": 0.0}
        sampler_stop = threading.Event()

        def sample() -> None:
            while not sampler_stop.wait(0.1):
                threads.append(server.threads())
                peaks["server"] = max(peaks["server"], rss_mib(server._tree()))
                if proxy is not None:
                    peaks["proxy"] = max(peaks["proxy"], rss_mib([proxy.haproxy]))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        if load is not None:
            outcome = json.loads(load.communicate(timeout=seconds + 120)[0])
        else:
            outcome = RUN[name](port, seconds, tls_ca)
        time.sleep(max(0.0, seconds - (time.monotonic() - t0)))  # CPU over the whole window, after a cut too
        wall = time.monotonic() - t0
        cpu = server.cpu_seconds() - cpu0
        proxy_cpu = (proxy.cpu_seconds() if proxy else 0.0) - proxy_cpu0
        sampler_stop.set()
        sampler.join(1)
        authorised = json.loads(probe.communicate(timeout=60)[0])
        codes = {k: int(v - codes0.get(k, 0.0)) for k, v in server.codes().items() if v > codes0.get(k, 0.0)}
        auth_failures = int((server.metric("sentiment_auth_failures_total") or 0.0) - auth0)
        warnings = [line.strip() for line in server.lines if " WARNING " in line or "WARNING:" in line]
        return {"attack": name, "setup": setup.name, "server_repo": str(setup.repo), "proxy": proxied,
                "model_calls": setup.model_calls, "tls": certs is not None, "wall_s": round(wall, 2),
                "server_cpu_cores": round(cpu / wall, 2), "server_threads_max": max(threads),
                "server_rss_mib_max": round(peaks["server"], 1), "server_codes": codes,
                "server_auth_failures": auth_failures,
                **({"proxy_cpu_cores": round(proxy_cpu / wall, 2), "proxy_rss_mib_max": round(peaks["proxy"], 1)}
                   if proxy is not None else {}),
                "server_alive": server.proc.poll() is None, "attacker": outcome, "authorised": authorised,
                "server_warnings": warnings[:3]}
    finally:
        if proxy is not None:
            proxy.close()
        try:
            server.stop(30)
        finally:
            server.close()


def outcome(r: dict) -> str:
    """What became of the attack (or of the overload's calls)."""
    a, who, attack = r["attacker"], r["authorised"], r["attack"]
    if attack.startswith("overload"):
        refused, answered = a.get("RESOURCE_EXHAUSTED", {}), a.get("OK", {})
        others = {code: v["calls"] for code, v in a.items() if code not in ("OK", "RESOURCE_EXHAUSTED")}
        return (f"{answered.get('calls', 0)} answered, {refused.get('calls', 0)} refused in "
                f"{refused.get('p50_ms')}/{refused.get('p99_ms')} ms" + (f", {others}" if others else "")
                + f"; the authorised client refused in {who.get('refused_p50_ms')}/{who.get('refused_p99_ms')} ms")
    if attack == "none":
        return "no attack"
    if attack == "wrong-tokens":
        return (f"{a['answered']} of {a['calls']} answered in {a['elapsed_s']} s, {r['server_auth_failures']} by the "
                f"server") + (f", {a['connections_refused']} connections not accepted" if a.get("connections_refused")
                              else "")
    if attack in ("idle", "idle-many"):
        return f"{a['kept']} of {a['opened']} kept after {a['kept_after_s']} s"
    if attack in ("half-open", "slow-headers"):
        return f"{a['closed']} of {a['opened']} closed within {a['within_s']} s" + (
            f" (median {a['median_closed_s']} s)" if a["closed"] else "")
    if attack.startswith("withheld-body"):
        ends = ", ".join(f"{n} {code}" for code, n in a["stream_ends"].items()) or "none"
        return f"{a['calls']} calls on {a['connections']} connections; ended: {ends}"
    if attack == "zero-window":
        ends = ", ".join(f"{n} {code}" for code, n in a["stream_ends"].items()) or "none"
        return f"{a['connections_ended']} of {a['of']} connections ended within {a['elapsed_s']} s; calls ended: {ends}"
    first = a.get("first", a) or {}
    ended = "kept open" if first.get("closed_after_s") is None else f"ended after {first['closed_after_s']} s"
    goaway = f"GOAWAY {first['goaway_code']}, " if first.get("goaway_code") is not None else ""
    cell = "first connection " + goaway + ended
    if "connections" in a:
        cell += f"; {a['connections']} connections" + (f", {a['not_accepted']} not accepted" if a.get("not_accepted")
                                                        else "")
    return cell


def refusals(r: dict) -> int:
    """The authorised client's calls refused (of about 50 a second)."""
    return sum(r["authorised"]["errors"].values())


def table(reports: list[Path]) -> str:
    """Markdown rows from reports made with --before-repo, each a run of both setups: `| attack | before | after |
    authorised p99 ms | authorised refused | server cores | proxy cores |`, the figures `before / after`, one pair
    per run (`; ` between runs); what became of the attack from the first run."""
    runs = [json.loads(path.read_text())["results"] for path in reports]
    rows: dict[tuple[str, bool], list[dict[str, dict]]] = {}
    for i, results in enumerate(runs):
        for r in results:
            pairs = rows.setdefault((r["attack"], r["tls"]), [{} for _ in runs])
            pairs[i][r["setup"]] = r

    def figures(pairs: list[dict[str, dict]], pick: Callable[[dict], object]) -> str:
        return "; ".join(" / ".join(str(pick(p[k])) if k in p else "-" for k in ("before", "after")) for p in pairs)

    out = []
    for (attack, tls), pairs in rows.items():
        first = pairs[0]
        cells = [outcome(first[k]) if k in first else "" for k in ("before", "after")]
        out.append(f"| {attack}{' (TLS)' if tls else ''} | {cells[0]} | {cells[1]} | "
                   f"{figures(pairs, lambda r: r['authorised']['p99_ms'])} | {figures(pairs, refusals)} | "
                   f"{figures(pairs, lambda r: r['server_cpu_cores'])} | "
                   f"{'; '.join(str(p['after'].get('proxy_cpu_cores', '-')) for p in pairs if 'after' in p)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bundle", type=Path, help="the bundle the server serves (bench/soak.py --make-bundle makes one)")
    p.add_argument("--attacks", default=",".join(ATTACKS),
                   help=f"comma-separated attacks to run, in order (default: all of {', '.join(ATTACKS)})")
    p.add_argument("--seconds", type=float, default=5.0,
                   help=f"how long each attack runs (default: 5; the attacks on time limits at least {TIMED_S:g})")
    p.add_argument("--tls", action="store_true",
                   help="TLS with a certificate made for the run: at the proxy with --via-haproxy, else at the server")
    p.add_argument("--via-haproxy", type=int, nargs="?", const=8, metavar="MODEL_CALLS",
                   help="as deployed: the proxy's image (HAProxy with deploy/proxy/haproxy.cfg) in front of the "
                        "server (started --behind-proxy), admitting MODEL_CALLS calls at once (default 8: max_queue "
                        "512 / max_texts 64), its per-address limits at the file's defaults")
    p.add_argument("--haproxy-source-limit", type=int, metavar="REQS",
                   help="with --via-haproxy: the connections of an address that makes more than REQS calls a second "
                        "are dropped (CALLS_PER_SOURCE_S; default: the file's, lifted for the overloads)")
    p.add_argument("--server-repo", type=Path, default=REPO,
                   help="the checkout whose server runs (default: this one)")
    p.add_argument("--before-repo", type=Path,
                   help="also run each attack, alternated, against the server of this checkout called directly "
                        "(an older tree, for a before column; --bundle in a format it reads: make it with its "
                        "bench/soak.py)")
    p.add_argument("--server-args", default="", help="more flags for this tree's server, e.g. '--max-workers 32'")
    p.add_argument("--overload-rate", type=float, default=200.0,
                   help="calls of 64 texts per second in the overload-rate attack (default: 200)")
    p.add_argument("--probe-interval", type=float, default=0.02,
                   help="seconds between the authorised client's calls (default: 0.02)")
    p.add_argument("--server-cpus", help="cores the server and the proxy run on, e.g. '0' or '0-3' (taskset's list; "
                                         "default: all)")
    p.add_argument("--client-cpus", help="cores this script, the authorised client and the load generator run on "
                                         "(default: all)")
    p.add_argument("--json", type=Path, help="write the report of every attack to this JSON file")
    p.add_argument("--table", type=Path, nargs="+", metavar="REPORT",
                   help="print markdown rows from reports made with --before-repo (several: one run each), and exit")
    p.add_argument("--probe", type=int, help=argparse.SUPPRESS)
    p.add_argument("--load", type=int, help=argparse.SUPPRESS)
    p.add_argument("--interval", type=float, default=0.02, help=argparse.SUPPRESS)
    p.add_argument("--tls-ca", help=argparse.SUPPRESS)
    p.add_argument("--callers", type=int, default=500, help=argparse.SUPPRESS)
    p.add_argument("--texts", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    if args.probe:
        probe_main(args)
        return 0
    if args.load:
        load_main(args)
        return 0
    if args.bundle is None:
        p.error("--bundle is required")
    unknown = [a for a in args.attacks.split(",") if a not in ATTACKS]
    if unknown:
        p.error(f"--attacks: unknown {', '.join(unknown)} (known: {', '.join(ATTACKS)})")
    if args.haproxy_source_limit is not None and args.via_haproxy is None:
        p.error("--haproxy-source-limit needs --via-haproxy")
    if args.via_haproxy is not None:
        if args.via_haproxy < 1:
            p.error(f"--via-haproxy must be >= 1, got {args.via_haproxy}")
        if args.haproxy_source_limit is not None and args.haproxy_source_limit < 1:
            p.error(f"--haproxy-source-limit must be >= 1, got {args.haproxy_source_limit}")
        missing = [t for t in ("buildah", "mmdebstrap") if shutil.which(t) is None]
        if missing:  # the proxy's image (Containerfile.proxy) is built and run with them (tests/images.py)
            p.error(f"--via-haproxy: {' and '.join(missing)} not found (make container-deps)")
    for name in ("server_repo", "before_repo"):
        repo = getattr(args, name)
        if repo is not None and not (repo / "serving" / "server.py").is_file():
            p.error(f"--{name.replace('_', '-')}: {repo} holds no serving/server.py")
    from contract.bundle import verify_bundle

    try:
        verify_bundle(args.bundle)  # a missing or damaged bundle: one line, exit 2, before any server starts
    except ValueError as e:
        p.error(f"--bundle: {e}")
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # idle-many holds 1,000 sockets here and in the server
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    if args.client_cpus:  # inherited by the helpers started from here; taskset reads the list, as for the server
        pin = subprocess.run(["taskset", "-p", "-c", args.client_cpus, str(os.getpid())], capture_output=True,
                             text=True)
        if pin.returncode != 0:
            p.error(f"--client-cpus {args.client_cpus}: {pin.stderr.strip()}")
    setups = [Setup("after", args.server_repo.resolve(), args.via_haproxy, args.haproxy_source_limit,
                    args.server_args)]
    if args.before_repo is not None:
        setups.insert(0, Setup("before", args.before_repo.resolve()))
    load_start = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        certs = None
        if args.tls:
            from serving_fixtures import make_certs

            certs = make_certs(Path(tmp))
            certs["proxy_pem"] = Path(tmp) / "proxy.pem"  # HAProxy's crt: the certificate, then its key
            certs["proxy_pem"].write_bytes(certs["server"].read_bytes() + certs["server_key"].read_bytes())
            certs["proxy_pem"].chmod(0o644)  # readable by the image's user
        for name in args.attacks.split(","):
            for setup in setups:
                result = run_attack(name, setup, args, certs)
                print(json.dumps(result), flush=True)
                results.append(result)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "cores": os.cpu_count(),
              "load_average_start": load_start, "load_average_end": os.getloadavg(),
              "command": " ".join(sys.argv), "server_cpus": args.server_cpus, "client_cpus": args.client_cpus,
              "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
