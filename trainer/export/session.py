"""A bundle's graph opened the way the server opens it, for the trainer's own readers of bundles (`predict`,
`export --check`): verified (contract.bundle.verify_bundle), the graph the manifest serves on this device (or the one
named), its onnxruntime session at the manifest's optimisation level, the warm-up at max_len, and the bundle's
tokenizer cut at the manifest's max_len."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from contract.bundle import Bundle, check_session, verify_bundle
from contract.errors import BundleError, one_line
from contract.manifest import TOKENIZER_DIR
from contract.runtime import CUDA, cuda_driver_present
from contract.tokens import TOKENIZER_FILES
from trainer.data.tokenizer import Tokenizer
from trainer.export.graph import open_session
from trainer.export.score import graph_logits


@dataclass(frozen=True)
class ServedGraph:
    """One graph of a verified bundle in an onnxruntime session, with the bundle's tokenizer."""

    bundle: Bundle
    graph: str  # the graph file
    session: ort.InferenceSession
    tokenizer: Tokenizer  # cut at the manifest's max_len

    @property
    def provider(self) -> str:
        return self.session.get_providers()[0]

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


def open_graph(b: Bundle, graph: str | None = None, prefer_gpu: bool = True) -> ServedGraph:
    """`graph` of a verified bundle (default: the one the manifest serves on the device onnxruntime offers here: the
    CUDA one where a GPU is usable, else the CPU one), opened and warmed up as the server does."""
    cuda = prefer_gpu and cuda_driver_present() and CUDA in ort.get_available_providers()
    name = graph or b.manifest.graph_for("cuda" if cuda else "cpu")
    try:
        session = open_session(b.graph_bytes(name), b.manifest.runtime.graph_optimization_level,
                               prefer_gpu=prefer_gpu and name == b.manifest.graph_for("cuda"))
    except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph/... types
        raise BundleError(f"{b.folder / name}: onnxruntime cannot load it ({one_line(e)})") from None
    check_session(session, b, name)
    return ServedGraph(b, name, session, bundle_tokenizer(b))


def open_bundle(path: str | Path, prefer_gpu: bool = True) -> ServedGraph:
    """Verify a bundle folder and open the graph the server would run here."""
    return open_graph(verify_bundle(path), prefer_gpu=prefer_gpu)
