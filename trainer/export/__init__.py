"""Export a classifier artifact to a validated ONNX bundle, check a bundle against a labelled file (with CI
thresholds), or write a bundle's graph as a Triton model repository.

A bundle is a folder a server loads with no torch and no training code (contract/manifest.py describes it):
  model.onnx       one file (no external data): input_ids int64 [batch, sequence], attention_mask int64
                   [batch, sequence] (1 = real token, 0 = padding, right-padded) -> logits float32 [batch, classes];
                   fp32 by default, the graph a CUDA server runs
  model.int8.onnx  by default, when within its bound: the same graph with int8 weights, the graph a CPU server runs
  tokenizer/       spm.model and vocab.txt from the artifact, meta.json
  manifest.json    labels, max_len, special ids, opset, input/output names, each graph's precision and validation,
                   which graph serves which device, file checksums, the source artifact, the exporter's versions
Each graph's metadata_props repeat labels, max_len, special ids and precision for any ONNX tool.

Stages, one module each: graph.py (dynamo export, one fused Attention node per layer unless --no-fuse-attention),
quantize.py (int8, fp16, the tolerances), validate.py (onnxruntime against PyTorch on batch 1, 2, 13 x lengths 1,
7, max and padded mixed lengths; beyond the precision's tolerance: ExportValidationError naming the batch),
score.py (accuracy on --data), write.py (the bundle folder, written into a temporary sibling and renamed into place: a
failed export leaves nothing behind), served.py (a bundle's graph as the server runs it), check.py
(--check), thresholds.py (--check's thresholds, exit codes, JSON and JUnit reports), triton.py (--triton-repo), cli.py.
Other stages (`predict`) use only what this package exports below.
"""

from trainer.export.check import check_bundle
from trainer.export.cli import EXAMPLES, add_arguments, main
from trainer.export.errors import ExportError, ExportValidationError
from trainer.export.score import predict as batched_logits
from trainer.export.served import ServedGraph, open_bundle
from trainer.export.triton import write_triton_repo
from trainer.export.validate import torch_logits
from trainer.export.write import ExportOptions, export_bundle

__all__ = ["EXAMPLES", "ExportError", "ExportOptions", "ExportValidationError", "ServedGraph", "add_arguments",
           "batched_logits", "check_bundle", "export_bundle", "main", "open_bundle", "torch_logits",
           "write_triton_repo"]
