"""serving/ against the bare grpcio floor in one run: short slices of the same load, alternating between two servers
that stay up, so that what the machine's speed does over minutes falls on both.

    python bench/floor_ratio.py --bundle /tmp/lab-bundle [--concurrency 8 64] [--slices 12] [--seconds 2]
    python bench/floor_ratio.py --bundle /tmp/lab-bundle --client h2load --concurrency 8 --slices 24
    python bench/floor_ratio.py --bundle /tmp/lab-bundle --client h2load --against /tmp/before   # and another tree

Both servers start once (`python -m serving.server BUNDLE --device cpu`, and bench/grpc_floor.py over the same
bundle) and the idle one waits. For each concurrency, `--slices` pairs of slices: serving/, then the floor, then the
floor, then serving/ (each slice bench/serve_bench.py's closed loop, its warm-up then `--seconds` measured: one
review of the cls-books-fr test split a call). Each slice of serving/ is divided by the mean of the floor's slices on
either side of it; the figure is the median of those ratios, with their spread. On this 2-core machine the rate of one
server moves 20% from one minute to the next (docs/BENCHMARKS.md): bench/serve_bench.py's `--modes on floor`, one
after the other, measures that as much as the servers.

`--client h2load` sends the slices from h2load (bench/h2grpc.py: a C client, 1-2% of the cores, where the Python
client's own CPU a call narrows every gap): `--concurrency` connections, one call at a time on each, the median
review of the test split every call, a slice's rate the calls the server counted (h2load reads no gRPC trailers)
over its wall time; each server is warmed up once per concurrency.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import h2grpc  # noqa: E402
from bench_texts import DEFAULT_DATA, reviews, test_texts  # noqa: E402
from serve_bench import Server, bench_server  # noqa: E402
from workers_bench import ok_calls  # noqa: E402

Rate = Callable[[Server], float]  # one slice against a server: its texts/s


def python_slices(texts: list[str], c: int, seconds: float) -> Rate:
    """serve_bench's closed loop: c callers, one review of `texts` a call, its own warm-up every slice."""
    return lambda server: bench_server(server, "", texts, c, seconds)["texts_per_s"]


def h2load_slices(body: Path, c: int, seconds: float) -> Rate:
    """h2load over c connections, one call at a time on each, `body` every call; calls as the server counts them."""

    def rate(server: Server) -> float:
        before, start = ok_calls([server]), time.perf_counter()
        h2grpc.run(server.port, body, seconds, c, 1)
        return (ok_calls([server]) - before) / (time.perf_counter() - start)

    return rate


def ratios(rate: Rate, serving: Server, floor: Server, c: int, slices: int, against: Server | None = None) -> dict:
    """The slices at concurrency c, in the order serving/, floor, floor, serving/, ...: each serving/ slice over the
    mean of its neighbouring floor slices. With `against` (another tree's serving/): serving/, floor, against, floor,
    then against, floor, serving/, floor, ..., each of the two over the floor slices beside it."""
    if against is None:
        order = ([serving, floor, floor, serving] * ((slices + 1) // 2))[:2 * slices]
    else:
        order = [x for i in range(slices) for x in ([serving, floor, against, floor] if i % 2 == 0 else
                                                     [against, floor, serving, floor])]
    rates = [(s, rate(s)) for s in order]

    def row(who: Server) -> dict:
        out = [texts_per_s / statistics.mean([r for j, (other, r) in enumerate(rates) if abs(j - i) == 1
                                              and other is floor])
               for i, (s, texts_per_s) in enumerate(rates) if s is who]
        return {"ratios": out, "median": statistics.median(out),
                "texts_per_s": statistics.median(r for s, r in rates if s is who)}

    mine = row(serving)
    return {"c": c, "ratios": mine["ratios"], "median": mine["median"], "serving_texts_per_s": mine["texts_per_s"],
            "floor_texts_per_s": statistics.median(r for s, r in rates if s is floor),
            **({"against": row(against)} if against is not None else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True, help="bundle both servers serve")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder holding cls-books-fr/")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 64], help="closed-loop callers, one row each")
    ap.add_argument("--slices", type=int, default=12, help="slices of serving/ (and of the floor) per concurrency")
    ap.add_argument("--seconds", type=float, default=2.0, help="measured seconds of a slice, after its warm-up")
    ap.add_argument("--server-args", default="", help="extra options of serving/'s server")
    ap.add_argument("--against", type=Path, metavar="TREE",
                    help="also slice, in turn, the serving/ of another checkout (e.g. `git worktree add TREE COMMIT`), "
                         "run from TREE with this Python; both then serve without HTTP (--no-http: one port each)")
    ap.add_argument("--client", choices=["python", "h2load"], default="python",
                    help="what sends the slices: serve_bench's Python callers, or h2load (a C client)")
    args = ap.parse_args(argv)
    if args.client == "h2load" and not h2grpc.available():
        ap.error(h2grpc.MISSING)
    if args.slices < 1 or args.seconds <= 0 or min(args.concurrency) < 1:
        ap.error(f"--slices {args.slices}, --seconds {args.seconds}, --concurrency "
                 f"{' '.join(map(str, args.concurrency))}: each must be at least 1 (seconds > 0)")
    if args.against is not None and not (args.against / "serving" / "server.py").is_file():
        ap.error(f"--against {args.against}: no serving/server.py there (a checkout of this repository)")
    from contract.bundle import verify_bundle

    try:
        verify_bundle(args.bundle)  # a missing or damaged bundle: one line, before either server starts
    except ValueError as e:
        ap.error(f"--bundle: {e}")
    texts = test_texts(ap, args.data, 256)
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "classify.grpc"
        if args.client == "h2load":
            every = sorted(reviews(ap, args.data), key=len)
            body.write_bytes(h2grpc.grpc_body([every[len(every) // 2]]))  # the median length, as workers_bench's
        options = ["--intra-op-threads", "1", *(["--no-http"] if args.against else []), *args.server_args.split()]
        with contextlib.ExitStack() as up:  # each server started is stopped, whichever fails to start
            serving = Server(args.bundle, *options)
            up.callback(serving.stop)
            floor = Server(args.bundle, "--intra-op-threads", "1", floor=True)
            up.callback(floor.stop)
            against = Server(args.bundle, *options, tree=args.against) if args.against else None
            if against is not None:
                up.callback(against.stop)
            rows = []
            for c in args.concurrency:
                if args.client == "h2load":
                    rate = h2load_slices(body, c, args.seconds)
                    for server in (serving, floor, against):
                        if server is not None:
                            h2load_slices(body, c, 1.0)(server)  # warm-up
                else:
                    rate = python_slices(texts, c, args.seconds)
                rows.append(ratios(rate, serving, floor, c, args.slices, against))
    print("| callers | serving/ texts/s (median slice) | floor texts/s | serving/ / floor, median | ratios, lowest "
          "to highest |\n|---|---:|---:|---:|---|")
    for r in rows:
        spread = ", ".join(f"{x:.2f}" for x in sorted(r["ratios"]))
        print(f"| {r['c']} | {r['serving_texts_per_s']:.1f} | {r['floor_texts_per_s']:.1f} | **{r['median']:.2f}** "
              f"| {spread} |")
        if "against" in r:
            a = r["against"]
            print(f"| {r['c']}, {args.against}'s serving/ | {a['texts_per_s']:.1f} | | **{a['median']:.2f}** | "
                  + ", ".join(f"{x:.2f}" for x in sorted(a["ratios"])) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
