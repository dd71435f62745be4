"""Model repository under load: new versions swapped in, a damaged version refused, two models side by side, calls
cancelled in the queue (docs/BENCHMARKS.md, "Model repository under load").

    python bench/model_swap_bench.py --bundle BUNDLE [--bundle-b BUNDLE] [--phases swap bad two cancel] [--out FILE]

Each phase starts its own server, `python -m serving.server --model-repository DIR --model-control poll --device cpu`
(tests/serving_fixtures.py's ServerProcess) on a fresh DIR; the load is gRPC sentiment.v1 Classify from here, over
--channels connections, with reviews of cls-books-fr test.review.txt:
  swap    an open loop of --rate calls a second, one review each: --baseline-s, then --swaps versions in a row (each
          copied to DIR/sentiment/.incoming-N, renamed to N, waited for until the index shows N READY and N-1
          "unloaded"), then --tail-s. Failed calls; p50/p99 before and in the swap windows (rename to unload, + 1 s);
          the server's RSS at the end of the baseline, of the tail, and idle; the version that answered each call.
  bad     the same load; a version 2 whose model.onnx has one byte flipped is renamed in: failed calls, its index
          line, sentiment_model_loads_total{result="failed"}, the versions that answered.
  two     models a (--bundle) and b (--bundle-b): b alone at --concurrency closed-loop callers, again while h2load
          (bench/h2grpc.py) floods a with --flood-callers calls at a time, then alone again (--two-rounds floods, each
          followed by b alone); b under each flood against the mean of the runs alone beside it, their medians, and
          a's texts/s from the server's sentiment_texts_total.
  cancel  --batch-workers 1: --cancel-flood calls of 256 long reviews fill the queue, --cancelled one-review calls
          queue behind them and are cancelled by the client (grpc Future.cancel) once the server holds them; from its
          /metrics: texts computed (sentiment_texts_total) and dropped (sentiment_dropped_texts_total).
Prints a Markdown table per phase, writes the JSON (--out); exit code 1 when a phase could not finish.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))
import h2grpc  # noqa: E402
from bench_texts import DEFAULT_DATA, test_texts  # noqa: E402
from serving_fixtures import ServerProcess  # noqa: E402
from swap_loads import OpenLoop, Row, closed_loop, stats, stubs  # noqa: E402

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb  # noqa: E402

PHASES = ("swap", "bad", "two", "cancel")


def versions(rows: list[Row]) -> dict[str, int]:
    return dict(sorted(Counter(r[3] for r in rows if r[2] == "OK").items(), key=lambda kv: int(kv[0])))


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


class Served:
    """The server of repository `root` in a subprocess, and what the phases read of it."""

    def __init__(self, root: Path, poll_s: float, *extra: str) -> None:
        self.server = ServerProcess(None, "--model-repository", str(root), "--model-control", "poll",
                                    "--repository-poll-s", str(poll_s), "--device", "cpu", "--http-port", "0",
                                    "--metrics-port", "0", *extra)
        self.server.wait_listening(120)
        self.port = self.server.port

    def rss(self) -> int:
        return psutil.Process(self.server.proc.pid).memory_info().rss

    def index(self) -> dict[tuple[str, str], dict[str, str]]:
        """The repository index (REST), by (name, version)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.server.http_port}/v2/repository/index", data=b"{}",
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            return {(row["name"], row["version"]): row for row in json.loads(r.read())}

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """Every sample of its /metrics page, by (name, labels)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.server.metrics_port}/metrics", timeout=10) as r:
            page = r.read().decode()
        return {(s.name, frozenset(s.labels.items())): s.value
                for f in text_string_to_metric_families(page) for s in f.samples}

    def wait(self, condition, what: str, timeout: float = 120.0) -> float:
        """Polls `condition` every 20 ms; the time it held (time.monotonic()), or RuntimeError with the log's tail."""
        end = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > end or self.server.proc.poll() is not None:
                raise RuntimeError(f"{what}: not reached in {timeout} s (server exit code {self.server.proc.poll()});"
                                   f" its log ends:\n{''.join(self.server.lines[-15:])}")
            time.sleep(0.02)
        return time.monotonic()

    def state(self, version: str, state: str, reason: str | None = None, name: str = "sentiment") -> bool:
        row = self.index().get((name, version), {})
        return row.get("state") == state and (reason is None or row.get("reason") == reason)

    def stop(self) -> dict:
        """SIGTERM; its exit code and its log's error, warning and traceback lines."""
        try:
            rc = self.server.stop(60)
        finally:
            self.server.close()
        flagged = [x.rstrip() for x in self.server.lines if " ERROR " in x or " WARNING " in x or "Traceback" in x]
        return {"exit_code": rc, "log_flagged": flagged[:20]}


def place(root: Path, name: str, version: int, bundle: Path, flip: str | None = None) -> float:
    """The bundle copied to root/name/.incoming-VERSION (one byte of its file `flip` inverted), then renamed to
    VERSION, atomic: the time of the rename."""
    tmp = root / name / f".incoming-{version}"
    shutil.copytree(bundle, tmp)
    if flip:
        data = bytearray((tmp / flip).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (tmp / flip).write_bytes(bytes(data))
    at = time.monotonic()
    os.rename(tmp, root / name / str(version))
    return at


def phase_swap(args: argparse.Namespace, texts: list[str], root: Path, bad: bool = False) -> dict:
    """The phase swap; with `bad`, the phase bad (one version 2, its model.onnx with a byte flipped)."""
    place(root, "sentiment", 1, args.bundle)
    served = Served(root, args.poll_s, *args.server_args.split())
    try:
        load = OpenLoop(served.port, texts, args.rate, args.channels)
        t0 = time.monotonic()
        time.sleep(args.baseline_s)
        rss_before, swaps = served.rss(), []
        for new in range(2, 3 if bad else 2 + args.swaps):
            s = {"version": new, "renamed": place(root, "sentiment", new, args.bundle, "model.onnx" if bad else None)}
            if bad:
                s["refused"] = served.wait(lambda: served.state("2", "UNAVAILABLE"), "version 2 refused")
                s["failed_loads"] = metric(served.metrics(), "sentiment_model_loads_total", result="failed")
            else:
                s["ready"] = served.wait(lambda v=str(new): served.state(v, "READY"), f"version {new} READY")
                s["unloaded"] = served.wait(lambda v=str(new - 1): served.state(v, "UNAVAILABLE", "unloaded"),
                                            f"version {new - 1} unloaded")
            swaps.append(s)
            time.sleep(args.swap_gap_s)
        time.sleep(max(0.0, args.tail_s - args.swap_gap_s))  # (bad: several polls, the refused version left alone)
        rss_after, index = served.rss(), served.index()
        rows = load.stop()
        time.sleep(0 if bad else args.idle_s)  # no call: the server's reclaimer runs (memory_reclaim_idle_s)
        rss_idle, m = served.rss(), served.metrics()
    finally:
        end = served.stop()
    result = {"rate": args.rate, **stats(rows), "versions": versions(rows), "server": end,
              "failed_examples": [(round(r[0] - t0, 3), r[2], r[3]) for r in rows if r[2] != "OK"][:10],
              "model_loads": {x: metric(m, "sentiment_model_loads_total", result=x)
                              for x in ("loaded", "failed", "unloaded")}}
    if bad:
        s = swaps[0]
        return {**result, "rename_to_refused_s": round(s["refused"] - s["renamed"], 2),
                "index": [index[k] for k in sorted(index)], "failed_loads_at_refusal": s["failed_loads"],
                "versions_after_rename": versions([r for r in rows if r[0] >= s["renamed"]])}
    windows = [(s["renamed"], s["unloaded"] + 1.0) for s in swaps]
    warm = t0 + min(2.0, args.baseline_s / 2)  # the load's first 2 s: connections and arenas warming up
    before, during = stats([r for r in rows if warm <= r[0] < windows[0][0]]), \
        stats([r for r in rows if any(a <= r[0] < b for a, b in windows)])
    # A call sent once version N-1 was unloaded can only be answered by N or later.
    stale = sum(int(r[3]) < max([s["version"] for s in swaps if s["unloaded"] <= r[0]], default=1)
                for r in rows if r[2] == "OK")
    per_swap = [{"version": s["version"], "rename_to_ready_s": round(s["ready"] - s["renamed"], 2),
                 "ready_to_unloaded_s": round(s["unloaded"] - s["ready"], 2),
                 **stats(inside := [r for r in rows if a <= r[0] < b]), "versions": versions(inside)}
                for s, (a, b) in zip(swaps, windows, strict=True)]
    return {**result, "swaps": len(swaps), "before": before, "during": during,
            "p99_ratio": round(during["p99_ms"] / before["p99_ms"], 2), "per_swap": per_swap,
            "rss_mib": {k: round(v / 2**20, 1) for k, v in (("before", rss_before), ("after", rss_after),
                                                            ("idle_after", rss_idle))},
            "rss_ratio": round(rss_after / rss_before, 3),
            "answers_from_an_unloaded_version": stale}


def flood_window(args: argparse.Namespace, texts: list[str], served: Served, body: Path) -> tuple[dict, dict]:
    """b at --concurrency for --two-s while h2load floods a: b's closed loop, and a's texts/s by the server's count."""
    connections = min(args.flood_callers, 16)
    streams = -(-args.flood_callers // connections)
    flood = subprocess.Popen(h2grpc.command(served.port, body, args.two_s + 6, connections, streams),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        before = metric(served.metrics(), "sentiment_texts_total", model="a")
        served.wait(lambda: metric(served.metrics(), "sentiment_texts_total", model="a") > before,
                    "the flood of model a answered", timeout=60)
        a0, t0 = metric(served.metrics(), "sentiment_texts_total", model="a"), time.monotonic()
        flooded = closed_loop(served.port, texts, args.concurrency, args.two_s, "b", args.channels)
        a1, t1 = metric(served.metrics(), "sentiment_texts_total", model="a"), time.monotonic()
        report = flood.communicate(timeout=60)[0]
    finally:
        flood.kill()
    sent = re.search(r"requests: (\d+) total", report)
    return flooded, {"callers": connections * streams, "client": f"h2load, {connections} connections x {streams} "
                     "streams", "texts_per_s": round((a1 - a0) / (t1 - t0), 1),
                     "h2load_requests": int(sent.group(1)) if sent else None}


def phase_two(args: argparse.Namespace, texts: list[str], root: Path) -> dict:
    """--two-rounds floods, each between two runs of b alone, on one server: each flood's share and p99 are against
    the mean of the runs beside it, so that the machine's drift over minutes falls on both; the medians are given."""
    place(root, "a", 1, args.bundle)
    place(root, "b", 1, args.bundle_b)
    served = Served(root, args.poll_s, *args.server_args.split())
    # The flood is h2load's: a Python client of 64 callers would take a core of the two the server runs on.
    alone, floods, a_floods = [], [], []
    try:
        alone.append(closed_loop(served.port, texts, args.concurrency, args.two_s, "b", args.channels))
        with tempfile.TemporaryDirectory() as tmp:
            body = Path(tmp) / "a.grpc"
            body.write_bytes(h2grpc.grpc_body(texts[:1], model_name="a"))
            for _ in range(args.two_rounds):
                flooded, a = flood_window(args, texts, served, body)
                floods.append(flooded)
                a_floods.append(a)
                alone.append(closed_loop(served.port, texts, args.concurrency, args.two_s, "b", args.channels))
    finally:
        end = served.stop()
    rounds = [{"share": round(2 * f["texts_per_s"] / (alone[i]["texts_per_s"] + alone[i + 1]["texts_per_s"]), 3),
               "p99_ratio": round(2 * f["p99_ms"] / (alone[i]["p99_ms"] + alone[i + 1]["p99_ms"]), 2)}
              for i, f in enumerate(floods)]
    return {"b_alone": alone[0], "b_flooded": floods[0], "b_alone_again": alone[1], "a_flood": a_floods[0],
            "b_refused_in_flood": sum(n for f in floods for c, n in f["codes"].items()
                                      if c in ("RESOURCE_EXHAUSTED", "UNAVAILABLE")),
            "rounds": rounds, "b_share": statistics.median(r["share"] for r in rounds),
            "b_p99_ratio": statistics.median(r["p99_ratio"] for r in rounds), "server": end}


def phase_cancel(args: argparse.Namespace, texts: list[str], root: Path) -> dict:
    place(root, "sentiment", 1, args.bundle)
    k = 256  # texts a call of the flood: 16 calls (16 handler threads) hold 4,096 texts
    flood_texts = k * args.cancel_flood
    # max_queue: a call is admitted only while one of max_texts would fit beside the texts waiting
    served = Served(root, args.poll_s, *args.server_args.split(), "--batch-workers", "1", "--max-texts", str(k),
                    "--max-queue", str(flood_texts + args.cancelled + k))
    # Flood texts cut to max_len (2,000 characters), the cancelled ones short: runs group close lengths, never both
    pool = " ".join(texts * 8)
    long, short = [pool[i * 2000 : (i + 1) * 2000] for i in range(k)], [t[:100] for t in texts]

    def in_batcher() -> float:  # texts run or running since `before` (a run observes its queue time), and waiting
        m = served.metrics()
        return metric(m, "sentiment_queue_seconds_count") - metric(before, "sentiment_queue_seconds_count") + \
            metric(m, "sentiment_queue_depth")

    try:
        opened = stubs(served.port, args.channels)
        opened[0].Classify(pb.ClassifyRequest(texts=texts[:1]), timeout=30)
        before = served.metrics()
        flood = [opened[i % len(opened)].Classify.future(pb.ClassifyRequest(texts=long), timeout=300)
                 for i in range(args.cancel_flood)]
        served.wait(lambda: in_batcher() >= flood_texts, "the flood in the queue")  # the calls queue behind it
        calls = [opened[i % len(opened)].Classify.future(pb.ClassifyRequest(texts=[short[i % len(short)]]),
                                                          timeout=300) for i in range(args.cancelled)]
        served.wait(lambda: in_batcher() >= flood_texts + args.cancelled or any(f.done() for f in calls),
                    "the calls to cancel in the queue")  # (one done already: the flood was too short to hold them)
        at_cancel = {"queue_depth": metric(served.metrics(), "sentiment_queue_depth"), "calls_answered":
                     sum(f.done() for f in calls), "flood_calls_left": sum(not f.done() for f in flood)}
        for f in calls:
            f.cancel()
        outcomes = Counter(["flood " + (f.code().name if f.exception() else "OK") for f in flood]
                           + ["cancelled" if f.cancelled() else f"not cancelled: {f.code().name}" for f in calls])
        served.wait(lambda: metric(served.metrics(), "sentiment_calls_in_flight") == 0, "no call in flight")
        after = served.metrics()
    finally:
        end = served.stop()

    computed = metric(after, "sentiment_texts_total") - metric(before, "sentiment_texts_total")
    answered = k * outcomes["flood OK"]
    return {"flood_calls": args.cancel_flood, "flood_texts_per_call": k, "cancelled_calls": args.cancelled,
            "at_cancel": at_cancel, "outcomes": dict(outcomes), "texts_computed": computed,
            "flood_texts_answered": answered, "reached_the_model": computed - answered, **{
                f"dropped_{reason}": metric(after, "sentiment_dropped_texts_total", reason=reason)
                - metric(before, "sentiment_dropped_texts_total", reason=reason)
                for reason in ("Cancelled", "DeadlineExpired")}, "server": end}


# What each phase's table shows of its results: key, measure, target.
SHOWN = {
    "swap": [("calls", "calls sent", ""), ("failed", "failed calls", "0"), ("before", "before the swaps (ms)", ""),
             ("during", "in the swap windows (ms)", ""), ("p99_ratio", "p99 in the windows / before", "<= 2"),
             ("rss_mib", "server RSS, MiB", ""), ("rss_ratio", "RSS after the last swap / one version", "<= 1.10"),
             ("versions", "answers by version", ""), ("per_swap", "each swap (s, ms)", ""),
             ("answers_from_an_unloaded_version", "answers from a version unloaded before the call was sent", "0")],
    "bad": [("calls", "calls sent", ""), ("failed", "failed calls", "0"), ("index", "repository index", ""),
            ("rename_to_refused_s", "rename -> refused, s", ""), ("model_loads", "sentiment_model_loads_total", ""),
            ("failed_loads_at_refusal", 'sentiment_model_loads_total{result="failed"} at the refusal', "1"),
            ("versions_after_rename", "answers after the rename, by version", "1 only")],
    "two": [("b_alone", "b alone", ""), ("b_flooded", "b while a is flooded", ""), ("a_flood", "a's flood", ""),
            ("b_alone_again", "b alone again", ""), ("b_refused_in_flood", "b's refusals in the flood", "0"),
            ("rounds", "each flood / the runs alone beside it", ""),
            ("b_share", "b's texts/s in the flood / alone (median)", ">= 0.40"),
            ("b_p99_ratio", "b's p99 in the flood / alone (median)", "<= 3")],
    "cancel": [("at_cancel", "when cancelled", "flood calls left > 0, calls answered 0"), ("outcomes", "outcomes", ""),
               ("texts_computed", "texts computed", ""), ("flood_texts_answered", "of them the flood's", ""),
               ("dropped_Cancelled", "dropped: Cancelled", ""), ("dropped_DeadlineExpired", "... DeadlineExpired", ""),
               ("reached_the_model", "texts of the cancelled calls that reached the model", "0")],
}


def cell(v: object) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {cell(x)}" for k, x in v.items())
    if isinstance(v, list):
        return "; ".join(cell(x) for x in v)
    return f"{v:g}" if isinstance(v, float) else str(v).replace("|", "/")


def tables(r: dict) -> str:
    """One Markdown table per phase run: measure, value, target."""
    out = []
    for phase in (p for p in PHASES if p in r):
        out += [f"### {phase}", "", "| measure | value | target |", "|---|---|---|"]
        out += [f"| error | {cell(r[phase]['error'])} | |"] if "error" in r[phase] else \
            [f"| {label} | {cell(r[phase][key])} | {target} |" for key, label, target in SHOWN[phase]]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True, help="bundle copied in as each version (and model a)")
    ap.add_argument("--bundle-b", type=Path, help="two: model b's bundle (default: --bundle)")
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES), help="phases to run, in order")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder holding cls-books-fr/")
    ap.add_argument("--rate", type=float, default=200.0, help="swap, bad: calls a second, one review each")
    ap.add_argument("--channels", type=int, default=4, help="gRPC connections of each load")
    ap.add_argument("--baseline-s", type=float, default=15.0, help="swap, bad: seconds of load before the rename")
    ap.add_argument("--swaps", type=int, default=5, help="swap: new versions renamed in, one after the other")
    ap.add_argument("--swap-gap-s", type=float, default=2.0, help="swap: seconds from an unload to the next rename")
    ap.add_argument("--tail-s", type=float, default=10.0, help="swap, bad: seconds of load after the last change")
    ap.add_argument("--idle-s", type=float, default=7.0, help="swap: seconds idle before the last RSS reading")
    ap.add_argument("--poll-s", type=float, default=1.0, help="the server's --repository-poll-s")
    ap.add_argument("--concurrency", type=int, default=16, help="two: model b's closed-loop callers")
    ap.add_argument("--two-s", type=float, default=10.0, help="two: measured seconds of each run of b")
    ap.add_argument("--flood-callers", type=int, default=64, help="two: h2load's calls at once (flooding model a)")
    ap.add_argument("--two-rounds", type=int, default=1, help="two: floods, each followed by a run of b alone")
    ap.add_argument("--cancel-flood", type=int, default=16, help="cancel: calls of 256 long reviews queued first")
    ap.add_argument("--cancelled", type=int, default=100, help="cancel: one-review calls queued, then cancelled")
    ap.add_argument("--server-args", default="", help="more server options, e.g. '--max-concurrent-rpcs 32'")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args(argv)
    args.bundle_b = args.bundle_b or args.bundle
    # SIGTERM (a timeout, a scheduler) unwinds like ^C: each phase's finally stops its server, which would outlive
    # this process otherwise, and the temporary repository goes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    from contract.bundle import verify_bundle

    for flag, path in (("--bundle", args.bundle), ("--bundle-b", args.bundle_b)):
        try:
            verify_bundle(path)  # a missing or damaged bundle: one line, exit 2, before any server starts
        except ValueError as e:
            ap.error(f"{flag}: {e}")
    if "two" in args.phases and not h2grpc.available():
        ap.error(f"the phase two: {h2grpc.MISSING}")
    bad = [f"--{n.replace('_', '-')} {v}" for n, v in vars(args).items() if type(v) in (int, float)
           and (v < 0 or v == 0 and n not in ("swap_gap_s", "idle_s"))]
    if bad:
        ap.error(f"{', '.join(bad)}: counts and durations must be > 0 (--swap-gap-s, --idle-s >= 0)")

    texts = test_texts(ap, args.data, 256)
    result: dict = {"bundle": str(args.bundle), "bundle_b": str(args.bundle_b), "args": sys.argv[1:] if argv is None
                    else argv, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "date": time.strftime("%Y-%m-%d"), "load_average_start": [round(x, 2) for x in os.getloadavg()]}
    runs = {"swap": phase_swap, "bad": lambda *a: phase_swap(*a, bad=True), "two": phase_two, "cancel": phase_cancel}
    for phase in args.phases:
        with tempfile.TemporaryDirectory(prefix=f"model-swap-{phase}-") as tmp:
            t0 = time.monotonic()
            try:
                result[phase] = runs[phase](args, texts, Path(tmp))
            except RuntimeError as e:  # the server did not do what the phase waited for: said, and the next phase
                result[phase] = {"error": str(e)}
            result[phase]["seconds"] = round(time.monotonic() - t0, 1)
    result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(tables(result))
    print(f"bundle {args.bundle}; machine {result['machine']}; {result['date']}; load average at start "
          f"{result['load_average_start'][0]}, at end {result['load_average_end'][0]}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 1 if any("error" in result[p] for p in args.phases) else 0


if __name__ == "__main__":
    sys.exit(main())
