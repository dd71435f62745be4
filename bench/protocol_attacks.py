"""Protocol-level attacks on the server, each against a fresh server process, with an authorised client calling
beside it: what each attack costs the server and that client. The table of docs/RELIABILITY.md ("Protocol
attacks") comes from this script.

    python bench/protocol_attacks.py --bundle BUNDLE [--attacks ping-flood,rapid-reset,...] [--seconds 5] [--tls]
        [--server-repo DIR] [--server-cpus 0 --client-cpus 1] [--via-haproxy MAXCONN] [--json out.json]
    python bench/protocol_attacks.py --table before.json after.json     # the rows of docs/RELIABILITY.md
    python bench/soak.py --make-bundle BUNDLE --size tiny      # once: a bundle to attack (random weights)

The server: `python -m serving.server BUNDLE --port 0 --device cpu` with a bearer token (and TLS with --tls, from
certificates made in a temporary folder), run from `--server-repo` (default: this checkout; point it at an export of
an older commit for a "before" column). The authorised client: another process that calls Classify (one text) every
100 ms (20 ms in the overload attacks) from 127.0.0.1 for the whole attack and reports its latencies and refusals.
The attacker: this process, from 127.0.0.2 (another address to the server: its limits and bans are per address),
with the raw HTTP/2 clients of tests/hostile.py. Measured per attack: the server's CPU (user + system seconds from
/proc over the attack's wall time, in cores), its most threads, whether and when the attacking connection ended, and
the authorised client's p50/p99/max and refusals. Attacks:
  ping-flood      PING frames (batches of 1,000) as fast as the socket takes them, on one connection at a time,
                  a new one at once when the server ends it
  rapid-reset     the same with HEADERS of an authorised Classify then RST_STREAM(CANCEL) (batches of 500)
  zero-window     10 connections with SETTINGS_INITIAL_WINDOW_SIZE 0: 100 authorised Classify calls each, whose
                  answers can never be sent
  wrong-tokens    10,000 calls with a wrong bearer token (HEADERS with END_STREAM, 100 at a time per connection)
  idle            500 connections that finish the HTTP/2 handshake and then idle
  overload        another process: 500 callers x 64 texts, closed loop (each sends again as soon as it is answered
                  or refused): a flood of calls
  overload-rate   another process: calls of 64 texts at a fixed rate (`--overload-rate`, 200/s: about twice
                  what this machine's server answers), whatever became of the earlier ones: an overload
                  In both, the figure is the latency of the refusals the authorised client gets (a call every
                  20 ms, one text, its own process and connection): how fast a call that will not be served is
                  refused, seen from outside the server, and apart from the load generator's own queueing
  window-overflow WINDOW_UPDATE on the connection past 2^31-1 (RFC 9113 6.9.1: a FLOW_CONTROL_ERROR GOAWAY)
  idle-many       1,000 connections from 10 addresses (127.0.0.2-11, 100 each: the per-address limit) that finish
                  the HTTP/2 handshake and idle: what watching max_connections costs the server
  none            no attack: the server's CPU with the authorised client alone (what an attack's CPU adds is the
                  difference)
`--server-cpus` and `--client-cpus` pin the server and everything else (this process, the authorised client, the
load generator) to cores of their own (Linux CPU affinity): on a machine with few cores the attackers otherwise take
the server's cores, and an attacker on another machine would not. `--via-haproxy MAXCONN` puts HAProxy in front of
the server (deploy/proxy/haproxy.cfg, the server started with `--behind-proxy`): the clients and attackers then talk
to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
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
CLASSIFY = "/sentiment.v1.SentimentService/Classify"
ATTACKER = "127.0.0.2"
ATTACKS = ["ping-flood", "rapid-reset", "zero-window", "wrong-tokens", "idle", "overload", "overload-rate",
           "window-overflow", "idle-many", "none"]


# ------------------------------------------------------------------------------------- processes


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

    target = f"127.0.0.1:{args.probe}"
    channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes())) \
        if args.tls_ca else grpc.insecure_channel(target)
    stub = pb_grpc.SentimentServiceStub(channel)
    metadata = [("authorization", f"Bearer {TOKEN}")]
    stub.Classify(pb.ClassifyRequest(texts=["prêt"]), timeout=30, metadata=metadata)
    print("ready", flush=True)
    latencies, refusals, errors = [], [], {}
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        try:
            stub.Classify(pb.ClassifyRequest(texts=["Un bon livre."]), timeout=10, metadata=metadata)
            latencies.append(time.perf_counter() - start)
        except grpc.RpcError as e:
            errors[e.code().name] = errors.get(e.code().name, 0) + 1
            refusals.append(time.perf_counter() - start)
        time.sleep(max(0.0, args.interval - (time.perf_counter() - start)))
    refused = {f"refused_{k}": v for k, v in percentiles(refusals).items()} if refusals else {}
    print(json.dumps({"calls": len(latencies) + sum(errors.values()), "errors": errors, **percentiles(latencies),
                      **refused}))


def load_main(args: argparse.Namespace) -> None:
    """The overload: `callers` closed-loop callers of `texts` texts each on 8 channels (grpc.aio), for `seconds`;
    prints the latency of answers and of refusals as JSON."""
    import grpc

    from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
    from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc

    async def run() -> dict:
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{args.load}", options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(8)]
        stubs = [pb_grpc.SentimentServiceStub(c) for c in channels]
        request = pb.ClassifyRequest(texts=[f"Un livre {i}, assez long pour compter." for i in range(args.texts)])
        metadata = [("authorization", f"Bearer {TOKEN}")]
        times: dict[str, list[float]] = {}
        messages: dict[str, str] = {}  # the first message of each code but OK: why the load was refused
        stages: dict[str, list[float]] = {}  # the queue's refusals by where they were made (`refused_where`)
        end = time.monotonic() + args.seconds

        async def call(stub: pb_grpc.SentimentServiceStub) -> None:
            start = time.perf_counter()
            try:
                await stub.Classify(request, timeout=30, metadata=metadata)
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
    """Where the server refused a call for want of room in its queue, from the wording of serving/model/batcher.py:
    'at_admission' (before the body was read, in gRPC's polling thread) or 'after_body' (in a handler thread, once
    the texts were counted: a call admitted while there was room for a full request, overtaken by others). Also
    an older server's wording at admission ("no room for one more", when it admitted a call on room for one text)."""
    if "no room for" in details:
        return "at_admission"
    if "texts waiting +" in details:
        return "after_body"
    return None


def helper(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, cwd=REPO)


# ------------------------------------------------------------------------------------- attacks


def _flood(port: int, seconds: float, tls_ca: Path | None, batch: Callable[[int], bytes]) -> dict:
    """`batch(first stream id)` written again and again for `seconds`; a connection the server ends is replaced
    by a new one at once, as an attacker would. Counts the connections, when the first ended and what it got."""
    from hostile import Raw

    start, sent, connections, first = time.monotonic(), 0, 0, None
    while time.monotonic() - start < seconds:
        try:
            c = Raw(port, tls_ca=tls_ca, source=ATTACKER)
        except OSError:
            time.sleep(0.01)
            continue
        connections += 1
        c.sock.settimeout(1)
        c.wait_settings(2)  # the server's SETTINGS first: a flood before them is closed by gRPC itself
        sid = 1
        while time.monotonic() - start < seconds and not c.closed.is_set() and sid < 2**31 - 2000:
            if c.send(batch(sid)):
                sent += 1
            sid += 1000
        if first is None:
            first = _outcome(c, start)
        else:
            c.close()
    return {"batches": sent, "connections": connections, "first": first}


def ping_flood(port: int, seconds: float, tls_ca: Path | None) -> dict:
    from hostile import PING, frame

    pings = frame(PING, 0, 0, b"attacker") * 1000
    return _flood(port, seconds, tls_ca, lambda sid: pings)


def rapid_reset(port: int, seconds: float, tls_ca: Path | None) -> dict:
    from hostile import CANCEL, END_HEADERS, HEADERS, RST_STREAM, frame, request_block

    block = request_block(CLASSIFY, [("authorization", f"Bearer {TOKEN}")])
    reset = struct.pack(">I", CANCEL)
    return _flood(port, seconds, tls_ca, lambda sid: b"".join(
        frame(HEADERS, END_HEADERS, s, block) + frame(RST_STREAM, 0, s, reset) for s in range(sid, sid + 1000, 2)))


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
                c.call(CLASSIFY, message, [("authorization", f"Bearer {TOKEN}")])
            except (OSError, TimeoutError):
                break
    time.sleep(seconds)
    ended = [c.closed.is_set() for c in conns]
    codes: dict[str, int] = {}
    for c in conns:
        for code in c.ended.values():
            codes[code] = codes.get(code, 0) + 1
        c.close()
    return {"connections_ended": sum(ended), "of": len(conns), "stream_ends": codes,
            "elapsed_s": round(time.monotonic() - start, 2)}


def wrong_tokens(port: int, seconds: float, tls_ca: Path | None) -> dict:
    from hostile import END_HEADERS, END_STREAM, HEADERS, Raw, frame, request_block

    block = request_block(CLASSIFY, [("authorization", "Bearer wrong-token-guess-00000000")])
    start, sent, answered, refused_connections = time.monotonic(), 0, 0, 0
    while sent < 10_000 and time.monotonic() - start < max(seconds, 30):
        try:
            c = Raw(port, tls_ca=tls_ca, source=ATTACKER)
            c.sock.settimeout(2)
        except OSError:  # banned: the server's filter drops the SYN, and the connection times out
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
    before the next: max_connections_per_peer); how many the server kept."""
    from hostile import Raw

    sources = sources or [ATTACKER]
    start = time.monotonic()
    conns = []
    for i in range(count):
        try:
            conns.append(Raw(port, tls_ca=tls_ca, source=sources[min(i // 100, len(sources) - 1)]))
        except OSError:
            break
    time.sleep(seconds)
    kept = sum(not c.closed.is_set() for c in conns)
    for c in conns:
        c.close()
    return {"opened": len(conns), "kept_after_s": round(time.monotonic() - start, 1), "kept": kept}


def idle_many(port: int, seconds: float, tls_ca: Path | None) -> dict:
    """1,000 idle connections (the default max_connections) from 10 addresses, 100 each (max_connections_per_peer):
    what watching that many connections costs the server (the connection guard reads each one every 0.1 s)."""
    return idle(port, seconds, tls_ca, 1000, [f"127.0.0.{2 + k}" for k in range(10)])


def window_overflow(port: int, seconds: float, tls_ca: Path | None) -> dict:
    from hostile import WINDOW_UPDATE, Raw, frame

    c = Raw(port, tls_ca=tls_ca, source=ATTACKER)
    c.wait_settings()
    start = time.monotonic()
    c.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)) * 2)
    c.closed.wait(seconds)
    return _outcome(c, start)


def no_attack(port: int, seconds: float, tls_ca: Path | None) -> dict:
    """The authorised client alone: the server's CPU without an attacker, to subtract from the attacks' figures."""
    time.sleep(seconds)
    return {}


def _outcome(c, start: float, **counts: object) -> dict:
    closed = c.closed_at - start if c.closed_at is not None else None
    goaway = c.goaway_at - start if c.goaway_at is not None else None
    c.close()
    return {**counts, "goaway_code": c.goaway_code, "goaway_after_s": None if goaway is None else round(goaway, 3),
            "closed_after_s": None if closed is None else round(closed, 3), "acks": c.acks,
            "acks_after_goaway": c.acks_after_goaway}


# ------------------------------------------------------------------------------------- the run


NO_LIMIT = 1_000_000_000  # a per-address limit of HAProxy's that nothing reaches


def run_attack(name: str, args: argparse.Namespace, certs: dict[str, Path] | None) -> dict:
    tls = ["--tls-cert", str(certs["server"]), "--tls-key", str(certs["server_key"])] if certs else []
    from serving_fixtures import FrontProxy, ServerProcess

    behind = ["--behind-proxy"] if args.via_haproxy else []  # as deployed (deploy/proxy/haproxy.cfg)
    server = ServerProcess(args.bundle, "--metrics-port", "0", "--device", "cpu", *tls, *behind,
                           *args.server_args.split(),
                           repo=args.server_repo, env={"SENTIMENT_AUTH_TOKEN": TOKEN}, cpus=args.server_cpus)
    server.wait_listening()
    tls_ca = certs["ca"] if certs else None
    proxy = None
    try:
        port = server.port
        if args.via_haproxy:
            # deploy/proxy/haproxy.cfg on the server's cores: MODEL_CALLS MAXCONN, no call-rate limit unless asked
            proxy = FrontProxy(server.port, {"MODEL_CALLS": args.via_haproxy,
                                             "CALLS_PER_SOURCE_S": args.haproxy_source_limit or NO_LIMIT},
                               cpus=args.server_cpus)
            port = proxy.port
        seconds = args.seconds
        overload = name.startswith("overload")
        interval = str(args.probe_interval or (0.02 if overload else 0.1))  # overload: enough refusals for a p99
        probe_args = ["--probe", str(port), "--seconds", str(seconds + 2), "--interval", interval]
        probe = helper(*probe_args, *(["--tls-ca", str(tls_ca)] if tls_ca else []))
        assert probe.stdout is not None and probe.stdout.readline().strip() == "ready", "the probe did not start"
        load = None
        if overload:
            rate = ["--rate", str(args.overload_rate)] if name == "overload-rate" else []
            load = helper("--load", str(port), "--callers", "500", "--texts", "64", "--seconds",
                          str(seconds), *rate)
        proxy_cpu0 = proxy.cpu_seconds() if proxy else 0.0
        cpu0, t0, threads = server.cpu_seconds(), time.monotonic(), [server.threads()]
        sampler_stop = threading.Event()

        def sample() -> None:
            while not sampler_stop.wait(0.1):
                threads.append(server.threads())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        if load is not None:
            outcome = json.loads(load.communicate(timeout=seconds + 120)[0])
        else:
            outcome = {"ping-flood": ping_flood, "rapid-reset": rapid_reset, "zero-window": zero_window,
                       "wrong-tokens": wrong_tokens, "idle": idle, "window-overflow": window_overflow,
                       "none": no_attack, "idle-many": idle_many}[name](
                port, seconds, tls_ca)
        time.sleep(max(0.0, seconds - (time.monotonic() - t0)))  # CPU over the whole window, after a cut too
        wall = time.monotonic() - t0
        cpu = server.cpu_seconds() - cpu0
        proxy_cpu = (proxy.cpu_seconds() if proxy else 0.0) - proxy_cpu0
        sampler_stop.set()
        authorised = json.loads(probe.communicate(timeout=60)[0])
        alive = server.proc.poll() is None
        cuts = [line.split(": ", 1)[1].strip() for line in server.lines if "serving.guard" in line]
        return {"attack": name, "tls": certs is not None, "wall_s": round(wall, 2),
                "server_cpu_cores": round(cpu / wall, 2), "server_threads_max": max(threads),
                **({"proxy_cpu_cores": round(proxy_cpu / wall, 2)} if proxy is not None else {}),
                "server_alive": alive, "attacker": outcome, "authorised": authorised, "guard_log": cuts[:3]}
    finally:
        if proxy is not None:
            proxy.close()
        try:
            server.stop(30)
        finally:
            server.close()


def summary(r: dict) -> str:
    """One cell: what the attack cost and what became of the attacker's connection(s)."""
    a, who = r["attacker"], r["authorised"]
    if r["attack"].startswith("overload"):
        refused, answered = a.get("RESOURCE_EXHAUSTED", {}), a.get("OK", {})
        others = {code: v["calls"] for code, v in a.items() if code not in ("OK", "RESOURCE_EXHAUSTED")}
        cell = (f"load: {answered.get('calls', 0)} answered (p50 {answered.get('p50_ms')} ms), "
                f"{refused.get('calls', 0)} refused (p50/p99 {refused.get('p50_ms')}/{refused.get('p99_ms')} ms"
                + "".join(f"; {where.replace('_', ' ')} {refused[where]['calls']}, p50/p99 "
                          f"{refused[where]['p50_ms']}/{refused[where]['p99_ms']} ms"
                          for where in ("at_admission", "after_body") if where in refused)
                + ")" + (f", {others}" if others else "")
                + f"; the authorised client's refusals p50/p99 {who.get('refused_p50_ms')}/"
                f"{who.get('refused_p99_ms')} ms")
    elif r["attack"] == "none":
        cell = "no attack (the authorised client alone)"
    elif r["attack"] == "wrong-tokens":
        cell = f"{a['answered']} refusals in {a['elapsed_s']} s ({a['answers_per_s']}/s)" + (
            f", then {a['connections_refused']} connections not accepted (banned)" if a.get("connections_refused")
            else "")
    elif r["attack"] in ("idle", "idle-many"):
        cell = f"{a['kept']} of {a['opened']} connections kept after {a['kept_after_s']} s"
    elif r["attack"] == "zero-window":
        cell = f"{a['connections_ended']} of {a['of']} connections ended within {a['elapsed_s']} s"
    else:
        first = a.get("first", a)
        ended = "kept open" if first.get("closed_after_s") is None else f"ended after {first['closed_after_s']} s"
        goaway = f"GOAWAY {first['goaway_code']} after {first['goaway_after_s']} s, " \
            if first.get("goaway_code") is not None else "no GOAWAY, "
        cell = "first connection: " + goaway + ended + (f", {first['acks_after_goaway']} PINGs answered after the "
                                                        f"GOAWAY" if first.get("acks_after_goaway") else "")
        if "connections" in a:
            cell += f"; {a['connections']} connections in {r['wall_s']} s"
    refusals = sum(who["errors"].values())
    refused = f", {refusals} of {who['calls']} refused" if refusals else ""
    return (f"{cell}; server {r['server_cpu_cores']} cores, {r['server_threads_max']} threads at most; authorised "
            f"p50/p99 {who['p50_ms']}/{who['p99_ms']} ms (max {who['max_ms']}){refused}")


def table(before: Path, after: Path) -> str:
    """Markdown rows `| attack | before | after |` from two --json reports of the same attacks."""
    old = {(r["attack"], r["tls"]): r for r in json.loads(before.read_text())["results"]}
    rows = []
    for r in json.loads(after.read_text())["results"]:
        key = (r["attack"], r["tls"])
        name = r["attack"] + (" (TLS)" if r["tls"] else "")
        rows.append(f"| {name} | {summary(old[key]) if key in old else ''} | {summary(r)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bundle", type=Path, help="the bundle the server serves (bench/soak.py --make-bundle makes one)")
    p.add_argument("--attacks", default=",".join(ATTACKS),
                   help=f"comma-separated attacks to run, in order (default: all of {', '.join(ATTACKS)})")
    p.add_argument("--seconds", type=float, default=5.0, help="how long each attack runs (default: 5)")
    p.add_argument("--tls", action="store_true", help="serve and attack over TLS (a self-signed certificate)")
    p.add_argument("--server-repo", type=Path, default=REPO,
                   help="a checkout whose server to attack, e.g. an older tree for the before column "
                        "(default: this one)")
    p.add_argument("--server-args", default="", help="more server flags, e.g. '--max-workers 32'")
    p.add_argument("--overload-rate", type=float, default=200.0,
                   help="calls of 64 texts per second in the overload-rate attack (default: 200)")
    p.add_argument("--probe-interval", type=float, default=0.0,
                   help="seconds between the authorised client's calls (default: 0.1, and 0.02 in the overloads)")
    p.add_argument("--server-cpus", help="cores the server runs on, e.g. '0' or '0-3' (taskset's list; default: all)")
    p.add_argument("--client-cpus", help="cores this script, the authorised client and the load generator run on "
                                         "(default: all)")
    p.add_argument("--via-haproxy", type=int, metavar="MAXCONN",
                   help="put HAProxy with deploy/proxy/haproxy.cfg in front of the server (started --behind-proxy), "
                        "admitting MAXCONN calls at once (MODEL_CALLS) and refusing a call that waited 1 ms for a "
                        "slot; its per-address limits at their defaults, but for the call rate (plain text only)")
    p.add_argument("--haproxy-source-limit", type=int, metavar="REQS",
                   help="with --via-haproxy: the connections of an address that makes more than REQS calls a second "
                        "are dropped (CALLS_PER_SOURCE_S; default: no limit)")
    p.add_argument("--json", type=Path, help="write the report of every attack to this JSON file")
    p.add_argument("--table", type=Path, nargs=2, metavar=("BEFORE", "AFTER"),
                   help="print markdown rows from two --json reports, and exit")
    p.add_argument("--probe", type=int, help=argparse.SUPPRESS)
    p.add_argument("--load", type=int, help=argparse.SUPPRESS)
    p.add_argument("--interval", type=float, default=0.1, help=argparse.SUPPRESS)
    p.add_argument("--tls-ca", help=argparse.SUPPRESS)
    p.add_argument("--callers", type=int, default=500, help=argparse.SUPPRESS)
    p.add_argument("--texts", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.table:
        print(table(*args.table))
        return 0
    if args.probe:
        probe_main(args)
        return 0
    if args.load:
        load_main(args)
        return 0
    if args.bundle is None:
        p.error("--bundle is required")
    if args.haproxy_source_limit is not None and args.via_haproxy is None:
        p.error("--haproxy-source-limit needs --via-haproxy")
    if args.via_haproxy is not None:
        if args.via_haproxy < 1:
            p.error(f"--via-haproxy must be >= 1, got {args.via_haproxy}")
        if args.tls:
            p.error("--via-haproxy serves plain text only (no --tls)")
        if args.haproxy_source_limit is not None and args.haproxy_source_limit < 1:
            p.error(f"--haproxy-source-limit must be >= 1, got {args.haproxy_source_limit}")
        if shutil.which("haproxy") is None:
            p.error("--via-haproxy: haproxy not found (apt-get install haproxy)")
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
    certs = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.tls:
            from serving_fixtures import make_certs

            certs = make_certs(Path(tmp))
        results = []
        for name in args.attacks.split(","):
            result = run_attack(name, args, certs)
            print(json.dumps(result), flush=True)
            results.append(result)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": platform.machine(),
              "cores": os.cpu_count(), "load_average": os.getloadavg(), "server_repo": str(args.server_repo),
              "server_args": args.server_args, "server_cpus": args.server_cpus, "client_cpus": args.client_cpus,
              "via_haproxy": args.via_haproxy, "haproxy_source_limit": args.haproxy_source_limit,
              "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
