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
another machine would not. The attacks, the clients, one attack's run and the report are bench/attacks/'s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from attacks.clients import load_main, probe_main  # noqa: E402
from attacks.report import table  # noqa: E402
from attacks.run import ATTACKS, TIMED_S, Setup, run_attack  # noqa: E402


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
