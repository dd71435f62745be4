"""`python -m trainer export`: the command line of the exporter, of `--check` (with its CI thresholds) and of
`--triton-repo`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from contract.bundle import verify_bundle
from contract.manifest import DEVICES, PRECISIONS
from contract.runtime import DEFAULT_OPT_LEVEL, OPT_LEVELS
from trainer.cli import add_field_arguments
from trainer.export.behaviour import behaviour_report, report_lines
from trainer.export.check import SourceBaseline, check_bundle, source_artifact, source_baseline
from trainer.export.errors import ExportError
from trainer.export.quantize import INT8_CPU_BOUND, Tolerance
from trainer.export.thresholds import (
    EXIT_BELOW_THRESHOLD,
    EXIT_PASSED,
    Thresholds,
    evaluate,
    full_report,
    write_json,
    write_junit,
)
from trainer.export.triton import write_triton_repo
from trainer.export.write import AUTO, ExportOptions, export_bundle

EXAMPLES = """examples:
  python -m trainer export runs/finetune/artifact --out runs/bundle
  python -m trainer export runs/finetune/artifact --out runs/bundle --data test.review.spm
  python -m trainer export runs/finetune/artifact --out runs/bundle-fp32 --precision fp32
  python -m trainer export runs/finetune/artifact --out runs/bundle --gpu-precision fp16
  python -m trainer export runs/finetune/artifact --out runs/bundle --triton-repo runs/triton
  python -m trainer export --check runs/bundle --data test.review.spm
  python -m trainer export --check runs/bundle --behaviour
  python -m trainer export --check runs/bundle --data test.tsv --min-accuracy 70 --min-agreement 99 \\
      --baseline runs/previous-bundle --max-drop 0.5 --json check.json --junit check.xml

graphs: by default model.onnx (fp32) serves CUDA and model.int8.onnx serves the CPU when int8 stays within its bound
(on logits, and with --data on labels; beyond it export says so and the CPU serves fp32); --precision writes one graph.

--check exit codes: 0 passed, 1 a threshold not met, 2 bad input (bundle, data file or option: one line on stderr).
--behaviour: accuracy per capability (negation, intensity, ...) on short reviews in the manner of CheckList, for a
bundle whose language has a set (French book reviews: trainer/export/behaviour_sets/fr_books.tsv); reported, not a
threshold.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", nargs="?", help="classifier artifact folder (from finetune)")
    parser.add_argument("--out", metavar="BUNDLE", help="bundle folder to write (replaced atomically)")
    g = parser.add_argument_group("graphs and precision")
    g.add_argument("--precision", choices=[AUTO, *PRECISIONS], default=AUTO,
                   help="auto (default): fp32 model.onnx for CUDA + int8 model.int8.onnx for the CPU when within "
                        "its bound; fp32, int8 or fp16: one graph, model.onnx, served everywhere")
    g.add_argument("--gpu-precision", choices=["fp32", "fp16"], default="fp32",
                   help="auto: the CUDA graph; fp16 adds model.fp16.onnx for CUDA (default: fp32, model.onnx)")
    g.add_argument("--quantize", choices=["int8"], default=None, help=argparse.SUPPRESS)  # = --precision int8
    g.add_argument("--fp16", action="store_true", help=argparse.SUPPRESS)  # = --precision fp16
    bound = INT8_CPU_BOUND
    g.add_argument("--int8-max-logit-diff", type=float, metavar="X",
                   help=f"auto: largest |int8 - PyTorch| logit allowed on the validation batches (default "
                        f"{bound.max_abs_diff:g} + {bound.rel_diff:g} x the batch's largest |logit|)")
    g.add_argument("--int8-min-agreement", type=float, metavar="PCT",
                   help=f"auto, with --data: labels equal to PyTorch's on at least PCT%% "
                        f"(default {100 * bound.min_data_agreement:g})")
    g.add_argument("--int8-max-drop", type=float, metavar="POINTS",
                   help=f"auto, with --data: accuracy points int8 may lose (default {bound.max_accuracy_drop:g})")
    g.add_argument("--per-channel", action="store_true", help="int8: per-channel weight scales")
    g.add_argument("--full-range", action="store_true",
                   help="int8: 8-bit weights (default 7-bit: 8-bit ones overflow on x86 CPUs without VNNI)")
    g.add_argument("--reduce-range", action="store_true", help=argparse.SUPPRESS)  # 7-bit weights: the default
    g.add_argument("--optimize", choices=sorted(OPT_LEVELS), default=DEFAULT_OPT_LEVEL,
                   help=f"onnxruntime graph optimisation level to validate at and recommend "
                        f"(default: {DEFAULT_OPT_LEVEL})")
    g.add_argument("--save-optimized", action="store_true",
                   help="store the graphs onnxruntime optimised (basic/extended) instead of the raw export")
    g.add_argument("--no-fuse-attention", dest="fuse_attention", action="store_false",
                   help="keep the exporter's decomposed attention (plain ONNX ops only) instead of one "
                        "onnxruntime com.microsoft.Attention node per layer")
    g.add_argument("--max-len", type=int, help="longest sequence served (default: the tokenizer's max_len)")
    parser.add_argument("--data", metavar="FILE",
                        help="labelled file (.csv, .tsv, .jsonl, .parquet, .spm + .label): record the accuracy "
                             "change on export; required with --check")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N examples of --data")
    add_field_arguments(parser, "--data: ")

    t = parser.add_argument_group("Triton model repository")
    t.add_argument("--triton-repo", metavar="DIR",
                   help="also write DIR/NAME/{config.pbtxt, labels.txt, 1/model.onnx} for Triton's onnxruntime "
                        "backend, from the bundle just exported (or --from-bundle)")
    t.add_argument("--from-bundle", metavar="BUNDLE",
                   help="with --triton-repo: write it from this existing bundle, without exporting")
    t.add_argument("--triton-name", default="sentiment", metavar="NAME", help="model name (default: sentiment)")
    t.add_argument("--triton-device", choices=list(DEVICES), default="cuda",
                   help="whose graph: cuda (default; fp32/fp16, runs on a CPU-only Triton too) or cpu (int8 where "
                        "the bundle has it, CPU instances)")
    t.add_argument("--triton-max-batch", type=int, default=64, metavar="N", help="max_batch_size (default: 64)")

    c = parser.add_argument_group("check (a CI step: exit 0 passed, 1 a threshold not met, 2 bad input)")
    c.add_argument("--check", metavar="BUNDLE",
                   help="verify BUNDLE and report each graph's accuracy on --data, on --behaviour's set, or both")
    c.add_argument("--behaviour", nargs="?", const="", metavar="FILE",
                   help="report each graph's accuracy per capability on the behavioural set of the bundle's "
                        "language and the examples it fails (a language without a set: says so); FILE: a set of "
                        "your own (columns capability, label, text; its labels: the bundle's values, as in --data)")
    c.add_argument("--artifact", dest="check_artifact", metavar="ARTIFACT",
                   help="PyTorch model to compare with (default: the manifest's source artifact)")
    c.add_argument("--min-accuracy", type=float, metavar="PCT", help="threshold: accuracy on --data >= PCT percent")
    c.add_argument("--min-agreement", type=float, metavar="PCT",
                   help="threshold: labels equal to the PyTorch model's on >= PCT percent of --data")
    c.add_argument("--baseline", metavar="BUNDLE",
                   help="threshold: a previous bundle to compare with (with --max-drop)")
    c.add_argument("--max-drop", type=float, metavar="POINTS",
                   help="threshold: accuracy at most POINTS below --baseline's, per device")
    c.add_argument("--no-tfidf-baseline", dest="tfidf", action="store_false",
                   help="skip the TF-IDF + logistic regression baseline (fitted on the source artifact's training "
                        "split, scored on --data and --behaviour's set: seconds; it needs that artifact and its data)")
    c.add_argument("--json", metavar="FILE", help="write the check's report, thresholds included, as JSON")
    c.add_argument("--junit", metavar="FILE", help="write the check's thresholds as JUnit XML (CI test results)")


def options_from_args(args: argparse.Namespace) -> ExportOptions:
    precision = args.precision
    for old, value in (("--quantize int8", args.quantize), ("--fp16", "fp16" if args.fp16 else None)):
        if value is None:
            continue
        if precision not in (AUTO, value):
            raise ExportError(f"{old} and --precision {precision} are exclusive: choose one precision")
        precision = value
    if args.quantize and args.fp16:
        raise ExportError("--quantize int8 and --fp16 are exclusive: choose one precision")
    if args.reduce_range and args.full_range:
        raise ExportError("--reduce-range (7-bit int8 weights, the default) and --full-range are exclusive")
    if args.reduce_range and precision not in (AUTO, "int8"):
        raise ExportError(f"--reduce-range applies to int8 only, not to {precision}")
    for flag, value, top in (("--int8-max-logit-diff", args.int8_max_logit_diff, float("inf")),
                             ("--int8-min-agreement", args.int8_min_agreement, 100.0),
                             ("--int8-max-drop", args.int8_max_drop, 100.0)):
        if value is not None and not 0 <= value <= top:  # also refuses NaN
            raise ExportError(f"{flag} {value}: must be between 0 and {top:g}")
    b = INT8_CPU_BOUND
    bound = Tolerance(
        max_abs_diff=b.max_abs_diff if args.int8_max_logit_diff is None else args.int8_max_logit_diff,
        rel_diff=b.rel_diff if args.int8_max_logit_diff is None else 0.0,
        min_data_agreement=b.min_data_agreement if args.int8_min_agreement is None else args.int8_min_agreement / 100,
        max_accuracy_drop=b.max_accuracy_drop if args.int8_max_drop is None else args.int8_max_drop,
    )
    # A flag whose dest is a field's name (--gpu-precision, --optimize, --max-len, --text-field, ...) passes as it is;
    # the fields set after it are derived above or named otherwise on the command line.
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(ExportOptions) if hasattr(args, f.name)}
    fields.update(precision=precision, int8_bound=bound, data_file=Path(args.data) if args.data else None,
                  data_limit=args.limit)
    return ExportOptions(**fields)


def thresholds_from_args(args: argparse.Namespace) -> Thresholds:
    return Thresholds(min_accuracy=args.min_accuracy, min_agreement=args.min_agreement,
                      baseline=Path(args.baseline) if args.baseline else None, max_drop=args.max_drop)


def check(args: argparse.Namespace) -> int:
    """--check: the report on --data with its thresholds, the behavioural report (--behaviour), or both; the exit
    code (0 passed, 1 a threshold not met)."""
    if not args.data and args.behaviour is None:
        raise ExportError("--check needs --data FILE (a labelled file), --behaviour, or both")
    given = [flag for flag, value in (("--min-accuracy", args.min_accuracy), ("--min-agreement", args.min_agreement),
                                      ("--baseline", args.baseline), ("--max-drop", args.max_drop),
                                      ("--artifact", args.check_artifact), ("--junit", args.junit))
             if value is not None and not (flag == "--artifact" and args.behaviour is not None)]  # its baseline's
    if given and not args.data:
        raise ExportError(f"{', '.join(given)} {'go' if len(given) > 1 else 'goes'} with --data FILE (a labelled "
                          "file to score)")
    fitted = None
    if args.tfidf and args.data and args.behaviour is not None:  # one fit for both reports (minutes on IMDB)
        manifest = verify_bundle(args.check).manifest
        fitted = source_baseline(source_artifact(manifest, args.check_artifact or args.artifact))
    full = check_data(args, fitted) if args.data else {"thresholds": [], "passed": True, "exit_code": EXIT_PASSED}
    if args.behaviour is not None:
        full["behaviour"] = behaviour_report(args.check, args.behaviour or None, tfidf=args.tfidf,
                                             artifact_dir=args.check_artifact or args.artifact, fitted=fitted)
        print("\n".join(report_lines(full["behaviour"])))
    if args.json:
        write_json(Path(args.json), full)
    if args.junit:
        write_junit(Path(args.junit), full)
    return EXIT_PASSED if full["passed"] else EXIT_BELOW_THRESHOLD


def check_data(args: argparse.Namespace, fitted: SourceBaseline | None = None) -> dict[str, Any]:
    """--check --data: the report, the thresholds (printed) and what --json writes of them."""
    limits = thresholds_from_args(args)
    report = check_bundle(args.check, args.data, args.check_artifact or args.artifact, limit=args.limit,
                          text_field=args.text_field, label_field=args.label_field, tfidf=args.tfidf, fitted=fitted)
    baseline = None
    if limits.baseline is not None:
        baseline = check_bundle(limits.baseline, args.data, limit=args.limit, compare_torch=False,
                                text_field=args.text_field, label_field=args.label_field, tfidf=False)
    results = evaluate(report, limits, baseline)
    full = full_report(report, results, baseline)
    blank = f" ({report['blank_skipped']} blank texts skipped)" if report["blank_skipped"] else ""
    print(f"{report['bundle']} (bundle_sha256 {report['bundle_sha256'][:16]}...): {report['examples']} examples of "
          f"{report['file']}{blank}")
    for name, g in report["graphs"].items():
        line = (f"  {name} ({g['precision']}, serves {', '.join(g['serves']) or 'no device'}, {g['provider']}): "
                f"accuracy {g['bundle_accuracy']:.2f}%")
        if "torch_accuracy" in g:
            line += (f"; PyTorch {g['torch_accuracy']:.2f}%, label agreement {g['label_agreement']:.2%}, "
                     f"max |logit diff| {g['max_abs_diff']:.3g}")
        print(line + f"; ECE {g['ece_uncalibrated']:.4f} uncalibrated -> {g['ece_served']:.4f} served")
    cal = report["calibration"]
    print(f"  calibration: temperature {cal['temperature']:.4f} in every graph, fitted on {cal['fitted_on']}" if cal and
          cal.get("applied_in_graphs") else "  calibration: none (the probabilities served are the raw softmax)")
    if report["artifact"] is None:
        print("  no source artifact found: pass --artifact to compare with PyTorch")
    tfidf = report["tfidf_baseline"]
    if tfidf is not None and "skipped" in tfidf:
        print(f"  TF-IDF + logistic regression baseline not scored: {tfidf['skipped']}")
    elif tfidf is not None:
        print(f"  TF-IDF + logistic regression baseline ({tfidf['recipe']} n-grams, C={tfidf['C']:g}, fitted on "
              f"{tfidf['trained_on']}): accuracy {tfidf['accuracy']:.2f}%")
        for line in tfidf["verdicts"].values():
            print(f"  {line}")
    print("labels (value in the data -> name served): "
          + ", ".join(f"{v!r} -> {n!r}" for v, n in zip(report["label_values"], report["label_names"], strict=True)))
    for r in results:
        print(f"{'PASS' if r.passed else 'FAIL'} {r.threshold}: {r.message}")
    return full


def main(args: argparse.Namespace) -> int:
    if args.check:
        return check(args)
    if any(getattr(args, k) is not None for k in ("min_accuracy", "min_agreement", "baseline", "max_drop", "json",
                                                   "junit", "check_artifact", "behaviour")):
        raise ExportError("--min-accuracy, --min-agreement, --baseline, --max-drop, --json, --junit, --artifact and "
                          "--behaviour go with --check BUNDLE")
    if args.from_bundle:
        if not args.triton_repo or args.artifact or args.out:
            raise ExportError("--from-bundle BUNDLE goes with --triton-repo DIR, without ARTIFACT or --out")
        _triton(args, Path(args.from_bundle))
        return 0
    if not args.artifact or not args.out:
        raise ExportError("export needs ARTIFACT and --out BUNDLE (or --check BUNDLE --data FILE)")
    out = export_bundle(args.artifact, args.out, options_from_args(args))
    m = verify_bundle(out).manifest
    sizes = ", ".join(f"{n} {g.precision} {(out / n).stat().st_size / 1e6:.1f} MB" for n, g in m.graphs.items())
    print(f"wrote {out} (opset {m.opset}, max_len {m.max_len}; {sizes}) in {m.export_seconds} s")
    print("serves: " + ", ".join(f"{d} -> {n} ({m.graphs[n].precision})" for d, n in m.serve.items()))
    print(f"bundle_sha256 {m.bundle_sha256} (the server reports it in GetModelMetadata)")
    print("labels (value in the data -> name served): "
          + ", ".join(f"{v!r} -> {n!r}" for v, n in zip(m.label_values, m.label_names, strict=True)))
    for name, g in m.graphs.items():
        v = g.validation
        if v.get("passed"):
            print(f"{name} validated on {v['provider']}: {len(v['cases'])} batches, max |logit diff| "
                  f"{v['max_abs_diff']:.3g} (tolerance {v['tolerance']['max_abs_diff']:g} + "
                  f"{v['tolerance']['rel_diff']:g} x max |logit|), label agreement {v['label_agreement']:.2%}")
        else:
            print(f"{name} not validated: {v.get('skipped')}", file=sys.stderr)
        if "data" in v:
            d = v["data"]
            print(f"  {d['file']}: accuracy {d['bundle_accuracy']:.2f}% vs PyTorch {d['torch_accuracy']:.2f}% "
                  f"({d['accuracy_change_points']:+.2f} points), label agreement {d['label_agreement']:.2%}")
    if m.cpu_int8 is not None and not m.cpu_int8["accepted"]:
        print(f"warning: int8 left out of the bundle: {m.cpu_int8['reason']}", file=sys.stderr)
    if args.triton_repo:
        _triton(args, out)
    return 0


def _triton(args: argparse.Namespace, bundle: Path) -> None:
    model = write_triton_repo(bundle, args.triton_repo, args.triton_name, args.triton_device, args.triton_max_batch)
    print(f"wrote the Triton model {model} (config.pbtxt, {args.triton_device} graph in 1/model.onnx)")
