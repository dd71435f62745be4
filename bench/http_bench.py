"""HTTP against gRPC on one server process (the same bundle, core and batcher): texts/s and p50/p99 latency at
c = 1, 8, 64 callers with 1 and 64 texts per call; and (--stacks) the HTTP stacks weighed before choosing one.

    python bench/soak.py --make-bundle /tmp/tiny-bundle --size tiny     # once: the tests' tiny model
    python bench/http_bench.py --bundle /tmp/tiny-bundle [--seconds 3] [--rounds 2] [--json out.json]
    python bench/http_bench.py --bundle /tmp/tiny-bundle --stacks        # Starlette (ours) vs FastAPI, one core
    python bench/http_bench.py --bundle /tmp/tiny-bundle --texts 64 --callers 8 --profile /tmp/http-profile

One load generator for both: h2load (Debian: nghttp2-client), a C client, over HTTP/2 for gRPC (one ready-made
ClassifyRequest) and over HTTP/1.1 (--h1) for POST /v1/classify (the same texts as JSON): c connections, one call
at a time on each (closed loop). Latencies are h2load's per-call times (--log-file); texts/s counts calls answered
200 (a gRPC error also travels with 200: the server's own sentiment_requests_total{code="OK"} is checked to match).
Each configuration runs gRPC and HTTP `--rounds` times, alternated in one invocation (gRPC first in even rounds, HTTP
first in odd ones): a ratio of two figures from one run holds on a loaded machine where the figures themselves do
not. The server's CPU time per text answered (all its threads, /proc) is compared the same way: on a shared machine
it moves less than the rates. Load averages are printed at start and end.

--profile DIR: after the measured rounds, one more run per protocol and configuration with py-spy (a dev dependency)
sampling the server's thread that holds the interpreter lock: the stacks to DIR, where the Python goes (by function
and by area, as bench/workers_bench.py --profile prints it) to stdout.

--stacks serves the same ServingCore through the Starlette router of serving/protocols/http/ and through a FastAPI
app written as FastAPI is usually written (pydantic request and response models), both on uvicorn + httptools +
uvloop in this process, alternated, with h2load --h1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

import h2grpc  # noqa: E402

TEXT = ("Un roman magnifique, des personnages attachants et une intrigue qui tient jusqu'au bout : je le "
        "recommande sans hésiter.")


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def bodies(texts: int, folder: Path) -> tuple[Path, Path]:
    """(gRPC message on the wire, JSON body) for a call of `texts` texts."""
    grpc_body, json_body = folder / f"grpc-{texts}.bin", folder / f"json-{texts}.json"
    grpc_body.write_bytes(h2grpc.grpc_body([TEXT] * texts))
    json_body.write_bytes(json.dumps({"texts": [TEXT] * texts}).encode())
    return grpc_body, json_body


def h2load(url: str, body: Path, callers: int, seconds: float, headers: list[str], h1: bool,
           log: Path) -> dict:
    """Calls answered 200 per second and their p50/p99 latency in ms (from h2load's per-call log)."""
    log.unlink(missing_ok=True)
    cmd = ["h2load", "-D", f"{max(1, round(seconds))}s", "-c", str(callers), "-m", "1", "-t", "1", "-d", str(body),
           "--log-file", str(log), *(a for h in headers for a in ("-H", h)), *(["--h1"] if h1 else []), url]
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    times = sorted(int(line.split()[2]) for line in log.read_text().splitlines() if line.split()[1] == "200")
    if not times:
        return {"calls_s": 0.0, "p50_ms": None, "p99_ms": None}
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))] / 1000  # noqa: E731
    return {"calls_s": len(times) / seconds, "p50_ms": pick(0.50), "p99_ms": pick(0.99)}


def protocols(args: argparse.Namespace) -> dict:
    from serving_fixtures import ServerProcess

    server = ServerProcess(args.bundle, "--http-port", "0", "--metrics-port", "0", "--device", "cpu",
                           "--max-concurrent-rpcs", "256", "--max-queue", "8192")  # 64 callers x 64 texts fit
    results: list[dict] = []
    try:
        server.wait_listening(90)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)

            def run(protocol: str, texts: int, callers: int) -> dict:
                grpc_body, json_body = folder / f"grpc-{texts}.bin", folder / f"json-{texts}.json"
                if protocol == "grpc":
                    return h2load(f"http://127.0.0.1:{server.port}{h2grpc.CLASSIFY}", grpc_body, callers, args.seconds,
                                  ["content-type: application/grpc", "te: trailers"], False, folder / "log")
                return h2load(f"http://127.0.0.1:{server.http_port}/v1/classify", json_body, callers, args.seconds,
                              ["content-type: application/json"], True, folder / "log")

            for texts in args.texts:
                bodies(texts, folder)
                for callers in args.callers:
                    for round_ in range(args.rounds):
                        for protocol in ("grpc", "http")[::1 if round_ % 2 == 0 else -1]:
                            cpu = server.cpu_seconds()
                            r = run(protocol, texts, callers)
                            done = r["calls_s"] * args.seconds * texts
                            r.update(protocol=protocol, texts=texts, callers=callers, round=round_,
                                     texts_s=r["calls_s"] * texts,
                                     cpu_ms_text=1e3 * (server.cpu_seconds() - cpu) / done if done else None)
                            results.append(r)
                            print(json.dumps(r), flush=True)
            configs = [(t, c, p) for t in args.texts for c in args.callers for p in ("grpc", "http")]
            for texts, callers, protocol in configs if args.profile else []:
                profile(server.proc.pid, args.profile / f"{protocol}-{texts}x{callers}.txt", args.seconds,
                        partial(run, protocol, texts, callers), f"{protocol}, {texts} texts a call, c={callers}")
        codes = server.codes()  # CANCELLED: the calls h2load leaves in flight when its time is up
        assert set(codes) <= {"OK", "CANCELLED"}, f"calls answered with an error: {codes}"
        server.stop()
    finally:
        server.close()
    return {"runs": results}


def profile(pid: int, raw: Path, seconds: float, load: Callable[[], object], what: str) -> None:
    """py-spy (a dev dependency) samples the server's thread holding the interpreter lock while `load` runs; the
    stacks go to `raw`, their summary by function and by area (bench/workers_bench.py) to stdout."""
    from workers_bench import profile_summary

    raw.parent.mkdir(parents=True, exist_ok=True)
    spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid), "-d",
                            str(max(1, int(seconds) - 1)), "-r", "200", "-f", "raw", "-o", str(raw), "--nonblocking",
                            "--gil", "--full-filenames"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    load()
    spy.wait(60)
    print(f"\n{what}: {profile_summary(raw, top=12)}", flush=True)


def stacks(args: argparse.Namespace) -> dict:
    """Starlette (serving/protocols/http) against FastAPI on the same core, one process."""
    import asyncio

    from fastapi import FastAPI
    from pydantic import BaseModel, Field

    from serving.config import ServerConfig
    from serving.process.app import SentimentServer
    from serving.protocols.http.server import HttpServer

    cfg = ServerConfig(port=0, http_port=0, device="cpu")
    server = SentimentServer(args.bundle, cfg).start()
    core = server.core

    class Request(BaseModel):
        texts: list[str] = Field(min_length=1, max_length=cfg.max_texts)

    class Result(BaseModel):
        label: str
        label_index: int
        probabilities: list[float]
        token_count: int
        truncated: bool

    class Response(BaseModel):
        results: list[Result]

    fast = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    async def classify(request: Request) -> Response:
        preds = await asyncio.wrap_future(core.submit(request.texts))
        return Response(results=[Result(label=p.label, label_index=p.label_index,
                                        probabilities=p.probabilities.tolist(), token_count=p.token_count,
                                        truncated=p.truncated) for p in preds])

    # the classes themselves, not their names (this module's annotations are strings): FastAPI reads them
    classify.__annotations__ = {"request": Request, "return": Response}
    fast.post("/v1/classify", response_model=Response)(classify)

    other = HttpServer(fast, cfg, 0)
    other.start()
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for texts in args.texts:
                _, body = bodies(texts, Path(tmp))
                for round_ in range(args.rounds):
                    for stack, port in (("starlette", server.http_port), ("fastapi", other.port)):
                        r = h2load(f"http://127.0.0.1:{port}/v1/classify", body, args.stack_callers, args.seconds,
                                   ["content-type: application/json"], True, Path(tmp) / "log")
                        r.update(stack=stack, texts=texts, callers=args.stack_callers, round=round_,
                                 texts_s=r["calls_s"] * texts)
                        results.append(r)
                        print(json.dumps(r), flush=True)
    finally:
        other.stop()
        server.stop()
    return {"runs": results}


def summary(runs: list[dict], key: str, a: str, b: str) -> list[str]:
    """Per configuration: the medians of each side over the rounds, b / a, and (protocols) the median over rounds of
    b / a in the server's CPU per text."""
    rows = []
    for texts, callers in sorted({(r["texts"], r["callers"]) for r in runs}):
        side = {name: [r for r in runs if (r["texts"], r["callers"], r[key]) == (texts, callers, name)]
                for name in (a, b)}
        (ta, pa, qa), (tb, pb, qb) = (
            [statistics.median(r[f] for r in side[name]) for f in ("texts_s", "p50_ms", "p99_ms")] for name in (a, b))
        cpu = [y["cpu_ms_text"] / x["cpu_ms_text"] for x, y in zip(side[a], side[b], strict=True)
               if x.get("cpu_ms_text") and y.get("cpu_ms_text")]
        rows.append(f"| {texts} | {callers} | {ta:.0f} | {tb:.0f} | {tb / ta:.2f} | {pa:.2f} / {qa:.2f} | "
                    f"{pb:.2f} / {qb:.2f} | {pb - pa:+.2f} |" + (f" {statistics.median(cpu):.2f} |" if cpu else ""))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True, help="a bundle folder (python -m trainer export)")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each measured run (default: 3)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two sides per configuration")
    ap.add_argument("--texts", type=int, nargs="+", default=[1, 64], help="texts per call (default: 1 64)")
    ap.add_argument("--callers", type=int, nargs="+", default=[1, 8, 64],
                    help="callers at once, one connection each (default: 1 8 64)")
    ap.add_argument("--stacks", action="store_true", help="Starlette vs FastAPI instead of HTTP vs gRPC")
    ap.add_argument("--stack-callers", type=int, default=8, help="callers at once for --stacks (default: 8)")
    ap.add_argument("--json", type=Path, help="write every run's figures to this file")
    ap.add_argument("--profile", type=Path, help="after the measured rounds, py-spy the server once more per protocol "
                    "and configuration; the stacks to this folder, their summary to stdout")
    args = ap.parse_args()
    if shutil.which("h2load") is None:
        ap.error("h2load not found: install it (Debian/Ubuntu: apt-get install nghttp2-client)")
    start = loadavg()
    out = stacks(args) if args.stacks else protocols(args)
    out.update(loadavg_start=start, loadavg_end=loadavg(), cpus=os.cpu_count())
    key, a, b = ("stack", "starlette", "fastapi") if args.stacks else ("protocol", "grpc", "http")
    print(f"load average at start {start}, at end {out['loadavg_end']}; {os.cpu_count()} cores")
    cpu = "" if args.stacks else f" server CPU per text, {b}/{a} |"
    print(f"| texts/call | callers | {a} texts/s | {b} texts/s | {b}/{a} | {a} p50 / p99 ms | {b} p50 / p99 ms | "
          f"p50 {b} - {a} ms |{cpu}")
    print("|---|---|---|---|---|---|---|---|" + ("" if args.stacks else "---|"))
    print("\n".join(summary(out["runs"], key, a, b)))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
