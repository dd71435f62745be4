"""Export a classifier artifact to a validated ONNX bundle, or check a bundle against a labelled file.

A bundle is a folder a server loads with no torch and no training code (contract/manifest.py describes it):
  model.onnx     one file (no external data): input_ids int64 [batch, sequence], attention_mask int64
                 [batch, sequence] (1 = real token, 0 = padding, right-padded) -> logits float32 [batch, classes]
  tokenizer/     copied from the artifact
  manifest.json  labels, max_len, special ids, opset, precision, input/output names, file checksums, the source
                 artifact, the exporter's versions, the validation results and the tolerances they were held to

Stages, one module each: graph.py (dynamo export, one fused Attention node per layer unless --no-fuse-attention),
precision.py (int8, fp16), validate.py (onnxruntime against PyTorch on batch 1, 2, 13 x lengths 1, 7, max and
padded mixed lengths; beyond the precision's tolerance: ExportValidationError naming the batch), score.py
(accuracy on --data), bundle.py (the folder, written into a temporary sibling and renamed into place: a failed
export leaves nothing behind), check.py (--check), cli.py.
"""

from trainer.export.bundle import ExportOptions, export_bundle
from trainer.export.check import check_bundle
from trainer.export.cli import EXAMPLES, add_arguments, main
from trainer.export.errors import ExportError, ExportValidationError

__all__ = ["EXAMPLES", "ExportError", "ExportOptions", "ExportValidationError", "add_arguments", "check_bundle",
           "export_bundle", "main"]
