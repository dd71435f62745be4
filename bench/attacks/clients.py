"""bench/protocol_attacks.py's callers beside the attacker: the authorised client (`probe_main`, a Classify every
20 ms) and the overload (`load_main`, many callers of 64 texts), each run as a process of its own."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from attacks import AUTH


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
