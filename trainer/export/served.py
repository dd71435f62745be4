"""A bundle's graph as the server runs it, for the trainer's own readers of bundles (`predict`, `export --check`):
verified (contract.bundle.verify_bundle), opened by the server's own opener (contract.session.open_graph), with the
bundle's tokenizer cut at the manifest's max_len."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from contract.bundle import Bundle, verify_bundle
from contract.manifest import TOKENIZER_DIR
from contract.session import open_graph
from contract.tokens import TOKENIZER_FILES
from trainer.data.tokenizer import Tokenizer
from trainer.export.score import graph_logits


@dataclass(frozen=True)
class ServedGraph:
    """One graph of a verified bundle in an onnxruntime session, with the bundle's tokenizer."""

    bundle: Bundle
    graph: str  # the graph file
    session: ort.InferenceSession
    provider: str  # the execution provider onnxruntime runs it on
    tokenizer: Tokenizer  # cut at the manifest's max_len

    @property
    def precision(self) -> str:
        return self.bundle.manifest.graphs[self.graph].precision

    def logits(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """(B, T) int64 ids, (B, T) int64 1 = real, right-padded -> (B, C) float32 logits, as the server computes
        them (a per-row graph: each row alone)."""
        return graph_logits(self.session, self.bundle.manifest.graphs[self.graph].per_row)(ids, mask)


def bundle_tokenizer(b: Bundle) -> Tokenizer:
    """The tokenizer of a verified bundle, from the bytes that were verified."""
    return Tokenizer.from_files({n: b.files[f"{TOKENIZER_DIR}/{n}"] for n in TOKENIZER_FILES},
                                b.folder / TOKENIZER_DIR, max_len=b.manifest.max_len)


def served_graph(b: Bundle, graph: str | None = None, prefer_gpu: bool = True) -> ServedGraph:
    """`graph` of a verified bundle (default: the one the manifest serves on the device onnxruntime offers here),
    opened and warmed up by the server's opener; prefer_gpu=False: on the CPU."""
    opened = open_graph(b, "auto" if prefer_gpu else "cpu", graph)
    return ServedGraph(b, opened.graph, opened.session, opened.provider, bundle_tokenizer(b))


def open_bundle(path: str | Path, prefer_gpu: bool = True) -> ServedGraph:
    """Verify a bundle folder and open the graph the server would run here."""
    return served_graph(verify_bundle(path), prefer_gpu=prefer_gpu)
