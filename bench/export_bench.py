"""Export benchmark: PyTorch eager vs onnxruntime fp32 vs int8 on the lab-size classifier.

Same process, same thread count for every engine (torch.set_num_threads and ORT intra_op_num_threads). Measures
  - latency of batch 1 x 64 tokens: median and p99 per engine;
  - throughput of batch 32 x 128 tokens: sequences per second from the median batch time;
  - bundle variants: fused attention (default) or the exporter's decomposition, ORT BASIC / EXTENDED / ALL,
    int8 per-tensor / per-channel / full-range (8-bit weights);
  - accuracy on cls-books-fr test of PyTorch, ORT fp32 and each int8 variant, and label agreement with PyTorch
    (a random-weight model gives agreement only: accuracy needs a trained model, see --train-epochs).
Engines are measured in interleaved rounds (every engine once per round) so that a burst of load from another
process spreads over all of them; the load average is printed with the results.

The model is the lab's size (50,001 ids, d 200, 4 layers, 2 heads): --artifact DIR, or --train-epochs N fine-tunes
one from scratch with the lab's settings (Adam 1e-4, batch 8, clip 0.5, lab tokenizer) and saves it in --work for
reuse; with neither, random weights (seed 0).

  .venv/bin/python bench/export_bench.py --train-epochs 3          # a few minutes of training, once
  .venv/bin/python bench/export_bench.py --artifact runs/bench-export/lab-e3 --json runs/bench-export/r.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from contract.runtime import OPT_LEVELS
from trainer import artifact
from trainer.config import presets
from trainer.config import schema as config_mod
from trainer.export import ExportOptions, export_bundle
from trainer.export.errors import ExportValidationError
from trainer.export.score import accuracy, predict
from trainer.export.validate import ort_logits, torch_logits

# name -> export options; every bundle is validated by the exporter as usual.
VARIANTS: dict[str, ExportOptions] = {
    "fp32": ExportOptions(precision="fp32"),
    "fp32-unfused": ExportOptions(precision="fp32", fuse_attention=False),
    "int8": ExportOptions(precision="int8"),
    "int8-unfused": ExportOptions(precision="int8", fuse_attention=False),
    "int8-per-channel": ExportOptions(precision="int8", per_channel=True),
    "int8-full-range": ExportOptions(precision="int8", full_range=True),
}
# (variant, ORT level) pairs timed; the first fp32/int8 rows are the bundles' defaults.
TIMED = [("fp32", "basic"), ("fp32", "extended"), ("fp32", "all"), ("fp32-unfused", "basic"),
         ("fp32-unfused", "all"), ("int8", "basic"), ("int8", "all"), ("int8-unfused", "basic"),
         ("int8-per-channel", "basic"), ("int8-full-range", "basic")]


def session(path: Path, level: str, threads: int, spin: bool = True) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = OPT_LEVELS[level]
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if not spin:  # worker threads sleep between runs instead of busy-waiting (ORT spins by default)
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def lab_tokenizer(cfg: config_mod.RunConfig):
    from trainer.data.tokenizer import build_tokenizer

    return build_tokenizer(cfg)


def make_artifact(args: argparse.Namespace, cfg: config_mod.RunConfig) -> tuple[Path, str]:
    """(artifact folder, how its weights were made)."""
    if args.artifact:
        meta = json.loads((Path(args.artifact) / "artifact.json").read_text())
        return Path(args.artifact), meta.get("bench_training", {}).get("what", f"artifact {args.artifact}")
    if args.train_epochs:
        out = args.work / f"lab-e{args.train_epochs}"
        if not (out / "artifact.json").exists():
            train_from_scratch(cfg, args.train_epochs, out)
        return out, json.loads((out / "artifact.json").read_text())["bench_training"]["what"]
    out = args.work / "lab-random"
    if not (out / "artifact.json").exists():
        torch.manual_seed(0)
        from trainer.model.encoder import build

        artifact.save(out, build(cfg.model, "classifier"), cfg, "classifier", lab_tokenizer(cfg))
    return out, "random weights (seed 0): latency and agreement only"


def train_from_scratch(cfg: config_mod.RunConfig, epochs: int, out: Path) -> None:
    """The lab's fine-tuning from scratch (no pretraining), plain PyTorch: enough to make accuracy meaningful."""
    from trainer.data.batching import bucket_batches, pad_batch
    from trainer.data.readers import read_labeled
    from trainer.model.encoder import build

    tok = lab_tokenizer(cfg)
    examples = read_labeled(cfg.data.path(cfg.data.train), cfg.data.labels)
    seqs = [tok.encode_example(ex) for ex in examples]
    labels = torch.tensor([ex.label for ex in examples])
    torch.manual_seed(cfg.seed)
    model = build(cfg.model, "classifier").train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg.finetune.optim.lr)
    t0 = time.perf_counter()
    for epoch in range(epochs):
        total, n = 0.0, 0
        for batch in bucket_batches([len(s) for s in seqs], cfg.finetune.micro_batch, cfg.seed, epoch):
            ids, pad = pad_batch([seqs[i] for i in batch], tok.PAD)
            loss = torch.nn.functional.cross_entropy(model(ids, pad), labels[batch])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.finetune.optim.grad_clip)
            opt.step()
            total, n = total + loss.item(), n + 1
        print(f"  epoch {epoch + 1}/{epochs}: mean loss {total / n:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    what = (f"lab-size classifier trained from scratch by bench/export_bench.py: {epochs} epochs on cls-books-fr "
            f"train (Adam lr {cfg.finetune.optim.lr}, batch {cfg.finetune.micro_batch}, clip "
            f"{cfg.finetune.optim.grad_clip}), {time.perf_counter() - t0:.0f} s")
    artifact.save(out, model.eval(), cfg, "classifier", tok, extra={"bench_training": {"what": what}})


def _same_source(bundle: Path, weights_sha256: str, opts: ExportOptions) -> bool:
    """--reuse: an intact earlier bundle of these very weights, exported with these options."""
    from contract.bundle import verify_bundle
    from contract.errors import BundleError
    from contract.manifest import MODEL_FILE

    try:
        m = verify_bundle(bundle).manifest
    except BundleError:
        return False
    graph = m.graphs[MODEL_FILE]
    return (m.source_artifact.get("weights_sha256") == weights_sha256 and set(m.graphs) == {MODEL_FILE}
            and graph.precision == opts.precision and m.runtime.fused_attention == opts.fuse_attention
            and graph.quantization == (opts.quantization if opts.precision == "int8" else None))


def timed_rounds(fns: dict[str, Callable[[], object]], rounds: int, iters: int) -> dict[str, list[float]]:
    """Seconds per call of each function, interleaved: each round runs every function `iters` times."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():  # warm-up: allocations, ORT's first-run planning
        f()
        f()
    for _ in range(rounds):
        for name, f in fns.items():
            for _ in range(iters):
                t = time.perf_counter()
                f()
                samples[name].append(time.perf_counter() - t)
    return samples


def time_engines(model: torch.nn.Module, sessions: dict[str, ort.InferenceSession], vocab: int,
                 args: argparse.Namespace, threads: int) -> dict[str, dict[str, dict[str, float]]]:
    """{"b1x64" | "b32x128": {engine: median_ms, p99_ms, seq_per_s, n}} with torch on `threads` threads."""
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    results = {}
    for label, (b, t, iters) in {"b1x64": (1, 64, args.iters_b1), "b32x128": (32, 128, args.iters_b32)}.items():
        ids, mask = batch(b, t, vocab, rng)
        tids, tpad = torch.from_numpy(ids), torch.from_numpy(mask) == 0
        fns: dict[str, Callable[[], object]] = {"torch eager": lambda i=tids, m=tpad: model(i, m)}
        for name, s in sessions.items():
            fns[name] = lambda s=s, i=ids, m=mask: ort_logits(s, i, m)
        with torch.inference_mode():
            samples = timed_rounds(fns, args.rounds, iters)
        results[label] = {k: {"median_ms": 1e3 * float(np.median(v)), "p99_ms": 1e3 * float(np.percentile(v, 99)),
                              "seq_per_s": b / float(np.median(v)), "n": len(v)} for k, v in samples.items()}
    return results


def batch(b: int, t: int, vocab: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(4, vocab, (b, t)).astype(np.int64)
    ids[:, 0], ids[:, -1] = 0, 2
    return ids, np.ones((b, t), dtype=np.int64)


def score_bundles(art: artifact.Artifact, model: torch.nn.Module, bundles: dict[str, Path],
                  cfg: config_mod.RunConfig, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Accuracy on cls-books-fr test (2000 reviews, up to 512 ids): PyTorch once, then every bundle."""
    from trainer.data.readers import read_labeled

    tok = art.tokenizer()
    examples = read_labeled(cfg.data.path(cfg.data.test), cfg.data.labels)[: args.eval_limit or None]
    seqs = [tok.encode_example(ex) for ex in examples]
    labels = np.array([ex.label for ex in examples])
    with torch.inference_mode():
        ref = predict(lambda i, m: torch_logits(model, i, m), seqs, tok.PAD)
    quality = {"torch": {"accuracy": accuracy(ref, labels), "examples": len(seqs)}}
    for name, path in bundles.items():
        s = session(path / "model.onnx", "basic", args.threads)
        got = predict(lambda i, m, s=s: ort_logits(s, i, m), seqs, tok.PAD)
        quality[name] = {"accuracy": accuracy(got, labels),
                         "agreement": round(float((got.argmax(1) == ref.argmax(1)).mean()), 4),
                         "max_abs_diff": float(np.abs(got - ref).max())}
    return quality


def wait_quiet(limit: float, patience_s: float) -> None:
    """Wait (up to `patience_s`) until the 1-minute load average is under `limit`: other processes on a small
    machine slow torch's OpenMP threads far more than onnxruntime's, which would flatter ORT."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= limit and time.monotonic() - t0 < patience_s:
        time.sleep(10)


def report(results: dict, sweep: dict, quality: dict, bundles: dict[str, Path], export_s: dict[str, float],
           loads: tuple) -> str:
    eager = {k: results[k]["torch eager"]["median_ms"] for k in results}
    ratio = {k: {e: eager[k] / results[k][e]["median_ms"] for e in results[k]} for k in results}
    lines = ["| engine | b1x64 median ms | b1x64 p99 ms | x eager | b32x128 median ms | seq/s | x eager |",
             "|---|---|---|---|---|---|---|"]
    for k in results["b1x64"]:
        r1, r32 = results["b1x64"][k], results["b32x128"][k]
        lines.append(f"| {k} | {r1['median_ms']:.2f} | {r1['p99_ms']:.2f} | {ratio['b1x64'][k]:.2f} | "
                     f"{r32['median_ms']:.1f} | {r32['seq_per_s']:.0f} | {ratio['b32x128'][k]:.2f} |")
    for threads, res in sweep.items():
        lines += ["", f"thread sweep: {threads} thread(s) for every engine",
                  "| engine | b1x64 median ms | b1x64 p99 ms | b32x128 median ms | seq/s |", "|---|---|---|---|---|"]
        for k in res["b1x64"]:
            r1, r32 = res["b1x64"][k], res["b32x128"][k]
            lines.append(f"| {k} | {r1['median_ms']:.2f} | {r1['p99_ms']:.2f} | {r32['median_ms']:.1f} | "
                         f"{r32['seq_per_s']:.0f} |")
    if quality:
        lines += ["", f"| model | test accuracy % ({quality['torch']['examples']} reviews) | agreement with PyTorch "
                  "| max abs logit diff | export s | MB |", "|---|---|---|---|---|---|",
                  f"| torch eager fp32 | {quality['torch']['accuracy']:.2f} | - | - | - | - |"]
        for name, q in quality.items():
            if name != "torch":
                mb = (bundles[name] / "model.onnx").stat().st_size / 1e6
                lines.append(f"| {name} | {q['accuracy']:.2f} | {q['agreement']:.2%} | {q['max_abs_diff']:.3g} | "
                             f"{export_s[name]} | {mb:.1f} |")
    lines += ["", "targets (docs/BENCHMARKS.md, Export):",
              f"  b1x64  ORT fp32 >= 1.5x eager: {ratio['b1x64']['fp32 basic']:.2f}x",
              f"  b1x64  ORT int8 >= 2x eager:   {ratio['b1x64']['int8 basic']:.2f}x",
              f"  b32x128 served precision >= 1.3x eager: fp32 {ratio['b32x128']['fp32 basic']:.2f}x, "
              f"int8 {ratio['b32x128']['int8 basic']:.2f}x"]
    if quality:
        lines.append(f"  int8 accuracy within 0.5 points of fp32: "
                     f"{quality['int8']['accuracy'] - quality['fp32']['accuracy']:+.2f} points")
    lines.append(f"load average before timing {loads[0]}, after {loads[1]} ({os.cpu_count()} CPUs)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", help="a lab-size classifier artifact (default: random weights, or --train-epochs)")
    p.add_argument("--train-epochs", type=int, default=0, help="fine-tune one from scratch first (saved in --work)")
    p.add_argument("--work", type=Path, default=Path("runs/bench-export"), help="artifacts and bundles go here")
    p.add_argument("--threads", type=int, default=2, help="threads for torch and for onnxruntime (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--iters-b1", type=int, default=40, help="batch-1 calls per engine per round (default 40)")
    p.add_argument("--iters-b32", type=int, default=3, help="batch-32 calls per engine per round (default 3)")
    p.add_argument("--sweep-threads", type=int, nargs="*", default=[1],
                   help="also time torch, fp32 and int8 with these thread counts (default: 1)")
    p.add_argument("--engines", nargs="*", metavar="'VARIANT LEVEL'",
                   help="time only these ORT engines, e.g. 'fp32 basic' 'int8 basic' (default: all of TIMED)")
    p.add_argument("--eval-limit", type=int, default=0, help="score only the first N test reviews (0: all 2000)")
    p.add_argument("--no-eval", action="store_true", help="skip the accuracy part (timing only)")
    p.add_argument("--reuse", action="store_true", help="keep bundles in --work exported from the same weights")
    p.add_argument("--quiet-load", type=float, default=0.0,
                   help="before timing, wait up to --patience s for a 1-minute load average below this (0: no wait)")
    p.add_argument("--patience", type=float, default=1800, help="seconds to wait for --quiet-load (default 1800)")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    cfg = presets.lab()
    art_dir, what = make_artifact(args, cfg)
    art = artifact.load(art_dir)
    model = art.model()
    print(f"model: {what}\nthreads: {args.threads}; load average at start {os.getloadavg()}", flush=True)

    bundles, export_s = {}, {}
    for name, opts in VARIANTS.items():
        out = args.work / "bundles" / name
        if args.reuse and _same_source(out, art.meta["weights_sha256"], opts):
            bundles[name] = out
        else:
            try:
                bundles[name] = export_bundle(art_dir, out, opts)
            except ExportValidationError as e:  # a finding on this CPU (8-bit int8 without VNNI), not a crash
                print(f"  left out {name:18s} {e}", flush=True)
                continue
        manifest = json.loads((bundles[name] / "manifest.json").read_text())
        export_s[name] = manifest["export_seconds"]
        v = manifest["graphs"]["model.onnx"]["validation"]
        print(f"  exported {name:18s} {export_s[name]:5.1f} s, "
              f"{(bundles[name] / 'model.onnx').stat().st_size / 1e6:5.1f} MB, validation max |diff| "
              f"{v['max_abs_diff']:.2g}, agreement {v['label_agreement']:.1%}", flush=True)
    quality = {} if args.no_eval else score_bundles(art, model, bundles, cfg, args)

    if args.quiet_load:
        wait_quiet(args.quiet_load, args.patience)
    load_before = os.getloadavg()
    timed = [(v, lvl) for v, lvl in TIMED
             if v in bundles and (args.engines is None or f"{v} {lvl}" in args.engines)]
    sessions = {f"{v} {lvl}": session(bundles[v] / "model.onnx", lvl, args.threads) for v, lvl in timed}
    if args.engines is None:
        sessions["int8 basic, no spinning"] = session(bundles["int8"] / "model.onnx", "basic", args.threads,
                                                      spin=False)
    results = time_engines(model, sessions, cfg.model.vocab_size, args, args.threads)
    del sessions
    sweep = {}
    for threads in args.sweep_threads:
        sessions = {f"{v} basic": session(bundles[v] / "model.onnx", "basic", threads) for v in ("fp32", "int8")}
        sweep[threads] = time_engines(model, sessions, cfg.model.vocab_size, args, threads)
    torch.set_num_threads(args.threads)
    load_after = os.getloadavg()

    print(report(results, sweep, quality, bundles, export_s, (load_before, load_after)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "model": what,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.platform()}",
            "threads": args.threads, "versions": {"torch": torch.__version__, "onnxruntime": ort.__version__},
            "load_before": load_before, "load_after": load_after, "timing": results, "quality": quality,
            "thread_sweep": sweep, "export_seconds": export_s, "command": " ".join(sys.argv)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
