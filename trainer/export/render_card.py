"""`python -m trainer.export.render_card BUNDLE`: a bundle's model card rendered again from its manifest.json by this
code (trainer/export/card.py), on stdout; the bundle's own MODEL_CARD.md is left as it is (its checksum is in the
manifest). docs/MODEL_CARD.example.md is the `make demo` bundle's:

    python -m trainer.export.render_card runs/demo-DATE/bundle > docs/MODEL_CARD.example.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from contract.errors import BundleError
from contract.manifest import EXTRA_GRAPH_FILES, MANIFEST_FILE, MODEL_FILE, Manifest, read_manifest
from trainer.export.card import render
from trainer.export.write import AUTO, ExportOptions


def export_command_of(m: Manifest) -> str:
    """The `python -m trainer export` command a manifest implies: its graphs, runtime and quantization give the
    options (what ExportOptions.command writes; the int8 bound and --data leave no other trace in the command)."""
    quant = next((g.quantization for g in m.graphs.values() if g.precision == "int8" and g.quantization), {}) or {}
    auto = m.cpu_int8 is not None
    artifact_max_len = m.evaluation.get("max_len")
    opt = ExportOptions(precision=AUTO if auto else m.graphs[MODEL_FILE].precision,
                        gpu_precision="fp16" if auto and EXTRA_GRAPH_FILES["fp16"] in m.graphs else "fp32",
                        optimize=m.runtime.graph_optimization_level, save_optimized=m.runtime.optimized_offline,
                        fuse_attention=m.runtime.fused_attention, per_channel=bool(quant.get("per_channel")),
                        full_range=bool(quant) and not quant.get("reduce_range", True),
                        max_len=None if artifact_max_len in (None, m.max_len) else m.max_len)
    return opt.command(Path(m.source_artifact.get("path") or "ARTIFACT"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export.render_card",
                                     description="print the model card of a bundle's manifest.json, rendered by "
                                                 "this version's exporter")
    parser.add_argument("bundle", help="bundle folder (holds manifest.json)")
    args = parser.parse_args(argv)
    path = Path(args.bundle) / MANIFEST_FILE
    try:
        manifest = read_manifest(path.read_bytes(), path)  # checked: fields and the manifest's own digest
    except OSError as e:
        print(f"error: {path}: {e.strerror or e}", file=sys.stderr)
        return 2
    except BundleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render(manifest, export_command_of(manifest)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
