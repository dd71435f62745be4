"""The graph's signature, declared once: the exporter passes it to torch.onnx.export, the manifest records it, the
verifier and the server hold model.onnx to it.

  input_ids       int64 (batch, sequence)   right-padded token ids
  attention_mask  int64 (batch, sequence)   1 = real token, 0 = padding
  logits          float32 (batch, classes)  classes is static: the head's width
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import onnx

BATCH_AXIS, SEQUENCE_AXIS = "batch", "sequence"
INPUT_IDS, ATTENTION_MASK, LOGITS = "input_ids", "attention_mask", "logits"
INPUTS: tuple[tuple[str, str], ...] = ((INPUT_IDS, "int64"), (ATTENTION_MASK, "int64"))
OUTPUT = (LOGITS, "float32")


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: symbolic dims by name, static ones as ints."""

    name: str
    dtype: str
    shape: tuple[str | int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


def expected_io(num_classes: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The declared inputs and outputs of a classifier with `num_classes` classes."""
    inputs = [TensorSpec(n, d, (BATCH_AXIS, SEQUENCE_AXIS)) for n, d in INPUTS]
    return inputs, [TensorSpec(OUTPUT[0], OUTPUT[1], (BATCH_AXIS, num_classes))]


def io_spec(values: Sequence[onnx.ValueInfoProto]) -> list[TensorSpec]:
    """The specs of a graph's inputs or outputs."""
    out = []
    for v in values:
        t = v.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
        out.append(TensorSpec(v.name, dtype, tuple(d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim)))
    return out


def as_dicts(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
    return [s.to_dict() for s in specs]


@dataclass(frozen=True)
class Tables:
    """The graph's own limits, read from its weights (its initializers), which onnxruntime will index."""

    embedding_rows: int | None  # ids it can read: rows of the token embedding that input_ids index
    position_rows: int | None  # longest sequence it can read: rows of the positional table cut to the length


def tables(model: onnx.ModelProto) -> Tables:
    """The token embedding: the 2-D initializer that a Gather on axis 0 indexes with input_ids. The positional
    table: the 2-D initializer of the embedding's width that a Slice cuts to the sequence (the exporter's form of
    `positions[:T]` in trainer/model/encoder.py). None where the graph has no such table, or two that disagree."""
    dims = {t.name: tuple(t.dims) for t in model.graph.initializer}
    embeddings = {dims[n.input[0]] for n in model.graph.node
                  if n.op_type == "Gather" and len(n.input) == 2 and n.input[1] == INPUT_IDS
                  and len(dims.get(n.input[0], ())) == 2 and all(a.name != "axis" or a.i == 0 for a in n.attribute)}
    if len(embeddings) != 1:
        return Tables(None, None)
    ((rows, width),) = embeddings
    positions = {dims[n.input[0]][0] for n in model.graph.node
                 if n.op_type == "Slice" and n.input and len(dims.get(n.input[0], ())) == 2
                 and dims[n.input[0]][1] == width}
    return Tables(rows, positions.pop() if len(positions) == 1 else None)
