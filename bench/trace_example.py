"""The trace of one batched call, from a real run: a server process exporting its spans over OTLP/gRPC (the standard
OTEL_* variables) to the tests' OTLP receiver (tests/otlp_receiver.py), two client calls in client spans of their own
that share one onnxruntime run; prints each call's trace as a text tree (docs/OBSERVABILITY.md shows one).

    python bench/trace_example.py --bundle /tmp/lab-bundle [--data /path/with/cls-books-fr]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from otlp_receiver import BATCH_PAIRS, OtlpReceiver, paired_calls, tree  # noqa: E402
from serving_fixtures import ServerProcess, reviews  # noqa: E402

from trainer.config.presets import data_sets  # noqa: E402

SHOWN = ("rpc.method", "rpc.response.status_code", "sentiment.texts", "sentiment.tokens", "sentiment.batch.texts",
         "sentiment.batch.calls", "sentiment.batch.tokens", "sentiment.batch.padded_tokens", "sentiment.graph",
         "sentiment.provider")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True, help="bundle folder to serve")
    ap.add_argument("--data", type=Path, default=Path(data_sets()),
                    help="folder holding cls-books-fr/ (the text sent is its first test review)")
    ap.add_argument("--attempts", type=int, default=3, help="pairs sent until two calls share a run")
    args = ap.parse_args()
    text = reviews(args.data, 1)[0]
    with OtlpReceiver() as receiver:
        server = ServerProcess(args.bundle, "--device", "cpu", *BATCH_PAIRS, env=receiver.env("grpc"))
        try:
            port = server.wait_listening()
            for _ in range(args.attempts):
                contexts = paired_calls(f"127.0.0.1:{port}", text)
                traces = {format(c.trace_id, "032x") for c in contexts}
                runs = receiver.wait_for(lambda spans, t=traces: [
                    s for s in spans if s.name == "onnxruntime run" and {trace for trace, _ in s.links} & t])
                shared = [r for r in runs if {trace for trace, _ in r.links} == traces]
                if shared:
                    break
            else:
                print(f"no two calls shared a run in {args.attempts} attempts", file=sys.stderr)
                return 1
            server.stop()  # every span exported
        finally:
            server.close()
        for trace in sorted(traces, key=lambda t: t != shared[0].trace_id):  # the run's own trace first
            print(f"trace {trace[:8]}")
            print(tree(receiver.spans, trace, SHOWN))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
