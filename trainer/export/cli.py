"""`python -m trainer export`: the command line of the exporter and of `--check`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from contract.bundle import verify_bundle
from contract.manifest import MODEL_FILE
from contract.runtime import DEFAULT_OPT_LEVEL, OPT_LEVELS
from trainer.export.bundle import ExportOptions, export_bundle
from trainer.export.check import check_bundle
from trainer.export.errors import ExportError

EXAMPLES = """examples:
  python -m trainer export runs/finetune/artifact --out runs/bundle
  python -m trainer export runs/finetune/artifact --out runs/bundle-int8 --quantize int8 \\
      --data ../shared/data/cls-books-fr/test.review.spm
  python -m trainer export runs/finetune/artifact --out runs/bundle-fp16 --fp16
  python -m trainer export --check runs/bundle --data ../shared/data/cls-books-fr/test.review.spm
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", nargs="?", help="classifier artifact folder (from finetune)")
    parser.add_argument("--out", metavar="BUNDLE", help="bundle folder to write (replaced atomically)")
    parser.add_argument("--quantize", choices=["int8"], help="dynamic int8 quantisation (CPU serving)")
    parser.add_argument("--fp16", action="store_true", help="fp16 weights and activations (GPU serving)")
    parser.add_argument("--optimize", choices=sorted(OPT_LEVELS), default=DEFAULT_OPT_LEVEL,
                        help=f"onnxruntime graph optimisation level to validate at and recommend "
                             f"(default: {DEFAULT_OPT_LEVEL})")
    parser.add_argument("--save-optimized", action="store_true",
                        help="store the graph onnxruntime optimised (basic/extended) instead of the raw export")
    parser.add_argument("--no-fuse-attention", dest="fuse_attention", action="store_false",
                        help="keep the exporter's decomposed attention (plain ONNX ops only) instead of one "
                             "onnxruntime com.microsoft.Attention node per layer")
    parser.add_argument("--per-channel", action="store_true", help="int8: per-channel weight scales")
    parser.add_argument("--reduce-range", action="store_true", help="int8: 7-bit weights (older x86 CPUs)")
    parser.add_argument("--max-len", type=int, help="longest sequence served (default: the tokenizer's max_len)")
    parser.add_argument("--data", metavar="FILE",
                        help="labelled file (.spm + .label, .tsv, .jsonl): record the accuracy change on export; "
                             "required with --check")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N examples of --data")
    parser.add_argument("--text-field", metavar="NAME",
                        help="--data: the .jsonl key / .tsv column of the text (default: the artifact's "
                             "data.text_field, else 'text')")
    parser.add_argument("--label-field", metavar="NAME",
                        help="--data: the .jsonl key / .tsv column of the label (default: the artifact's "
                             "data.label_field, else 'label')")
    parser.add_argument("--check", metavar="BUNDLE", help="verify BUNDLE and report its accuracy on --data")
    parser.add_argument("--artifact", dest="check_artifact", metavar="ARTIFACT",
                        help="--check: PyTorch model to compare with (default: the manifest's source artifact)")


def options_from_args(args: argparse.Namespace) -> ExportOptions:
    if args.quantize and args.fp16:
        raise ExportError("--quantize int8 and --fp16 are exclusive: choose one precision")
    return ExportOptions(
        precision=args.quantize or ("fp16" if args.fp16 else "fp32"),
        optimize=args.optimize,
        save_optimized=args.save_optimized,
        fuse_attention=args.fuse_attention,
        per_channel=args.per_channel,
        reduce_range=args.reduce_range,
        max_len=args.max_len,
        data_file=Path(args.data) if args.data else None,
        data_limit=args.limit,
        text_field=args.text_field,
        label_field=args.label_field,
    )


def main(args: argparse.Namespace) -> int:
    if args.check:
        if not args.data:
            raise ExportError("--check needs --data FILE (a labelled file)")
        report = check_bundle(args.check, args.data, args.check_artifact or args.artifact, limit=args.limit,
                              text_field=args.text_field, label_field=args.label_field)
        line = f"{report['bundle']} ({report['precision']}, {report['provider']}, bundle_sha256 " \
               f"{report['bundle_sha256'][:16]}...): accuracy " \
               f"{report['bundle_accuracy']:.2f}% on {report['examples']} examples of {report['file']}"
        if "torch_accuracy" in report:
            line += (f"; PyTorch {report['torch_accuracy']:.2f}%, label agreement {report['label_agreement']:.2%}, "
                     f"max |logit diff| {report['max_abs_diff']:.3g}")
        else:
            line += "; no source artifact found: pass --artifact to compare with PyTorch"
        print(line)
        print("labels (value in the data -> name served): "
              + ", ".join(f"{v!r} -> {n!r}" for v, n in report["labels"].items()))
        return 0
    if not args.artifact or not args.out:
        raise ExportError("export needs ARTIFACT and --out BUNDLE (or --check BUNDLE --data FILE)")
    out = export_bundle(args.artifact, args.out, options_from_args(args))
    manifest = verify_bundle(out).manifest
    v = manifest.validation
    print(f"wrote {out} ({manifest.precision}, opset {manifest.opset}, max_len {manifest.max_len}, "
          f"{(out / MODEL_FILE).stat().st_size / 1e6:.1f} MB) in {manifest.export_seconds} s")
    print(f"bundle_sha256 {manifest.bundle_sha256} (the server reports it in GetModelMetadata)")
    print("labels (value in the data -> name served): "
          + ", ".join(f"{v!r} -> {n!r}" for v, n in zip(manifest.label_values, manifest.label_names, strict=True)))
    if v.get("passed"):
        print(f"validated on {v['provider']}: {len(v['cases'])} batches, max |logit diff| {v['max_abs_diff']:.3g} "
              f"(tolerance {v['tolerance']['max_abs_diff']:g}), label agreement {v['label_agreement']:.2%}")
    else:
        print(f"not validated: {v.get('skipped')}", file=sys.stderr)
    if "data" in v:
        d = v["data"]
        print(f"{d['file']}: accuracy {d['bundle_accuracy']:.2f}% vs PyTorch {d['torch_accuracy']:.2f}% "
              f"({d['accuracy_change_points']:+.2f} points), label agreement {d['label_agreement']:.2%}")
    return 0
