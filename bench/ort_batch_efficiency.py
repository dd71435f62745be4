"""How much can batching gain on this machine? onnxruntime's achieved FLOP/s per batch size against its own peak.

For a served bundle, runs of B texts of exactly T ids (no padding: the best case for batching) are timed on one
onnxruntime thread, and the model's FLOPs per text (closed form below) turn ms/text into GFLOP/s. The same session
options time a large single MatMul, the best this core does through onnxruntime. If batch 1 already reaches a
large share of that peak, no batching policy can multiply throughput: the ceiling is peak / achieved at batch 1.

    .venv/bin/python bench/ort_batch_efficiency.py --bundle /tmp/ts_dev/lab_bundle
    python bench/ort_batch_efficiency.py --bundle BUNDLE --device cuda --io-binding --peak-n 4096

On CUDA, `--io-binding` also times each point through onnxruntime's IO binding: inputs copied from the host by
onnxruntime and the logits left on the GPU, then copied back (what a server could bind: its inputs start on the
host), and inputs already on the GPU (the most IO binding can save: no host copy at all). The MatMul peak is then
taken on the GPU, inputs and output bound there. `--cuda-graph` also replays the graph as a CUDA graph
(onnxruntime's enable_cuda_graph) at the largest batch and first length, inputs on the GPU, against the same run
without it; onnxruntime refuses it when a node of the graph runs on the CPU, and the refusal is what is reported.
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


def session(path: Path | str, threads: int, device: str = "cpu") -> ort.InferenceSession:
    from contract import runtime

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=runtime.providers(device))


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


def matmul_peak(n: int, threads: int, min_s: float, device: str = "cpu") -> float:
    """GFLOP/s of an (n x n) @ (n x n) fp32 MatMul in onnxruntime (the GEMM the model's projections use); on CUDA
    with its inputs and output on the GPU."""
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "peak",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n]),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, n])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mm.onnx"
        onnx.save(model, str(path))
        sess = session(path, threads, device)
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
        if device == "cpu":
            seconds = timed(lambda: sess.run(None, {"a": a, "b": b}), min_s)
        else:
            seconds = timed(device_resident(sess, {"a": a, "b": b}, "c"), min_s)
    return 2.0 * n**3 / seconds / 1e9


def host_to_device(sess: ort.InferenceSession, feed: dict[str, np.ndarray], output: str):
    """A run through IO binding whose inputs start on the host (onnxruntime copies them) and whose output is left on
    the GPU, then copied to the host: what a server, whose inputs arrive on the host, could bind."""
    io = sess.io_binding()
    for name, value in feed.items():
        io.bind_cpu_input(name, value)
    io.bind_output(output, "cuda")

    def run() -> None:
        sess.run_with_iobinding(io)
        io.copy_outputs_to_cpu()

    return run


def device_resident(sess: ort.InferenceSession, feed: dict[str, np.ndarray], output: str):
    """A run through IO binding with inputs already on the GPU and the output left there: no host copy at all."""
    io = sess.io_binding()
    for name, value in feed.items():
        io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0))
    io.bind_output(output, "cuda")
    return lambda: sess.run_with_iobinding(io)


def cuda_graph_point(predictor, batch: int, length: int, vocab: int, min_s: float) -> dict:
    """ms per text of one (batch x length) run replayed as a CUDA graph, against the same device-resident run
    without it; or the error onnxruntime gives."""
    from contract import runtime
    from contract.bundle import verify_bundle
    from contract.graph import LOGITS

    rng = np.random.default_rng(1)
    ids = rng.integers(4, vocab, (batch, length), dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones((batch, length), np.int64)}
    row = {"length": length, "batch": batch,
           "device_ms_per_text": 1e3 * timed(device_resident(predictor.session, feed, LOGITS), min_s) / batch}
    try:
        options = runtime.session_options(predictor.optimization, intra_op_threads=1)
        graph = verify_bundle(predictor.bundle_dir).graph_bytes(predictor.graph)
        sess = ort.InferenceSession(graph, options, providers=[(runtime.CUDA, {"enable_cuda_graph": "1"})])
        row["cuda_graph_ms_per_text"] = 1e3 * timed(device_resident(sess, feed, LOGITS), min_s) / batch
    except Exception as e:  # onnxruntime's own refusal is the finding
        row["cuda_graph_error"] = " ".join(str(e).split())[:400]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True, help="bundle folder (bench/serve_bench.py --make-bundle)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256], help="ids per text")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64], help="texts per run")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (the server's default: 1)")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="measured seconds per point")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the provider the bundle's graph runs on")
    ap.add_argument("--io-binding", action="store_true", help="CUDA: also time each point through IO binding")
    ap.add_argument("--cuda-graph", action="store_true", help="CUDA: also a CUDA-graph replay (see above)")
    ap.add_argument("--peak-n", type=int, default=1024, help="size of the MatMul timed as the peak (GPU: 4096)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()
    if (args.io_binding or args.cuda_graph) and args.device != "cuda":
        ap.error("--io-binding and --cuda-graph are about a GPU: they need --device cuda")

    from contract.graph import LOGITS
    from serving.model.predictor import Predictor

    # The server's session options, the graph it runs on this device.
    predictor = Predictor(args.bundle, device=args.device, intra_op_threads=args.threads)
    sess = predictor.session
    arch = predictor.manifest.source_artifact["model"]
    vocab = int(arch["vocab_size"])
    peak = matmul_peak(args.peak_n, args.threads, args.min_seconds, args.device)
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
            row = {"length": t, "batch": b, "ms_per_text": ms_per_text, "gflop_s": gflops,
                   "share_of_peak": gflops / peak, "speedup_vs_batch1": base / ms_per_text}
            if args.io_binding:
                for name, binding in (("iobinding_host_ms_per_text", host_to_device),
                                      ("iobinding_device_ms_per_text", device_resident)):
                    row[name] = 1e3 * timed(binding(sess, feed, LOGITS), args.min_seconds) / b
            rows.append(row)
    print(f"onnxruntime {ort.__version__} on {predictor.provider} ({predictor.graph}, {predictor.precision}), "
          f"{args.threads} thread(s); MatMul {args.peak_n}^3 fp32 peak: {peak:.1f} GFLOP/s")
    binding = " IO binding, host inputs: ms per text | IO binding, inputs on the GPU: ms per text |" \
        if args.io_binding else ""
    print("| ids per text | texts per run | ms per text | GFLOP/s | share of MatMul peak | speed-up vs 1 text |"
          + binding)
    print("|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.io_binding else ""))
    for r in rows:
        extra = f" {r['iobinding_host_ms_per_text']:.4f} | {r['iobinding_device_ms_per_text']:.4f} |" \
            if args.io_binding else ""
        print(f"| {r['length']} | {r['batch']} | {r['ms_per_text']:.4f} | {r['gflop_s']:.1f} | "
              f"{100 * r['share_of_peak']:.0f}% | {r['speedup_vs_batch1']:.2f}x |{extra}")
    graph_row = cuda_graph_point(predictor, max(args.batches), args.lengths[0], vocab, args.min_seconds) \
        if args.cuda_graph else None
    if graph_row is not None:
        replay = f"{graph_row['cuda_graph_ms_per_text']:.4f} ms per text" if "cuda_graph_ms_per_text" in graph_row \
            else f"refused: {graph_row['cuda_graph_error']}"
        print(f"CUDA graph, {graph_row['batch']} x {graph_row['length']} ids, inputs on the GPU: {replay} "
              f"(without: {graph_row['device_ms_per_text']:.4f} ms per text)")
    if args.json:
        args.json.write_text(json.dumps({"peak_gflop_s": peak, "threads": args.threads, "device": args.device,
                                         "provider": predictor.provider, "precision": predictor.precision,
                                         "rows": rows, "cuda_graph": graph_row}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
