"""Stage 1: the classifier as an ONNX graph, checked against the declared signature.

The graph comes from the dynamo exporter (`torch.onnx.export(..., dynamo=True)`) with symbolic batch and sequence
axes: the TorchScript exporter bakes the attention's reshape into the graph, which then fails on every other shape.
Each layer's self-attention becomes one onnxruntime `com.microsoft.Attention` node (trainer/model/onnx_attention.py)
unless `fuse_attention=False`, and the mean pooling a running sum, so that a row's logits do not depend on its batch
(trainer/model/onnx_pooling.py).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import onnx
import torch
from torch import nn

from contract.graph import BATCH_AXIS, INPUTS, OUTPUT, SEQUENCE_AXIS, as_dicts, expected_io, io_spec
from contract.tokens import N_SPECIALS
from trainer.export.errors import ExportError

STACK_TRACE = "pkg.torch.onnx.stack_trace"  # node metadata written by torch.onnx.export(dynamo=True)


class ExportWrapper(nn.Module):
    """The served signature around the plain model: an int64 attention mask (1 = real) instead of a bool
    padding mask (True = <pad>), so that clients need no bool tensors and the model stays as trained."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) int64, (B, T) int64 -> (B, C) float32 logits."""
        return self.model(input_ids, attention_mask == 0)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The dynamo exporter warns about torchvision ops and deprecated pytree classes on every call: noise here."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.simplefilter("ignore", category=UserWarning)
            yield
    finally:
        logger.setLevel(level)


def export_onnx(model: nn.Module, path: Path, max_len: int, opset: int | None = None,
                fuse_attention: bool = True) -> onnx.ModelProto:
    """Write the fp32 graph of a Classifier to `path` (one file) and return it. Batch and sequence are dynamic
    (torch.export Dim); the example batch avoids sizes 0/1, which torch.export would specialise.
    fuse_attention: each layer's self-attention becomes one com.microsoft.Attention node
    (trainer/model/onnx_attention.py)."""
    from trainer.model.onnx_attention import TRANSLATION_TABLE, with_fused_attention
    from trainer.model.onnx_pooling import with_scan_pooling

    model = with_scan_pooling(model)  # a row's logits independent of its batch (trainer/model/onnx_pooling.py)
    wrapper = ExportWrapper(with_fused_attention(model) if fuse_attention else model).eval()
    batch = torch.export.Dim(BATCH_AXIS, min=1)
    sequence = torch.export.Dim(SEQUENCE_AXIS, min=1, max=max_len)
    t_example = min(7, max_len)
    ids = torch.full((2, t_example), N_SPECIALS, dtype=torch.int64)  # the first piece id
    mask = torch.ones((2, t_example), dtype=torch.int64)
    axes = {0: batch, 1: sequence}
    with _quiet_exporter(), torch.no_grad():
        torch.onnx.export(
            wrapper,
            (ids, mask),
            str(path),
            dynamo=True,
            external_data=False,  # one file: a model loaded from bytes cannot find external data
            input_names=[n for n, _ in INPUTS],
            output_names=[OUTPUT[0]],
            dynamic_shapes={INPUTS[0][0]: axes, INPUTS[1][0]: axes},
            opset_version=opset,
            custom_translation_table=TRANSLATION_TABLE if fuse_attention else None,
            verbose=False,
        )
    graph = onnx.load(str(path))
    _drop_stack_traces(graph)
    onnx.save(graph, str(path))
    return graph


def _drop_stack_traces(model: onnx.ModelProto) -> None:
    """The dynamo exporter records, on every node, the Python stack that made it: absolute paths of this checkout
    and its virtualenv, and line numbers. A bundle would then differ with the folder it was exported from and leak
    it; the graph, its names and the exporter's other node metadata stay."""
    for node in model.graph.node:
        keep = [p for p in node.metadata_props if p.key != STACK_TRACE]
        del node.metadata_props[:]
        node.metadata_props.extend(keep)


def check_graph(model: onnx.ModelProto, num_classes: int, where: str) -> None:
    """The graph's names, dtypes and axes are the declared ones, and `onnx.checker` (full check) passes."""
    inputs, outputs = expected_io(num_classes)
    got_in, got_out = io_spec(model.graph.input), io_spec(model.graph.output)
    if got_in != inputs or got_out != outputs:
        raise ExportError(f"{where}: graph inputs {as_dicts(got_in)} / outputs {as_dicts(got_out)} differ from the "
                          f"declared inputs {as_dicts(inputs)} / outputs {as_dicts(outputs)}")
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"{where}: onnx.checker failed: {e}") from None
