"""Requests/s ceiling of the server against its number of worker processes (`--workers N`), and the CPU time each
request costs the server's processes outside onnxruntime.

    python bench/soak.py --make-bundle /tmp/tiny-bundle --size tiny     # once: the tests' tiny model
    python bench/workers_bench.py --bundle /tmp/tiny-bundle [--workers 1 2] [--seconds 5] [--json out.json]
    python bench/workers_bench.py --bundle /tmp/tiny-bundle --workers 1 --profile /tmp/request-path.txt
    # many cores: the server on 0-13, h2load on 14-15 (its own cores), the floor at every count
    python bench/workers_bench.py --bundle /tmp/lab-bundle --workers 1 2 4 8 --floor \
        --server-cpus 0-13 --client-cpus 14-15 --client-threads 2 --connections 64

--profile FILE samples the (first) worker with py-spy (a dev dependency) during the measured seconds, writes the
stacks to FILE (py-spy's raw format: one collapsed stack and its count a line) and prints where the thread
holding the interpreter lock spent its samples: by function, and by area (gRPC, protobuf, tokenizer, batcher...).

With the tiny model (vocab 99, width 32, 2 layers) onnxruntime costs next to nothing: what is measured is the
request path (gRPC, protobuf, tokenization, batching, futures) in Python. The load generator is h2load (Debian:
nghttp2-client), a C HTTP/2 client that sends one ready-made gRPC request (one review) over `--connections`
connections, `--streams` calls at a time on each: it costs the cores far less than a Python client would, and its
own CPU share is printed. Calls are counted by the server (sentiment_requests_total{code="OK"}), not by h2load,
which does not read gRPC status trailers.

--switches counts, over the measured seconds, the context switches (voluntary and not, /proc/PID/task/TID/status)
of the first server's threads per call, summed by the thread's Python name (py-spy dump; a pool's numbers cut, so a
pool is one line): each is a thread put to sleep or woken, which on a VM's halted cores costs more than the Python
around it. Beside them, each name's CPU ms per call (user + system, /proc/PID/task/TID/stat): where a server's CPU
for a call goes, thread by thread, against the floor's.

--floor measures the bare grpcio server (bench/grpc_floor.py) at every worker count too: N such processes share the
port as the workers do (grpcio sets SO_REUSEPORT), so serving/ is compared with what gRPC alone serves on as many
processes. --server-cpus and --client-cpus pin the servers and h2load to disjoint cores (taskset), so that the load
generator takes no core the server scales onto.

Per request, from /proc/PID/stat of the server's processes (the workers, or the one server) over the measured
seconds: CPU ms (user + system, every thread: gRPC's, the handlers', the batcher's and onnxruntime's) and the
wall ms of onnxruntime runs (sentiment_inference_seconds); their difference is the CPU spent outside onnxruntime
(a lower bound when a run is preempted, as its wall time then exceeds its CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import h2grpc  # noqa: E402
from bench_texts import reviews as test_reviews  # noqa: E402
from serve_bench import DEFAULT_DATA, Server, cpu_seconds  # noqa: E402


def ok_calls(servers: list[Server]) -> float:
    total = 0.0
    for server in servers:
        m = re.search(r'^sentiment_requests_total\{code="OK",method="sentiment.v1.SentimentService/Classify",'
                      r'protocol="grpc"\} (\S+)$', server.scrape(), re.M)
        total += float(m.group(1)) if m else 0.0
    return total


def h2load(port: int, body: Path, seconds: float, args: argparse.Namespace) -> tuple[str, float]:
    """h2load's report and the CPU seconds it used; on --client-cpus when given."""
    return h2grpc.run(port, body, seconds, args.connections, args.streams, args.client_threads, args.client_cpus)


AREAS = [  # (area, substring of a frame's file), first match wins
    ("onnxruntime run", "onnxruntime"), ("tokenizer (sentencepiece, contract/tokens.py)", "sentencepiece"),
    ("tokenizer (sentencepiece, contract/tokens.py)", "contract/tokens.py"), ("protobuf", "protobuf"),
    ("prometheus_client", "prometheus_client"),
    ("batcher", "serving/model/batcher.py"), ("gate", "serving/protocols/grpc/interceptor.py"),
    ("gate", "serving/limits/"), ("servicer", "serving/protocols/grpc/sentiment.py"),
    ("core", "serving/model/core.py"), ("predictor", "serving/model/predictor.py"),
    ("HTTP (serving/protocols/http/)", "serving/protocols/http/"), ("servicer", "serving/protocols/"),
    ("gRPC Python (grpc/)", "grpc/"),  # after ours: serving/protocols/grpc/ holds "grpc/" too
    ("numpy", "numpy"), ("threading / futures", "threading.py"), ("threading / futures", "concurrent/futures"),
    ("uvicorn + httptools", "uvicorn/"),
    ("uvicorn + httptools", "httptools"), ("Starlette", "starlette/"), ("JSON", "orjson"), ("JSON", "json/"),
    ("telemetry", "serving/telemetry/"), ("event loop", "asyncio/"),
]


def profile_summary(raw: Path, top: int = 15) -> str:
    """Samples by leaf function and by area, as shares of all samples (py-spy --gil: of the thread holding the
    interpreter lock, the Python that one process runs one thread at a time)."""
    by_leaf: dict[str, int] = {}
    by_area: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        leaf = re.sub(r":\d+\)$", ")", frames[-1])
        # py-spy --full-filenames: paths cut to the package's, the standard library's or this repository's
        leaf = re.sub(r"\((.*/site-packages/|.*/lib/python3\.\d+/|" + re.escape(f"{REPO}/") + ")", "(", leaf)
        by_leaf[leaf] = by_leaf.get(leaf, 0) + n
        area = next((name for name, key in AREAS if key in frames[-1]), "other")
        # A leaf in a library called from our code counts as that library; a leaf in the standard library (a
        # lock, a queue) counts as the caller's area when one of ours is in the stack.
        if area == "other":
            area = next((name for f in reversed(frames) for name, key in AREAS if key in f), "other")
        by_area[area] = by_area.get(area, 0) + n
        total += n
    out = [f"{total} samples of the thread holding the GIL", "", "| function (leaf frame) | share |", "|---|---|"]
    out += [f"| `{k}` | {100 * v / total:.1f}% |" for k, v in sorted(by_leaf.items(), key=lambda x: -x[1])[:top]]
    out += ["", "| area (leaf frame's, else the nearest caller's) | share |", "|---|---|"]
    out += [f"| {k} | {100 * v / total:.1f}% |" for k, v in sorted(by_area.items(), key=lambda x: -x[1])]
    return "\n".join(out)


def thread_names(pid: int) -> dict[int, str]:
    """OS thread id -> Python thread name (py-spy dump: the threads that run Python; the others keep their comm)."""
    spy = Path(sys.executable).parent / "py-spy"
    out = subprocess.run([str(spy), "dump", "-p", str(pid)], capture_output=True, text=True, timeout=60).stdout
    return {int(tid, 0): name for tid, name in re.findall(r'Thread (\S+) \([^)]*\): "([^"]*)"', out)}


def switches(pid: int, names: dict[int, str]) -> Counter:
    """Context switches so far of the live threads of `pid`, summed by name with a pool's numbers cut (grpc_3 and
    grpc_12 are both grpc, ThreadPoolExecutor-0_3 is ThreadPoolExecutor)."""
    return _per_thread(pid, names)[0]


def thread_cpu(pid: int, names: dict[int, str]) -> Counter:
    """CPU seconds (user + system) so far of the live threads of `pid`, summed by name as `switches` sums them."""
    return _per_thread(pid, names)[1]


def _per_thread(pid: int, names: dict[int, str]) -> tuple[Counter, Counter]:
    switched: Counter = Counter()
    cpu: Counter = Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = names.get(int(tid)) or Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        name = re.sub(r"([-_]\d+)+$", "", name)
        switched[name] += sum(map(int, re.findall(r"^(?:non)?voluntary_ctxt_switches:\s+(\d+)$", status, re.M)))
        fields = stat[stat.rindex(")") + 2:].split()  # after "tid (comm) ": utime and stime are fields[11:13]
        cpu[name] += (int(fields[11]) + int(fields[12])) / tick
    return switched, cpu


def start(bundle: Path, workers: int, args: argparse.Namespace, floor: bool) -> list[Server]:
    """The server with `workers` processes, or that many bare grpcio floors on one port (the first picks it)."""
    if not floor:
        return [Server(bundle, "--workers", str(workers), "--intra-op-threads", "1", *args.server_args.split(),
                       cpus=args.server_cpus)]
    servers: list[Server] = []
    try:
        for _ in range(workers):
            port = str(servers[0].port) if servers else "0"
            servers.append(Server(bundle, "--intra-op-threads", "1", "--port", port, floor=True,
                                  cpus=args.server_cpus))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def measure(bundle: Path, workers: int, body: Path, args: argparse.Namespace, floor: bool = False) -> dict:
    servers = start(bundle, workers, args, floor)
    server, pids = servers[0], [pid for s in servers for pid in s.pids]
    try:
        h2load(server.port, body, min(2.0, args.seconds / 2), args)  # warm-up
        names = thread_names(server.pids[0]) if args.switches else {}
        switched0, threads0 = _per_thread(server.pids[0], names) if args.switches else (Counter(), Counter())
        calls0 = ok_calls(servers)
        runs0 = sum(s.metric("sentiment_inference_seconds_sum") for s in servers)
        cpu0, t0 = cpu_seconds(pids), time.perf_counter()
        spy = None
        if args.profile:
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(server.pids[0]),
                                    "-d", str(max(1, int(args.seconds) - 1)), "-r", "200", "-f", "raw", "-o",
                                    str(args.profile), "--nonblocking", "--gil"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        report, client_cpu = h2load(server.port, body, args.seconds, args)
        if spy is not None:
            spy.wait(60)
        elapsed, cpu1 = time.perf_counter() - t0, cpu_seconds(pids)
        calls1 = ok_calls(servers)
        switched, threads = _per_thread(server.pids[0], names) if args.switches else (Counter(), Counter())
        switched, threads = switched - switched0, threads - threads0
        runs1 = sum(s.metric("sentiment_inference_seconds_sum") for s in servers)
        sent = re.search(r"requests: (\d+) total", report)
    finally:
        for s in servers:
            s.stop()
    calls, cores = calls1 - calls0, os.cpu_count() or 1
    return {"workers": workers, "floor": floor, "requests_per_s": calls / elapsed, "calls": calls,
            "h2load_requests": int(sent.group(1)) if sent else None,
            "server_cpu_ms": 1e3 * (cpu1 - cpu0) / calls, "ort_wall_ms": 1e3 * (runs1 - runs0) / calls,
            "server_cpu_share": (cpu1 - cpu0) / (elapsed * cores), "client_cpu_share": client_cpu / (elapsed * cores),
            **({"switches_per_call": {k: round(n * workers / calls, 2) for k, n in switched.most_common() if n},
                "cpu_ms_per_call": {k: round(1e3 * v * workers / calls, 3) for k, v in threads.most_common() if v}}
               if args.switches else {})}


def cores(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def cpu_list(text: str) -> str:
    """A taskset core list (0-13, 0,2,4): checked here, so that a typo fails before any server starts."""
    if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a core list such as 0-13 or 0,2,4")
    allowed = os.sched_getaffinity(0)
    if not set(cores(text)) <= allowed:
        raise argparse.ArgumentTypeError(f"{text}: cores {sorted(set(cores(text)) - allowed)} are not this "
                                         f"process's (it may run on {sorted(allowed)})")
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True, help="bundle to serve (the tiny one: see above)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker process counts to measure")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per count (after a warm-up)")
    ap.add_argument("--connections", type=int, default=32, help="h2load connections (spread over the workers)")
    ap.add_argument("--streams", type=int, default=4, help="calls at once on each connection")
    ap.add_argument("--client-threads", type=int, default=1, help="h2load threads (-t)")
    ap.add_argument("--server-cpus", type=cpu_list, help="cores the servers run on (taskset list, e.g. 0-13)")
    ap.add_argument("--client-cpus", type=cpu_list, help="cores h2load runs on (e.g. 14-15), not the servers'")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder holding cls-books-fr/")
    ap.add_argument("--server-args", default="", help="extra server options")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--profile", type=Path, help="py-spy the first worker during the measure; stacks to this file")
    ap.add_argument("--switches", action="store_true",
                    help="count the first server's context switches and CPU ms a call, by thread name (needs py-spy)")
    ap.add_argument("--floor", action="store_true",
                    help="also measure, at each count, as many bare grpcio servers (bench/grpc_floor.py) on one port")
    args = ap.parse_args()
    if not h2grpc.available():
        ap.error(h2grpc.MISSING)
    if (args.switches or args.profile) and not (Path(sys.executable).parent / "py-spy").is_file():
        ap.error(f"--switches and --profile need py-spy beside {sys.executable} (a dev dependency: make setup)")
    if min(args.workers) < 1 or args.client_threads < 1 or args.connections < args.client_threads:
        ap.error("--workers and --client-threads take counts >= 1, --connections at least one per client thread")
    if args.server_cpus and args.client_cpus and set(cores(args.server_cpus)) & set(cores(args.client_cpus)):
        ap.error(f"--server-cpus {args.server_cpus} and --client-cpus {args.client_cpus} share cores")
    reviews = sorted(test_reviews(ap, args.data), key=len)
    text = reviews[len(reviews) // 2]  # the median length
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "classify.grpc"
        body.write_bytes(h2grpc.grpc_body([text]))
        rows, floors = [], {}
        for n in args.workers:
            rows.append(measure(args.bundle, n, body, args))
            if args.floor:
                floors[n] = measure(args.bundle, n, body, args, floor=True)
    print("| workers | requests/s | server CPU ms per request | of which onnxruntime runs (wall) ms | outside "
          "onnxruntime ms | CPU share: server / h2load | bare grpcio floor, as many processes: requests/s | "
          "serving/ / floor |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        f = floors.get(r["workers"])
        floor = f"{f['requests_per_s']:.0f} | {100 * r['requests_per_s'] / f['requests_per_s']:.0f}%" if f else " | "
        print(f"| {r['workers']} | {r['requests_per_s']:.0f} | {r['server_cpu_ms']:.3f} | {r['ort_wall_ms']:.3f} | "
              f"{r['server_cpu_ms'] - r['ort_wall_ms']:.3f} | {100 * r['server_cpu_share']:.0f}% / "
              f"{100 * r['client_cpu_share']:.0f}% | {floor} |")
    base = rows[0]["requests_per_s"]
    for r in rows[1:]:
        print(f"{r['workers']} workers / {rows[0]['workers']}: {r['requests_per_s'] / base:.2f}x")
    pinned = f"; server on cores {args.server_cpus}" if args.server_cpus else ""
    pinned += f", h2load on cores {args.client_cpus} ({args.client_threads} threads)" if args.client_cpus else ""
    print(f"one review of {len(text)} characters (the median) per call; {args.connections} connections x "
          f"{args.streams} streams{pinned}; machine: {platform.machine()}, {os.cpu_count()} cores; "
          f"{time.strftime('%Y-%m-%d')}")
    for r in rows + list(floors.values()) if args.switches else []:
        per_call = r["switches_per_call"]
        print(f"{'floor' if r['floor'] else 'serving/'}, {r['workers']} process(es), context switches a call (first "
              f"process): {sum(per_call.values()):.1f}: " + ", ".join(f"{k} {v:.2f}" for k, v in per_call.items()))
        cpu = r["cpu_ms_per_call"]
        print(f"{'floor' if r['floor'] else 'serving/'}, {r['workers']} process(es), CPU ms a call by thread (first "
              f"process): {sum(cpu.values()):.3f}: " + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items()))
    if args.profile:
        print("\n" + profile_summary(args.profile))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "floor": list(floors.values()), "args": sys.argv[1:]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
