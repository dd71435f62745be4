"""A bundle's graph in an onnxruntime session, opened as the server opens it: the one opener that the server's
Predictor and the trainer's readers of bundles (`predict`, `export --check`) call.

Which graph: the one named, else the one the manifest serves ("serve") on the device onnxruntime is asked for: CUDA
where `device` allows it and a driver exists, else the CPU. It is opened from the bytes the verifier checked (the
file on disk could change after its checksum was), at the manifest's optimisation level unless told another. When
'auto' asked for CUDA and onnxruntime fell back to the CPU, the bundle's CPU graph runs instead and a warning says
why; 'cuda' is CUDA or a SessionError. Last, the warm-up at max_len (contract.bundle.check_session), before anyone is
answered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import onnxruntime as ort

from contract import runtime
from contract.bundle import Bundle, check_session
from contract.errors import BundleError, SessionError, one_line
from contract.runtime import CUDA, Device

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BundleSession:
    """One graph of a verified bundle, opened and warmed up."""

    graph: str  # the bundle's graph file
    session: ort.InferenceSession
    provider: str  # the execution provider onnxruntime runs it on: session.get_providers()[0]
    level: str  # the graph optimisation level it was opened at


def open_graph(bundle: Bundle, device: Device = "auto", graph: str | None = None, level: str | None = None,
               intra_op_threads: int = 0, inter_op_threads: int = 0,
               spinning: bool | None = None) -> BundleSession:
    """`graph` of a verified bundle (default: the manifest's for the device), as the module docstring says. Threads:
    onnxruntime's pools (0: its default, one per core); spinning: whether idle intra-op threads spin between runs
    (None: onnxruntime's default)."""
    m = bundle.manifest
    if graph is not None and graph not in m.graphs:
        raise SessionError(f"graph {graph!r} is not in {bundle.folder} (its graphs: {', '.join(m.graphs)})")
    try:
        wanted = runtime.providers(device)
    except ValueError as e:
        raise SessionError(str(e)) from None
    level = level or m.runtime.graph_optimization_level

    def opened(name: str, device: Device) -> ort.InferenceSession:
        try:
            return runtime.inference_session(bundle.graph_bytes(name), level, device, intra_op_threads,
                                             inter_op_threads, spinning)
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph/... types
            raise BundleError(f"{bundle.folder / name}: onnxruntime cannot load it ({one_line(e)})") from None

    name = graph or m.graph_for("cuda" if wanted[0] == CUDA else "cpu")
    session = opened(name, device)
    # The provider actually in use: get_available_providers() and a silent CPU fallback both lie.
    if wanted[0] == CUDA and session.get_providers()[0] != CUDA:
        reason = runtime.cuda_unavailable_reason()
        if device == "cuda":
            raise SessionError(f"device='cuda' but onnxruntime runs on {session.get_providers()[0]}: {reason}")
        cpu_graph = graph or m.graph_for("cpu")
        log.warning("CUDA did not load (%s): running %s, the bundle's CPU graph", reason, cpu_graph)
        if cpu_graph != name:
            name, session = cpu_graph, opened(cpu_graph, "cpu")
    check_session(session, bundle, name)
    return BundleSession(name, session, session.get_providers()[0], level)
