"""Does a text's answer depend on the texts batched with it, and what does each CPU graph cost?

For one classifier artifact, the graphs a CPU server could run:
  fp32            the bundle's model.onnx (mean pooling exported as a running sum: trainer/model/onnx_pooling.py)
  int8-dynamic    model.int8.onnx as `export` writes it: int8 weights, activations quantized at run time with one
                  scale per tensor, so per batch (its other texts and its padding move every row's scale)
  int8-static     QDQ int8 with activation scales fixed by calibration on the artifact's training split
                  (onnxruntime.quantization.quantize_static, MinMax): no scale depends on the batch
  int8-per-row    int8-dynamic run one text at a time (each text's own scale; no batching)
and, on a labelled file:
  - accuracy, and label agreement with PyTorch fp32;
  - batch dependence: every text alone, then the same texts in shuffled batches of 7 and 64 (right-padded to each
    batch's longest, as the server's batcher sends them): rows whose probabilities are not bitwise equal, the largest
    |probability change|, labels changed;
  - speed: texts per second one text per run and in batches of 32 of random company, every graph with the same
    onnxruntime thread count, in interleaved rounds (each graph once per round) so that load spreads over all.

  .venv/bin/python bench/batch_invariance.py --artifact runs/demo-ft/artifact \
      --data "$TS_DATA"/cls-books-fr/test.review.txt --json runs/batch-invariance.json

Results: docs/BENCHMARKS.md, "Answers independent of the batch".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from contract.graph import ATTENTION_MASK, INPUT_IDS, LOGITS
from contract.runtime import session_options
from contract.tokens import PAD
from trainer import artifact as artifact_mod
from trainer.data import labelled
from trainer.data.readers import read_labeled
from trainer.export import ExportOptions, export_bundle
from trainer.export.score import torch_reference

Run = Callable[[list[list[int]]], np.ndarray]  # rows of ids -> (n, C) probabilities


def padded(rows: list[list[int]]) -> dict[str, np.ndarray]:
    """Right-padded to the longest row, as serving/model/predictor.py's infer does."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), PAD, dtype=np.int64)  # (n, T)
    mask = np.zeros((len(rows), width), dtype=np.int64)  # (n, T)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    return {INPUT_IDS: ids, ATTENTION_MASK: mask}


def softmax(z: np.ndarray) -> np.ndarray:
    """As serving/model/predictor.py's: float64 arithmetic, float32 out."""
    z = z.astype(np.float64) - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def runner(path: Path, threads: int, level: str) -> Run:
    session = ort.InferenceSession(str(path), session_options(level, threads, 1, spinning=False),
                                   providers=["CPUExecutionProvider"])
    return lambda rows: softmax(session.run([LOGITS], padded(rows))[0])


def one_by_one(run: Run) -> Run:
    return lambda rows: np.concatenate([run([r]) for r in rows])


def quantize_static(fp32: Path, out: Path, calibration: list[list[int]]) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType
    from onnxruntime.quantization import quantize_static as quantize

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([padded(calibration[i:i + 16]) for i in range(0, len(calibration), 16)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    model = onnx.load(str(fp32))
    del model.graph.value_info[:]  # as trainer/export/quantize.py: the quantiser re-infers shapes
    staged = out.with_suffix(".in.onnx")
    onnx.save(model, str(staged))
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        quantize(str(staged), str(out), Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
                 weight_type=QuantType.QInt8, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    finally:
        root.setLevel(level)
    staged.unlink()


def dependence(run: Run, seqs: list[list[int]], alone: np.ndarray, sizes: tuple[int, ...], seed: int) -> dict:
    out = {}
    rng = np.random.default_rng(seed)
    for size in sizes:
        order = rng.permutation(len(seqs))
        got = np.zeros_like(alone)
        for start in range(0, len(order), size):
            idx = order[start:start + size]
            got[idx] = run([seqs[i] for i in idx])
        out[str(size)] = {"rows_not_bitwise_equal": int((got != alone).any(axis=1).sum()),
                          "max_abs_prob_change": float(np.abs(got - alone).max()),
                          "labels_changed": int((got.argmax(1) != alone.argmax(1)).sum())}
    return out


def speed(runs: dict[str, Run], seqs: list[list[int]], rounds: int, batch: int, seed: int) -> dict[str, dict]:
    """Texts per second: one text per run, and random batches of `batch`; interleaved rounds, median per graph."""
    rng = np.random.default_rng(seed)
    times: dict[str, dict[str, list[float]]] = {name: {"one": [], "batch": []} for name in runs}
    for _ in range(rounds):
        pick = rng.permutation(len(seqs))[:batch]
        rows = [seqs[i] for i in pick]
        for name, run in runs.items():
            for kind in ("one", "batch"):
                t0 = time.perf_counter()
                if kind == "one" or name == "int8-per-row":
                    for r in rows:
                        run([r])
                else:
                    run(rows)
                times[name][kind].append(time.perf_counter() - t0)
    return {name: {f"texts_per_s_{k}": round(batch / float(np.median(v)), 1) for k, v in t.items()}
            for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True, help="a classifier artifact (finetune's RUN/artifact)")
    p.add_argument("--data", required=True, help="labelled file to score (label values as the artifact's)")
    p.add_argument("--calibration", type=int, default=512, help="training texts that calibrate int8-static")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads per graph (default 1)")
    p.add_argument("--level", default="basic", help="onnxruntime graph optimisation level (the bundle's: basic)")
    p.add_argument("--rounds", type=int, default=30, help="timing rounds (each: every graph, one batch of 32)")
    p.add_argument("--no-speed", action="store_true", help="accuracy and batch dependence only")
    p.add_argument("--speed-only", action="store_true",
                   help="timing only, of the graphs already in --work (run it alone: under an exclusive lock)")
    p.add_argument("--work", default=None, help="folder for the graphs (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the results as JSON")
    args = p.parse_args()

    art = artifact_mod.load(args.artifact)
    tok = art.tokenizer()
    d = art.cfg.data
    examples = read_labeled(args.data, d.labels, d.text_field, d.label_field)
    seqs = [tok.encode_example(ex) for ex in examples]
    labels = np.array([ex.label for ex in examples])
    train = labelled.load(art.cfg).train.examples
    calib = [tok.encode_example(train[i]) for i in
             np.random.default_rng(0).permutation(len(train))[:args.calibration]]
    work = Path(args.work or tempfile.mkdtemp(prefix="batch-invariance-"))
    bundle = work / "bundle"
    if not args.speed_only:
        export_bundle(args.artifact, bundle, ExportOptions())  # fp32 + dynamic int8 (if within its bound)
        quantize_static(bundle / "model.onnx", work / "model.static.onnx", calib)
    graphs = {"fp32": bundle / "model.onnx", "int8-dynamic": bundle / "model.int8.onnx",
              "int8-static": work / "model.static.onnx"}
    runs: dict[str, Run] = {name: runner(path, args.threads, args.level) for name, path in graphs.items()}
    runs["int8-per-row"] = one_by_one(runs["int8-dynamic"])
    reference = torch_reference(art.model(), seqs, PAD).argmax(1) if not args.speed_only else None

    results: dict[str, dict] = {name: {} for name in runs}
    for name, run in runs.items() if not args.speed_only else ():
        alone = one_by_one(run)(seqs)
        results[name] = {"accuracy": round(100 * float((alone.argmax(1) == labels).mean()), 2),
                         "label_agreement_with_pytorch": round(100 * float((alone.argmax(1) == reference).mean()), 2),
                         "batch_dependence": {} if name == "int8-per-row" else
                         dependence(run, seqs, alone, (7, 64), seed=1)}
        print(name, json.dumps(results[name]), flush=True)
    load = os.getloadavg()
    if not args.no_speed:
        for name, s in speed(runs, seqs, args.rounds, 32, seed=2).items():
            results[name].update(s)
            print(name, s, flush=True)
    info = {"artifact": str(args.artifact), "data": str(args.data), "examples": len(seqs), "threads": args.threads,
            "level": args.level, "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "onnxruntime": ort.__version__, "load_before": load, "load_after": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}
    print(f"load average {load[0]:.2f} before timing, {info['load_after'][0]:.2f} after")
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2) + "\n")


if __name__ == "__main__":
    main()
