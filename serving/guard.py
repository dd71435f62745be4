"""The connection guard: what gRPC core does not do against a hostile peer, done from beside it.

gRPC's C core owns the sockets of the gRPC port and tells Python nothing about connections, only about calls. What
it does not do (grpcio 1.85, measured with tests/hostile.py's raw HTTP/2 clients; docs/RELIABILITY.md, "Protocol
attacks"):
  - a peer that goes on sending PINGs after GOAWAY `too_many_pings` keeps its connection: the core closes a
    transport only once its writes are done, and the PING acknowledgements it owes keep them going (one peer held
    a core busy for as long as it sent);
  - HTTP/2 rapid reset (HEADERS then RST_STREAM, again and again) is answered stream by stream, never with GOAWAY;
  - streams whose answers the peer never lets through (flow-control window 0) are held until their deadline;
  - it has a limit on connections in total (`grpc.max_allowed_incoming_connections`, serving/app.py), none per
    peer address.
So one thread of the server watches its own sockets every TICK_S: it finds them in /proc/self/fd (by the local
port), reads each one's kernel counters (TCP_INFO: bytes received, bytes delivered), and hears from the gate
(serving/gate.py) what each connection's calls explain: the calls it started, the bytes of the messages it sent,
the calls it cancelled and the answers it leaves unread. A connection is **cut** when
  - **flood**: for FLOOD_PERSIST_S it has sent bytes that none of its calls explain, beyond a bucket of
    `max_control_bytes_per_s` (4 seconds' worth, refilled at that rate; every byte since the connection opened
    counts, those before the guard's first look too): PING, SETTINGS, WINDOW_UPDATE or RST_STREAM floods. Each
    call adds CALL_CREDIT for its headers, each request message its size, each call refused or failed before its
    message was read REFUSED_CREDIT (one stream window); a call waiting for its message may
    run the bucket into debt by up to the largest message, and a stream gRPC has started that the gate has not
    heard of yet adds STREAM_CREDIT, and a message gRPC has received that the gate has not read yet the largest
    message allowed (gRPC's channelz, looked at only when a bucket runs empty);
  - **resets**: it cancels more than `max_cancels_per_s` of its calls in a second, or at least a quarter of that
    many within PREMATURE_S of their start when they are more than half of the calls it started in that second
    (rapid reset of calls that reached the server; the ratio is Envoy's premature-reset rule: a client whose
    calls mostly complete is not cut for cancelling some, and a reset flood is cut at a quarter of the count);
  - **stalled answers**: an answer has waited `send_stall_s` for it and not one byte reached it meanwhile;
  - **limit**: it is one more than `max_connections_per_peer` from its address (the newest are cut), or it comes
    from an address banned for `ban_s` after one of the three offences above (or after gRPC closed one of its
    connections itself, as it does after GOAWAY too_many_pings, once it had spent half its flood bucket, or spent
    it three times faster than the bucket refills: `_flooded`). A ban also gives the listening sockets a filter
    that drops the address' packets: its SYNs go unanswered, so a banned peer cannot even open the next connection.
How it reads and cuts a socket it does not own is serving/sockets.py: a cut drops the data the peer still sends,
shuts the socket down and discards what the kernel had queued for gRPC; gRPC then closes the connection and its
calls itself, within a tick or two, and the peer sees its connection end.

What it costs: one scan of the process' descriptors and a few system calls per gRPC connection every TICK_S (and at
once when a connection's premature resets reach their limit), channelz only for a connection whose bucket runs
empty, and nothing on the request path but a few dictionary updates per call. What it does not see: frames
themselves (TLS hides them from it, and it never reads the bytes), so a flood within the allowance of the calls a
peer keeps open is not recognised (docs/RELIABILITY.md, "Known limits").
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from grpc._cython import cygrpc  # channelz: the streams gRPC started on a connection (no public Python API)

from serving.metrics import Metrics
from serving.sockets import LISTENING, ban_program, counters, cut_socket, filter_listener, peer_on

log = logging.getLogger(__name__)

TICK_S = 0.1  # how often the guard looks at the connections
CALL_CREDIT = 16 * 1024  # bytes a call may send besides its message (HEADERS, WINDOW_UPDATE, PING of BDP probes)
REFUSED_CREDIT = 64 * 1024  # a call refused before its body was read: the body already on its way (at most one
# stream window: gRPC's receive window per stream is 64 KiB, serving/app.py `transport_options`)
STREAM_CREDIT = REFUSED_CREDIT + CALL_CREDIT  # a stream gRPC started that the gate has not heard of yet (its
# message, once gRPC has all of it, adds up to the largest message allowed: gRPC widens a stream's window to take a
# whole message before any thread reads it)
BUCKET_SECONDS = 4.0  # the flood bucket holds this many seconds of max_control_bytes_per_s
PREMATURE_S = 1.0  # a call its client cancels within this long of its start is a premature reset (Envoy's term)
FLOOD_PERSIST_S = 0.2  # a connection is a flood once its bucket has stayed empty this long (two ticks): the bodies
# of a burst of calls can arrive a tick before the gate has read (and credited) them, and channelz's count of them
# is read only once the bucket runs empty. Each tenth of a second here is about a tenth of a core's second for a
# PING flood: gRPC reads one as fast as it can answer it (0.5 s cut a flood 0.7 s after it began)
_LOG_EVERY_S = 10.0  # one log line per peer address and reason per this long

def peer_of(context_peer: str) -> tuple[str, int] | None:
    """gRPC's peer string ('ipv4:1.2.3.4:5678', 'ipv6:[::1]:5678') as (address, port); None for others (unix)."""
    kind, _, rest = context_peer.partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in rest:
        return None
    host, _, port = rest.rpartition(":")
    return host.strip("[]").removeprefix("::ffff:"), int(port)


@dataclass
class _Calls:
    """What the gate reported for one connection since the last tick."""

    credit: int = 0
    started: int = 0  # calls that reached the gate
    cancels: int = 0
    premature: int = 0  # of the cancels, calls cancelled within PREMATURE_S of their start
    waiting: int = 0  # calls waiting for their request message now
    held: dict[int, float] = field(default_factory=dict)  # answer id -> time.monotonic() it was built


@dataclass
class _Connection:
    fd: int
    inode: int
    peer: tuple[str, int]
    opened: float  # time.monotonic() the guard first saw it
    bucket: float = 0.0
    read_at: float = 0.0  # time.monotonic() of the last reading
    received: int = -1  # tcpi_bytes_received at the last tick (-1: not read yet)
    acked: int = -1  # tcpi_bytes_acked at the last tick
    acked_moved: float = 0.0  # time.monotonic() tcpi_bytes_acked last grew
    recent: deque[tuple[float, int, int, int]] = field(default_factory=deque)  # per tick of the last second in
    # which something happened: (time, calls cancelled, of them premature, calls started)
    in_second: list[int] = field(default_factory=lambda: [0, 0, 0])  # the sums of `recent`'s three counts
    streams: int = -1  # streams gRPC had started on it at the last look into channelz (-1: never looked)
    messages: int = -1  # messages gRPC had received on it then
    empty_since: float | None = None  # time.monotonic() its flood bucket went below its floor
    cut: str | None = None  # why it was cut, once it was


class Guard:
    """Watches the connections of `ports` in this process; `start()`, `close()`. The gate reports calls with
    `call`, `message`, `refused`, `waiting`, `cancelled`, `hold` and `release` (peer strings from
    `context.peer()`)."""

    def __init__(self, ports: list[int], metrics: Metrics, *, max_connections_per_peer: int,
                 max_control_bytes_per_s: int, max_cancels_per_s: int, send_stall_s: float, ban_s: float,
                 max_message_bytes: int) -> None:
        self.ports = set(ports)
        self.metrics = metrics
        self.per_peer = max_connections_per_peer
        self.rate = float(max_control_bytes_per_s)
        self.capacity = BUCKET_SECONDS * self.rate
        self.max_cancels = max_cancels_per_s
        self.max_premature = max(1, max_cancels_per_s // 4)  # premature resets in 1 s that cut (when most calls)
        self.send_stall_s, self.ban_s = send_stall_s, ban_s
        self.max_message_bytes = max_message_bytes
        self.connections: dict[int, _Connection] = {}  # inode -> connection
        self.banned: dict[str, float] = {}  # address -> time.monotonic() its ban ends
        self._calls: dict[tuple[str, int], _Calls] = {}
        self._lock = threading.Lock()
        self._answers = 0
        self._bans: list[tuple[str, float, str]] = []  # asked for by the gate, applied at the next tick
        self._listeners: dict[int, int] = {}  # listening sockets of `ports`: fd -> inode
        self._others: set[int] = set()  # inodes of this process' other sockets (other ports, UDP, unix)
        self._filtered: frozenset[str] = frozenset()  # the addresses the listeners' filter drops now
        self._logged: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()  # a tick now rather than at the next TICK_S: a peer's resets past the limit
        self._thread = threading.Thread(target=self._run, name="connection-guard", daemon=True)

    # ----------------------------------------------------------------------------------- reports from the gate

    def _report(self, context_peer: str, credit: int = 0, cancels: int = 0, waiting: int = 0, started: int = 0,
                premature: int = 0) -> None:
        peer = peer_of(context_peer)
        if peer is None:
            return
        with self._lock:
            calls = self._calls.get(peer)
            if calls is None:
                calls = self._calls[peer] = _Calls()
            calls.credit += credit
            calls.cancels += cancels
            calls.premature += premature
            calls.started += started
            if premature and calls.premature == self.max_premature:  # a reset flood: judged now, not at the tick
                self._wake.set()
            calls.waiting += waiting

    def call(self, peer: str) -> None:
        self._report(peer, credit=CALL_CREDIT, started=1)

    def message(self, peer: str, size: int) -> None:
        self._report(peer, credit=size + 5)  # + gRPC's length prefix

    def refused(self, peer: str) -> None:
        self._report(peer, credit=REFUSED_CREDIT)

    def waiting(self, peer: str, delta: int) -> None:
        self._report(peer, waiting=delta)

    def cancelled(self, peer: str, premature: bool = False) -> None:
        """A call of `peer` was cancelled by its client; premature: within PREMATURE_S of its start."""
        self._report(peer, cancels=1, premature=int(premature))

    def hold(self, peer: str) -> int | None:
        """An answer was built for `peer` and waits to be delivered; returns its id for `release` (None: not
        watched)."""
        key = peer_of(peer)
        if key is None:
            return None
        with self._lock:
            self._answers += 1
            calls = self._calls.get(key)
            if calls is None:
                calls = self._calls[key] = _Calls()
            calls.held[self._answers] = time.monotonic()
            return self._answers

    def release(self, peer: str, answer: int | None) -> None:
        key = peer_of(peer)
        if key is None or answer is None:
            return
        with self._lock:
            calls = self._calls.get(key)
            if calls is not None:
                calls.held.pop(answer, None)

    def ban(self, address: str, seconds: float, reason: str) -> None:
        """Cut the address' connections at the next tick, and its new ones for `seconds` (from the gate: an address
        that kept calling while blocked after failed authentications)."""
        with self._lock:
            self._bans.append((address, seconds, reason))

    # ----------------------------------------------------------------------------------- the thread

    def start(self) -> Guard:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while True:
            self._wake.wait(TICK_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception:  # a bug here must not stop the guard for good
                log.exception("connection guard: tick failed")

    def tick(self) -> None:
        now = time.monotonic()
        seen = self._scan(now)
        peers = {conn.peer for conn in seen.values()}
        with self._lock:  # credits and cancellations are counted per tick; calls waiting and answers held carry on
            reports = self._calls
            self._calls = {peer: _Calls(waiting=c.waiting, held=c.held) for peer, c in reports.items()
                           if c.waiting or c.held or peer in peers}
            bans, self._bans = self._bans, []
        self.banned = {address: end for address, end in self.banned.items() if end > now}
        for address, seconds, reason in bans:
            self.banned[address] = max(self.banned.get(address, now), now + seconds)
            self._log(address, reason, f"{address} banned for {seconds:.0f} s ({reason})")
        self._filter_listeners()
        by_address: dict[str, list[_Connection]] = {}
        for conn in seen.values():
            if conn.cut is None:  # one already cut stays until gRPC has closed it
                by_address.setdefault(conn.peer[0], []).append(conn)
        for address, conns in by_address.items():
            conns.sort(key=lambda c: (c.opened, c.fd))
            if address in self.banned:
                for conn in conns:
                    self._cut(conn, "banned", f"{address} is banned for {self.banned[address] - now:.0f} s more")
                continue
            for conn in conns[self.per_peer:]:
                self._cut(conn, "per_peer_limit", f"more than max_connections_per_peer={self.per_peer} from "
                                                  f"{address}")
        for conn in seen.values():
            if conn.cut is None:
                self._judge(conn, reports.get(conn.peer, _Calls()), now)
        for inode, gone in self.connections.items():  # gRPC closed it itself (GOAWAY too_many_pings) mid-flood
            if inode not in seen and gone.cut is None and self.ban_s > 0 and \
                    self._flooded(gone, reports.get(gone.peer, _Calls()).credit, now):
                self.banned[gone.peer[0]] = now + self.ban_s
                self._log(gone.peer[0], "flood", f"{gone.peer[0]} banned for {self.ban_s:.0f} s: its connection "
                                                 f"{gone.peer[1]} ended while it flooded")
                self._filter_listeners()
        self.connections = seen
        self.metrics.connections.set(sum(c.cut is None for c in seen.values()))

    def _judge(self, conn: _Connection, calls: _Calls, now: float) -> None:
        if self._resets(conn, calls, now):  # from the gate's reports alone: judged at first sight too
            return
        received, read_at = conn.received, conn.read_at
        if not self._read_counters(conn, now):
            return
        if received < 0:  # first sight: every byte since the connection opened counts, so that a flood that starts
            received, read_at = 0, now  # at once is judged a tick sooner (a TLS handshake is a few KiB of it)
        # flood: bytes no call explains, drawn from a bucket refilled at max_control_bytes_per_s. A call waiting for
        # its message may run it into debt by up to the largest message, repaid by the message's size once read.
        got = conn.received - received
        # credit offsets this tick's bytes first; what is left over is kept up to the bucket's capacity
        conn.bucket = min(self.capacity, conn.bucket + calls.credit + self.rate * (now - read_at) - got)
        floor = -calls.waiting * self.max_message_bytes
        if conn.bucket < floor:  # before judging: streams gRPC started that the gate has not heard of yet (a
            # burst of calls whose bodies arrive before a thread takes them), from gRPC's channelz
            counts = core_counts(conn.peer)
            if counts is not None:
                streams, messages = counts
                new_streams = streams - conn.streams if conn.streams >= 0 else streams
                new_messages = messages - conn.messages if conn.messages >= 0 else messages
                conn.streams, conn.messages = streams, messages
                credit = max(0, new_streams) * STREAM_CREDIT + max(0, new_messages) * self.max_message_bytes
                conn.bucket = min(self.capacity, conn.bucket + credit)
        if conn.bucket >= floor:
            conn.empty_since = None
        elif conn.empty_since is None:
            conn.empty_since = now
        elif now - conn.empty_since >= FLOOD_PERSIST_S:
            self._offence(conn, "flood", f"{-conn.bucket:.0f} bytes in {now - conn.empty_since:.1f} s beyond what "
                                         f"its calls explain (max_control_bytes_per_s={self.rate:.0f})")
            return
        # stalled answers: one has waited send_stall_s and not one byte reached the peer meanwhile
        if calls.held:
            oldest = min(calls.held.values())
            if now - oldest >= self.send_stall_s and now - conn.acked_moved >= self.send_stall_s:
                self._offence(conn, "stalled_answers", f"{len(calls.held)} answers wait for it, the oldest "
                                                       f"{now - oldest:.1f} s, and it took no byte for "
                                                       f"{now - conn.acked_moved:.1f} s (send_stall_s="
                                                       f"{self.send_stall_s})")

    def _flooded(self, conn: _Connection, credit: int, now: float) -> bool:
        """Whether a connection that gRPC closed itself was flooding: with what its calls explained since the last
        reading (`credit`: a request read after that reading), it had spent half its bucket on bytes no call
        explains, or at least half a second's allowance at over three times the allowed rate while the guard
        watched it (its bucket down by more than twice the refill of that time). gRPC may close a flood within a
        tick or two, on a loaded server before half the bucket is gone, and the address was then not banned."""
        spent = self.capacity - min(self.capacity, conn.bucket + credit + self.rate * (now - conn.read_at))
        watched = max(0.0, now - conn.opened)
        return spent >= self.capacity / 2 or (spent >= self.rate / 2 and spent > 2 * self.rate * watched)

    def _resets(self, conn: _Connection, calls: _Calls, now: float) -> bool:
        """Calls cancelled by the peer in the last second: too many, or too many premature ones (cut: True)."""
        # running sums, and nothing kept for a tick without calls: summing every connection's window again at each
        # tick took 22 of the 36 ms a tick took with 1,000 idle connections
        sums = conn.in_second
        if calls.cancels or calls.premature or calls.started:
            conn.recent.append((now, calls.cancels, calls.premature, calls.started))
            sums[0] += calls.cancels
            sums[1] += calls.premature
            sums[2] += calls.started
        while conn.recent and now - conn.recent[0][0] >= 1.0:
            _, old_cancels, old_premature, old_started = conn.recent.popleft()
            sums[0] -= old_cancels
            sums[1] -= old_premature
            sums[2] -= old_started
        cancels, early, started = sums
        started = max(early, started)  # calls started before the guard first saw it are not counted
        if cancels > self.max_cancels:
            self._offence(conn, "resets", f"{cancels} calls cancelled in 1 s (max_cancels_per_s={self.max_cancels})")
            return True
        if early >= self.max_premature and 2 * early > started:
            self._offence(conn, "resets", f"{early} of its {started} calls in 1 s cancelled within {PREMATURE_S} s "
                                          f"of their start (more than half, and max_cancels_per_s/4="
                                          f"{self.max_premature} or more)")
            return True
        return False

    def _offence(self, conn: _Connection, reason: str, detail: str) -> None:
        if self.ban_s > 0:
            self.banned[conn.peer[0]] = time.monotonic() + self.ban_s
            detail += f"; {conn.peer[0]} banned for {self.ban_s:.0f} s"
            self._filter_listeners()
        self._cut(conn, reason, detail)

    def _filter_listeners(self) -> None:
        """Give the listening sockets a filter that drops the banned addresses' packets (their SYNs: no new
        connection from them reaches gRPC), when the set of banned addresses changed."""
        banned = frozenset(self.banned)
        if banned == self._filtered:
            return
        program = ban_program(sorted(banned))
        for fd, inode in list(self._listeners.items()):
            if not filter_listener(fd, inode, program):
                del self._listeners[fd]
        self._filtered = banned
        self._program = program  # keeps the filter's buffer alive while it is attached

    def _cut(self, conn: _Connection, reason: str, detail: str) -> None:
        conn.cut = reason
        if not cut_socket(conn.fd, conn.inode):
            return  # gRPC closed it meanwhile
        self.metrics.connections_cut.labels(reason).inc()
        self._log(conn.peer[0], reason, f"cut the connection from {conn.peer[0]}:{conn.peer[1]} ({reason}): {detail}")

    def _log(self, address: str, reason: str, line: str) -> None:
        """At most one line per address and reason per _LOG_EVERY_S (the rest are counted in the metrics)."""
        now = time.monotonic()
        if now - self._logged.get((address, reason), -_LOG_EVERY_S) >= _LOG_EVERY_S:
            if len(self._logged) > 10_000:  # many addresses: forget the lines logged long enough ago
                self._logged = {k: t for k, t in self._logged.items() if now - t < _LOG_EVERY_S}
            self._logged[(address, reason)] = now
            log.warning("%s", line)

    # ----------------------------------------------------------------------------------- sockets

    def _scan(self, now: float) -> dict[int, _Connection]:
        """This process' established TCP connections on `ports`, by inode."""
        found: dict[int, _Connection] = {}
        try:
            fds = os.listdir("/proc/self/fd")
        except OSError:
            return found
        known = {c.fd: c for c in self.connections.values()}
        listeners = set(self._listeners.values())
        others: set[int] = set()
        for name in fds:
            fd = int(name)
            try:  # fstat rather than readlink: one system call and no path to walk (a tick reads every descriptor)
                st = os.fstat(fd)
            except OSError:
                continue
            if not stat.S_ISSOCK(st.st_mode):
                continue
            inode = st.st_ino
            old = known.get(fd)
            if old is not None and old.inode == inode:
                found[inode] = old
                continue
            if inode in listeners or inode in self._others:
                others.add(inode)
                continue
            peer = peer_on(fd, self.ports)
            if peer == LISTENING:
                self._listeners[fd] = inode
            elif peer is not None:
                found[inode] = _Connection(fd, inode, peer, now, bucket=self.capacity, acked_moved=now)
            else:
                others.add(inode)
        self._others = others  # sockets not watched (other ports, other kinds): not looked at again while open
        return found

    def _read_counters(self, conn: _Connection, now: float) -> bool:
        read = counters(conn.fd, conn.inode)
        if read is None:
            return False
        acked, received = read
        if acked != conn.acked:
            conn.acked_moved = now
        conn.acked, conn.received, conn.read_at = acked, received, now
        return True


def core_counts(peer: tuple[str, int]) -> tuple[int, int] | None:
    """(streams started, messages received) by gRPC's core on the server connection from `peer` (channelz; None
    when channelz does not list it). Streams it refused at once (rapid reset past max_concurrent_streams) are not
    started; a stream reset before its message carries none. A peer's address and port name one connection on
    this machine."""
    try:
        for server in json.loads(cygrpc.channelz_get_servers(0)).get("server", []):
            sockets = json.loads(cygrpc.channelz_get_server_sockets(int(server["ref"]["serverId"]), 0, 100_000))
            for ref in sockets.get("socketRef", []):
                host, _, port = ref.get("name", "").rpartition(":")  # "chttp2 ipv4:127.0.0.1:36362"
                address = host.split(":", 1)[-1].strip("[]").removeprefix("::ffff:")
                if port.isdigit() and int(port) == peer[1] and address == peer[0]:
                    data = json.loads(cygrpc.channelz_get_socket(int(ref["socketId"])))["socket"]["data"]
                    return int(data.get("streamsStarted", 0)), int(data.get("messagesReceived", 0))
    except (ValueError, KeyError, TypeError):
        return None
    return None
