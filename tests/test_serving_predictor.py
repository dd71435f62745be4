"""serving/model/predictor.py on the real exported tiny bundle: answers, providers, and refusal of bad bundles."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from bundles import edit_manifest
from procs import NO_ORT_CUDA, REPO
from serving_fixtures import reviews

from contract.runtime import CPU, CUDA, CUDA_PROVIDER_LIBRARY, DRIVER_LIBRARY, cuda_driver_present
from serving.errors import BundleError, ServerConfigError
from serving.model.predictor import Predictor, softmax


def test_predictions_equal_a_plain_onnxruntime_session(predictor: Predictor, tiny_bundle: Path,
                                                       data_dir: Path) -> None:
    texts = reviews(data_dir, 13) + ["Bien.", "Un livre que je n'ai pas aimé du tout."]
    preds = predictor.predict(texts)
    # The reference: our own padding, the bundle's graph, numpy softmax.
    session = ort.InferenceSession(str(tiny_bundle / "model.onnx"), providers=[CPU])
    ids = [predictor.tokenizer.encode(t).ids for t in texts]
    T = max(len(r) for r in ids)
    batch = np.ones((len(ids), T), dtype=np.int64)  # <pad> = 1
    mask = np.zeros_like(batch)
    for i, r in enumerate(ids):
        batch[i, : len(r)], mask[i, : len(r)] = r, 1
    (logits,) = session.run(None, {"input_ids": batch, "attention_mask": mask})
    expected = np.exp(logits - logits.max(1, keepdims=True))
    expected /= expected.sum(1, keepdims=True)
    got = np.stack([p.probabilities for p in preds])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    assert [p.label_index for p in preds] == expected.argmax(1).tolist()
    assert [p.label for p in preds] == [predictor.label_names[k] for k in expected.argmax(1)]
    assert [p.token_count for p in preds] == [len(r) for r in ids]
    assert any(p.truncated for p in preds) and not all(p.truncated for p in preds)
    np.testing.assert_allclose(got.sum(1), 1.0, atol=1e-6)


def test_a_row_alone_equals_the_same_row_in_a_padded_batch(predictor: Predictor, data_dir: Path) -> None:
    """What makes batching invisible to callers: padding other rows never changes a row's answer."""
    texts = ["Court.", *reviews(data_dir, 6)]
    together = predictor.predict(texts)
    for text, p in zip(texts, together, strict=True):
        (alone,) = predictor.predict([text])
        np.testing.assert_allclose(alone.probabilities, p.probabilities, rtol=0, atol=1e-5)
        assert alone.label == p.label


def test_runs_count_onnxruntime_runs(predictor: Predictor) -> None:
    before = predictor.runs
    predictor.predict(["un", "deux", "trois"])
    predictor.predict(["quatre"])
    assert predictor.runs == before + 2


def test_softmax_is_stable_on_extreme_logits() -> None:
    p = softmax(np.array([[1000.0, 0.0], [-1000.0, -1001.0], [3e38, -3e38]], dtype=np.float32))
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-6)
    np.testing.assert_allclose(p[1], [1 / (1 + np.exp(-1)), 1 - 1 / (1 + np.exp(-1))], atol=1e-6)


AUTO = """
import sys
from serving.model.predictor import Predictor
print(Predictor(sys.argv[1], device="auto", intra_op_threads=1).provider)
"""


def test_auto_asks_for_cuda_only_on_a_machine_with_a_gpu(tiny_bundle: Path) -> None:
    """onnxruntime-gpu lists CUDA on every machine; asked for it without a GPU, it prints "Failed to create
    CUDAExecutionProvider" and falls back. 'auto' must not ask there, and must get CUDA where a GPU is."""
    gpu = Path("/dev/nvidiactl").exists()  # the NVIDIA driver's control device: a fact about the machine
    run = subprocess.run([sys.executable, "-c", AUTO, str(tiny_bundle)], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [CUDA if gpu else CPU]
    if not gpu:
        assert "CUDAExecutionProvider" not in run.stderr, run.stderr[-2000:]


def test_cuda_asked_where_it_cannot_run_is_an_error_not_a_silent_cpu(tiny_bundle: Path) -> None:
    if cuda_driver_present():
        pytest.skip("CUDA runs here")
    with pytest.raises(ServerConfigError, match="device='cuda' but onnxruntime runs on CPUExecutionProvider"):
        Predictor(tiny_bundle, device="cuda")


def _unresolved_cuda_libraries(env: dict[str, str] | None = None) -> list[str]:
    """The CUDA provider library's dependencies that the loader cannot find here, by `ldd` (in its order: the one
    the loader stops at first is first)."""
    if shutil.which("ldd") is None:
        pytest.skip("no ldd")
    provider = Path(ort.__file__).parent / "capi" / CUDA_PROVIDER_LIBRARY
    if not provider.is_file():
        pytest.skip(f"{ort.__version__} is a CPU build: no {CUDA_PROVIDER_LIBRARY}")
    out = subprocess.run(["ldd", str(provider)], capture_output=True, text=True, timeout=60, env=env)
    return re.findall(r"^\s*(\S+) => not found", out.stdout, re.M)


def _named_library(message: str) -> str:
    found = re.findall(r"(lib[\w+-]+\.so\.\d+): cannot open shared object file", message)
    assert found, f"no library named in: {message}"
    return found[0]


def test_cuda_refusal_names_the_library_that_is_missing(tiny_bundle: Path) -> None:
    """`--device cuda` on a machine without the CUDA libraries: the one-line error says which one the loader lacks
    (here, without a GPU: libcublasLt.so.13 or whichever ldd also cannot find), not just "see the log"."""
    missing = _unresolved_cuda_libraries()
    if not missing:
        pytest.skip("every library of the CUDA provider resolves here")
    with pytest.raises(ServerConfigError) as error:
        Predictor(tiny_bundle, device="cuda")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("device='cuda' but onnxruntime runs on CPUExecutionProvider: ")
    if missing == [DRIVER_LIBRARY]:
        assert "NVIDIA driver" in message
    else:
        assert _named_library(message) in missing
        assert "onnxruntime-gpu[cuda,cudnn]" in message  # the fix, with the version that has this CUDA major


def test_server_refusing_cuda_exits_2_with_the_missing_library(tiny_bundle: Path) -> None:
    missing = _unresolved_cuda_libraries()
    if not missing or missing == [DRIVER_LIBRARY]:
        pytest.skip("the CUDA libraries resolve here")
    run = subprocess.run([sys.executable, "-m", "serving.server", str(tiny_bundle), "--device", "cuda", "--port", "0",
                          "--no-metrics"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 2, run.stderr[-2000:]
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("sentiment-server: error:")]
    assert _named_library(line) in missing, line


def test_auto_on_a_driver_without_the_cuda_libraries_warns_naming_the_missing_one(tiny_bundle: Path,
                                                                                tmp_path: Path) -> None:
    """'auto' asks for CUDA where the driver library loads. Given one (a stand-in libcuda.so.1: this machine has no
    GPU) but not the CUDA libraries, onnxruntime falls back to the CPU: the server serves the CPU graph and its
    warning names the library that is missing."""
    if Path("/dev/nvidiactl").exists():
        pytest.skip("a real NVIDIA driver here")
    if shutil.which("cc") is None:
        pytest.skip("no C compiler for the stand-in driver library")
    (tmp_path / "empty.c").write_text("int ts_stand_in_driver;\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / DRIVER_LIBRARY), str(tmp_path / "empty.c"),
                    f"-Wl,-soname,{DRIVER_LIBRARY}"], check=True, timeout=60)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    missing = _unresolved_cuda_libraries(env)
    if not missing:
        pytest.skip("every library of the CUDA provider resolves here")
    run = subprocess.run([sys.executable, "-c", AUTO, str(tiny_bundle)], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [CPU]
    (warning,) = [x for x in run.stderr.splitlines() if "CUDA did not load" in x]
    assert _named_library(warning) in missing, warning


@pytest.mark.gpu
def test_cuda_provider_gives_the_cpu_answers(predictor: Predictor, tiny_bundle: Path) -> None:
    if not cuda_driver_present():
        pytest.skip(NO_ORT_CUDA)
    gpu = Predictor(tiny_bundle, device="cuda")
    assert gpu.provider == CUDA
    texts = ["Un chef-d'oeuvre.", "Ennuyeux et trop long."]
    np.testing.assert_allclose(np.stack([p.probabilities for p in gpu.predict(texts)]),
                               np.stack([p.probabilities for p in predictor.predict(texts)]), atol=1e-4)


def test_graph_optimization_follows_the_manifest_unless_set(predictor: Predictor, tiny_bundle: Path) -> None:
    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    assert predictor.optimization == manifest.get("runtime", {}).get("graph_optimization_level", "basic")
    assert Predictor(tiny_bundle, device="cpu", optimization="disable").optimization == "disable"


# ---------------------------------------------------------------------------------------------- bad bundles


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_manifest(change: Callable[[dict], None]) -> Callable[[Path], None]:
    """An edit with the checksums and the manifest's digest made to match: the check under test must catch it."""
    return lambda bundle: edit_manifest(bundle, change)


BAD_BUNDLES: dict[str, tuple[Callable[[Path], None], str]] = {
    "no folder": (lambda b: shutil.rmtree(b), "bundle folder not found"),
    "no manifest": (lambda b: (b / "manifest.json").unlink(), "manifest.json"),
    "manifest not JSON": (lambda b: (b / "manifest.json").write_text("{oops"), "manifest.json: not valid JSON"),
    "corrupt model": (lambda b: _flip_byte(b / "model.onnx"), "model.onnx: checksum mismatch"),
    "tampered vocab": (lambda b: (b / "tokenizer" / "vocab.txt").write_text("▁evil\n", encoding="utf-8"),
                       "vocab.txt: checksum mismatch"),
    "missing spm model": (lambda b: (b / "tokenizer" / "spm.model").unlink(), "spm.model"),
    "unlisted model": (_edit_manifest(lambda m: m["files"].pop("model.onnx")), "lacks 'model.onnx'"),
    "path escapes": (_edit_manifest(lambda m: m["files"].update({"../x": "0" * 64})), "inside the bundle"),
    "wrong task": (_edit_manifest(lambda m: m.update(task="translation")), "'task'"),
    "labels vs logits": (_edit_manifest(lambda m: m.update(label_names=["a", "b", "c"], label_values=["0", "1", "2"])),
                         "logits has 2 classes but manifest.json lists 3 labels"),
}


@pytest.mark.parametrize("case", sorted(BAD_BUNDLES))
def test_bad_bundles_are_refused_naming_the_file(tiny_bundle: Path, tmp_path: Path, case: str) -> None:
    bundle = shutil.copytree(tiny_bundle, tmp_path / "bundle")
    damage, message = BAD_BUNDLES[case]
    damage(bundle)
    with pytest.raises(BundleError, match=message.replace("(", r"\(")) as info:
        Predictor(bundle, device="cpu")
    assert str(bundle) in str(info.value)
