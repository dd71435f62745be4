"""A model bundle loaded into onnxruntime: texts -> labels, probabilities, token counts. No gRPC, no torch.

The bundle (its graphs, tokenizer/, manifest.json: contract/manifest.py) is checked by contract.bundle.verify_bundle,
the bytes it verified are what gets loaded (no window between check and load), and the graph runs once at max_len
before the constructor returns. Which graph: the manifest's for the device onnxruntime runs on ("serve": by default
the int8 graph on a CPU, the fp32 or fp16 one on CUDA). A dynamic int8 graph runs one text per onnxruntime run, so
that no text's answer depends on the texts batched with it (contract/manifest.py, Graph.per_row). A missing, corrupt,
tampered or inconsistent bundle is a `BundleError` naming the file, on one line.

Shapes: n texts, T = the longest sequence of a batch (<= max_len), C classes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from contract.bundle import verify_bundle
from contract.errors import SessionError
from contract.graph import ATTENTION_MASK, INPUT_IDS, LOGITS
from contract.runtime import CPU, OPT_LEVELS, Device, x86_without_vnni
from contract.session import open_graph
from contract.tokens import PAD, Encoded, TokenEncoder
from serving.errors import ServerConfigError

log = logging.getLogger(__name__)

Optimization = Literal["disable", "basic", "extended", "all"]


@dataclass(frozen=True)
class Prediction:
    """The answer for one text."""

    label: str  # label_names[label_index]
    label_index: int  # argmax of probabilities
    probabilities: np.ndarray  # (C,) float32, in the manifest's label order, sums to 1
    token_count: int  # ids the model read, <sos> and <eos> included
    truncated: bool  # pieces were cut to fit max_len


class Predictor:
    """Tokenizer + onnxruntime session for one bundle. Thread-safe: `infer` may be called concurrently."""

    def __init__(
        self,
        bundle: str | Path,
        *,
        device: Device = "auto",
        intra_op_threads: int = 0,
        inter_op_threads: int = 0,
        optimization: Optimization | None = None,
        spinning: bool = False,
        graph: str | None = None,
    ) -> None:
        """device: 'auto' (CUDA when usable, else CPU), 'cpu', or 'cuda' (an error if CUDA cannot load).
        intra_op_threads / inter_op_threads: onnxruntime thread pools (0 = its default: one per core).
        optimization: graph optimization level; None = the level the bundle was validated at (manifest
        runtime.graph_optimization_level).
        spinning: let idle onnxruntime threads spin between runs; off by default because a server's cores are
        shared with its gRPC threads (and here with the client): spinning threads take their time.
        graph: a graph file of the bundle to run instead of the manifest's choice for the device (benchmarks)."""
        if optimization is not None and optimization not in OPT_LEVELS:
            raise ServerConfigError(f"optimization must be one of {list(OPT_LEVELS)}, got {optimization!r}")
        if intra_op_threads < 0 or inter_op_threads < 0:
            raise ServerConfigError(f"thread counts must be >= 0, got intra {intra_op_threads}, inter "
                                    f"{inter_op_threads}")
        b = verify_bundle(bundle)
        self.bundle_dir = b.folder
        self.manifest = b.manifest
        self.model_card: str = b.model_card  # MODEL_CARD.md, verified ("" before bundle format 4)
        self.bundle_sha256 = b.bundle_sha256  # the manifest's own digest, over every file: GetModelMetadata says it
        self.label_names: list[str] = list(b.manifest.label_names)  # what clients get, in logit order
        self.label_values: list[str] = list(b.manifest.label_values)  # the data's value of each label, same order
        self.max_len: int = b.manifest.max_len
        self.tokenizer = TokenEncoder.from_files(b.tokenizer, max_len=self.max_len)
        try:
            opened = open_graph(b, device, graph, optimization, intra_op_threads, inter_op_threads, spinning)
        except SessionError as e:
            raise ServerConfigError(str(e)) from None
        self.graph, self.session, self.provider, self.optimization = (opened.graph, opened.session, opened.provider,
                                                                       opened.level)
        self.precision: str = b.manifest.graphs[self.graph].precision
        self.per_row: bool = b.manifest.graphs[self.graph].per_row  # int8: one text per run (contract/manifest.py)
        self._lock = threading.Lock()
        self._runs = 0
        log.info("loaded bundle %s (sha256 %s, %s: %s, max_len %d, labels %s, graph optimization %s) on %s",
                 b.folder, self.bundle_sha256[:12], self.graph, self.precision, self.max_len, self.label_names,
                 self.optimization, self.provider)
        quant = b.manifest.graphs[self.graph].quantization or {}
        if self.provider == CPU and self.precision == "int8" and quant.get("reduce_range") is False \
                and x86_without_vnni():
            # Exported before 7-bit weights were the default: its answers move on this CPU, nothing fails.
            log.warning("%s: %s has 8-bit int8 weights and this CPU has no VNNI, where onnxruntime's int8 kernel "
                        "overflows on them and the logits move (docs/BENCHMARKS.md, Export): export the bundle "
                        "again (7-bit weights by default)", b.folder, self.graph)

    @property
    def runs(self) -> int:
        """Batches `infer` has run so far (tests use it to prove batching); a per-row graph runs each of their
        texts alone."""
        return self._runs

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        return self.tokenizer.encode_many(texts)

    def infer(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        """Rows of ids -> (n, C) float32 probabilities: one onnxruntime run over the right-padded rows, or one run per
        row for a per-row graph. Either way a row's answer does not depend on the other rows."""
        probs = np.concatenate([self._run(rows[i:i + 1]) for i in range(len(rows))]) if self.per_row \
            else self._run(rows)
        with self._lock:
            self._runs += 1
        return probs

    def _run(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        n, T = len(rows), max(r.shape[0] for r in rows)
        ids = np.full((n, T), PAD, dtype=np.int64)  # (n, T)
        mask = np.zeros((n, T), dtype=np.int64)  # (n, T), 1 = real token
        for i, r in enumerate(rows):
            ids[i, : r.shape[0]] = r
            mask[i, : r.shape[0]] = 1
        (logits,) = self.session.run([LOGITS], {INPUT_IDS: ids, ATTENTION_MASK: mask})  # (n, C)
        return softmax(logits)

    def predictions(self, encoded: Sequence[Encoded], probabilities: np.ndarray) -> list[Prediction]:
        """Pair each encoded text with its (C,) probability row."""
        best = probabilities.argmax(axis=1).tolist()  # one numpy call for the batch, not one per text
        return [Prediction(self.label_names[k], k, p, e.token_count, e.truncated)
                for e, p, k in zip(encoded, probabilities, best, strict=True)]

    def predict(self, texts: Sequence[str]) -> list[Prediction]:
        """Texts -> predictions in one onnxruntime run (the in-process reference the server must equal)."""
        encoded = self.encode(texts)
        return self.predictions(encoded, self.infer([e.ids for e in encoded]))


def softmax(logits: np.ndarray) -> np.ndarray:
    """(n, C) -> (n, C) float32; the row max is subtracted first so exp never overflows."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
