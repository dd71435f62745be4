"""How much can batching gain on this machine? onnxruntime's achieved FLOP/s per batch size against its own peak.

For a served bundle, runs of B texts of exactly T ids (no padding: the best case for batching) are timed on one
onnxruntime thread, and the model's FLOPs per text (closed form below) turn ms/text into GFLOP/s. The same session
options time a large single MatMul, the best this core does through onnxruntime. If batch 1 already reaches a
large share of that peak, no batching policy can multiply throughput: the ceiling is peak / achieved at batch 1.

    .venv/bin/python bench/ort_batch_efficiency.py --bundle /tmp/ts_dev/lab_bundle
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from trainer.config.schema import ModelConfig
from trainer.model.encoder import forward_flops_per_token


def model_flops_per_text(arch: dict, t: int) -> float:
    """FLOPs of one forward pass over t ids (trainer.model.encoder.forward_flops_per_token, the classifier's count)."""
    return t * forward_flops_per_token(ModelConfig(**arch), "classifier", t)


def session(path: Path | str, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def timed(fn, min_s: float) -> float:
    """Median seconds of one call, over at least 5 calls and `min_s` seconds (after one warm-up call)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < min_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_peak(n: int, threads: int, min_s: float) -> float:
    """GFLOP/s of an (n x n) @ (n x n) fp32 MatMul in onnxruntime (the GEMM the model's projections use)."""
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "peak",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n]),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, n])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mm.onnx"
        onnx.save(model, str(path))
        sess = session(path, threads)
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
        seconds = timed(lambda: sess.run(None, {"a": a, "b": b}), min_s)
    return 2.0 * n**3 / seconds / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True, help="bundle folder (bench/serve_bench.py --make-bundle)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256], help="ids per text")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64], help="texts per run")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (the server's default: 1)")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="measured seconds per point")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()

    from serving.predictor import Predictor

    predictor = Predictor(args.bundle, device="cpu", intra_op_threads=args.threads)  # the server's session options
    sess = predictor.session
    arch = predictor.manifest.source_artifact["model"]
    vocab = int(arch["vocab_size"])
    peak = matmul_peak(1024, args.threads, args.min_seconds)
    rows = []
    rng = np.random.default_rng(0)
    for t in args.lengths:
        base = None
        for b in args.batches:
            ids = rng.integers(4, vocab, (b, t), dtype=np.int64)  # no special ids, no padding: pure compute
            ids[:, 0], ids[:, -1] = 0, 2  # <sos> ... <eos>
            feed = {"input_ids": ids, "attention_mask": np.ones((b, t), np.int64)}
            seconds = timed(lambda feed=feed: sess.run(None, feed), args.min_seconds)
            ms_per_text = 1e3 * seconds / b
            gflops = model_flops_per_text(arch, t) / (seconds / b) / 1e9
            base = base or ms_per_text
            rows.append({"length": t, "batch": b, "ms_per_text": ms_per_text, "gflop_s": gflops,
                         "share_of_peak": gflops / peak, "speedup_vs_batch1": base / ms_per_text})
    print(f"onnxruntime {ort.__version__}, {args.threads} thread(s); MatMul 1024^3 fp32 peak: {peak:.1f} GFLOP/s")
    print("| ids per text | texts per run | ms per text | GFLOP/s | share of MatMul peak | speed-up vs 1 text |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['length']} | {r['batch']} | {r['ms_per_text']:.3f} | {r['gflop_s']:.1f} | "
              f"{100 * r['share_of_peak']:.0f}% | {r['speedup_vs_batch1']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"peak_gflop_s": peak, "threads": args.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
