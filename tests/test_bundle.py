"""Bundles that would start but are wrong, refused by the one verifier (contract/bundle.py) through both command
lines: the server's (`python -m serving.server`, a real process: a wrong program could hang or eat memory there, so
it runs under a timeout and an address-space limit) and `python -m trainer export --check`. Each refusal is exit 2
and one line naming the file and the reason. docs/RELIABILITY.md (Bundle attacks) lists them with what the code
did before.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from bundles import edit_manifest, reseal
from procs import REPO

from contract.bundle import check_session, verify_bundle
from contract.errors import BundleError
from contract.manifest import MODEL_FILE, manifest_digest
from contract.runtime import session_options
from serving.model.predictor import Predictor
from trainer.__main__ import main as trainer_cli

TEST_FILE = "cls-books-fr/test.review.txt"
SERVER_MEMORY = 4 << 30  # address space of the server process: far above its needs, far below the machine's


def outside_copy(bundle: Path, rel: str) -> Path:
    """A copy of a bundle file outside the bundle (same bytes, so its checksum still matches)."""
    target = bundle.parent / "outside" / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(bundle / rel, target)
    return target


def _symlink_out(bundle: Path) -> None:
    target = outside_copy(bundle, "tokenizer/vocab.txt")
    (bundle / "tokenizer/vocab.txt").unlink()
    (bundle / "tokenizer/vocab.txt").symlink_to(target)


def _folder_symlink_out(bundle: Path) -> None:
    shutil.copytree(bundle / "tokenizer", bundle.parent / "outside-tokenizer")
    shutil.rmtree(bundle / "tokenizer")
    (bundle / "tokenizer").symlink_to(bundle.parent / "outside-tokenizer")


def _entry_outside(bundle: Path) -> None:
    secret = bundle.parent / "secret.txt"
    secret.write_text("not yours\n")
    edit_manifest(bundle, lambda m: m["files"].update({"../secret.txt": "0" * 64}), sealed=True)


def _swapped_labels(bundle: Path) -> None:
    edit_manifest(bundle, lambda m: m.update(label_names=m["label_names"][::-1]), sealed=False)


def _vocabulary_beyond_the_embedding(bundle: Path) -> None:
    with open(bundle / "tokenizer/vocab.txt", "a", encoding="utf-8") as f:
        f.write("".join(f"extra{i}\n" for i in range(5)))
    meta = json.loads((bundle / "tokenizer/meta.json").read_text())
    (bundle / "tokenizer/meta.json").write_text(json.dumps({**meta, "vocab_size": meta["vocab_size"] + 5}))
    reseal(bundle)


def _graph_of_another_bundle(bundle: Path) -> None:
    model = onnx.load(str(bundle / "model.onnx"))
    for prop in model.metadata_props:
        if prop.key == "label_names":
            prop.value = json.dumps(json.loads(prop.value)[::-1], separators=(",", ":"))
    onnx.save(model, str(bundle / "model.onnx"))
    reseal(bundle, graphs=False)


def _second_max_len(bundle: Path) -> None:
    meta = json.loads((bundle / "tokenizer/meta.json").read_text())
    (bundle / "tokenizer/meta.json").write_text(json.dumps({**meta, "max_len": 32}))
    reseal(bundle)


def _format_1(bundle: Path) -> None:
    edit_manifest(bundle, lambda m: m.update(format=1), sealed=True)


def _max_len_beyond_positions(bundle: Path) -> None:
    edit_manifest(bundle, lambda m: m.update(max_len=65), sealed=True)  # tiny: 64 positions


def _fifo(bundle: Path) -> None:
    (bundle / "tokenizer/vocab.txt").unlink()
    os.mkfifo(bundle / "tokenizer/vocab.txt")


def _dev_zero(bundle: Path) -> None:
    (bundle / "model.onnx").unlink()
    (bundle / "model.onnx").symlink_to("/dev/zero")


def _device_node(bundle: Path) -> None:
    (bundle / "model.onnx").unlink()
    try:
        os.mknod(bundle / "model.onnx", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")


def _deep_manifest(bundle: Path) -> None:
    (bundle / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)


def _oversized_model(bundle: Path) -> None:
    os.truncate(bundle / "model.onnx", 3 << 30)  # sparse: 3 GiB on paper, nothing on disk


def _key_twice(bundle: Path) -> None:
    text = (bundle / "manifest.json").read_text().rstrip()
    assert text.endswith("}")
    (bundle / "manifest.json").write_text(text[:-1] + ',\n  "label_names": ["positive", "negative"]\n}\n')


# name -> (damage, the file the refusal names (bundle-relative), the reason: a regex)
ATTACKS: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "file symlinked out of the bundle": (_symlink_out, "tokenizer/vocab.txt", "a symbolic link, not a regular file"),
    "folder symlinked out of the bundle": (_folder_symlink_out, "tokenizer", "a symbolic link, not a folder"),
    "manifest entry pointing outside": (_entry_outside, "manifest.json",
                                        "files entry '../secret.txt' must be a relative path inside the bundle"),
    "labels swapped in manifest.json": (_swapped_labels, "manifest.json",
                                        "bundle_sha256 does not match the manifest's content"),
    "vocabulary beyond the embedding rows": (_vocabulary_beyond_the_embedding, "model.onnx",
                                             "token embedding has 99 rows but tokenizer/meta.json gives 104 ids"),
    "max_len beyond the positional table": (_max_len_beyond_positions, "manifest.json",
                                            "max_len 65 exceeds the 64 positions"),
    "FIFO listed in the manifest": (_fifo, "tokenizer/vocab.txt", "a FIFO, not a regular file"),
    "symlink to /dev/zero": (_dev_zero, "model.onnx", "a symbolic link, not a regular file"),
    "character device": (_device_node, "model.onnx", "a character device, not a regular file"),
    "100,000-deep manifest.json": (_deep_manifest, "manifest.json", "JSON nested deeper than 16 levels"),
    "3 GiB model.onnx": (_oversized_model, "model.onnx", "3 GiB, larger than the 2 GiB"),
    "a key twice in manifest.json": (_key_twice, "manifest.json", "key 'label_names' appears twice"),
    "a graph of another bundle": (_graph_of_another_bundle, "model.onnx",
                                  "its metadata_props differ from manifest.json on label_names"),
    "a second max_len in the tokenizer folder": (_second_max_len, "tokenizer/meta.json",
                                                 "max_len 32 in a bundle's tokenizer folder"),
    "a bundle of the earlier format": (_format_1, "manifest.json",
                                       "format 1, a bundle from an earlier exporter .*: export it again"),
}


@pytest.fixture
def bundle(tiny_bundle: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_bundle, tmp_path / "bundle", symlinks=True))


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attack_is_refused_by_both_command_lines_in_one_line(attack: str, bundle: Path, data_dir: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    damage, rel, reason = ATTACKS[attack]
    damage(bundle)
    named = str(bundle / rel)
    # The address-space limit set by util-linux's prlimit, not a preexec_fn: that forks this process, where gRPC may
    # run (other tests' in-process servers), and runs Python in the child, which gRPC's fork handlers can abort.
    server = subprocess.Popen(["prlimit", f"--as={SERVER_MEMORY}", "--", sys.executable, "-m", "serving.server",
                               str(bundle), "--port", "0", "--no-metrics"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = server.communicate(timeout=120)  # a FIFO read or an endless device would never return
    finally:
        server.kill()
        server.wait()
    assert server.returncode == 2, err[-3000:]
    assert "Traceback" not in err and "listening" not in out + err, err[-3000:]
    (line,) = [x for x in err.splitlines() if "error" in x.lower()]
    assert line.startswith(f"sentiment-server: error: {named}: ") and re.search(reason, line), line

    rc = trainer_cli(["export", "--check", str(bundle), "--data", str(data_dir / TEST_FILE), "--limit", "5"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {named}: ") and re.search(reason, err), err


def test_a_resealed_edit_changes_the_digest_the_server_reports(bundle: Path, predictor: Predictor,
                                                               tmp_path: Path) -> None:
    """The digest is integrity, not a signature: whoever may write the bundle can reseal an edit. Then it is
    another bundle_sha256, and GetModelMetadata (and the server's log) says so: pin the one `export` printed."""
    edit_manifest(bundle, lambda m: m.update(label_names=m["label_names"][::-1]), sealed=True)
    resealed = Predictor(bundle, device="cpu")
    assert resealed.label_names == predictor.label_names[::-1]
    assert resealed.bundle_sha256 != predictor.bundle_sha256
    manifest = json.loads((predictor.bundle_dir / "manifest.json").read_text())
    assert predictor.bundle_sha256 == manifest["bundle_sha256"] == manifest_digest(manifest)


def test_the_warm_up_runs_the_graph_at_max_len_with_the_highest_id(tiny_bundle: Path) -> None:
    """The static checks make the warm-up pass; were one of them missing, the warm-up still refuses the bundle
    before SERVING instead of every long request failing after it."""
    import onnxruntime as ort

    b = verify_bundle(tiny_bundle)
    session = ort.InferenceSession(b.graph_bytes(MODEL_FILE), session_options("basic"),
                                   providers=["CPUExecutionProvider"])
    check_session(session, b)
    too_long = dataclasses.replace(b, manifest=dataclasses.replace(b.manifest, max_len=65))
    with pytest.raises(BundleError, match=r"model\.onnx: onnxruntime failed the warm-up at max_len 65 with id 98"):
        check_session(session, too_long)
    bigger = dataclasses.replace(b.tokenizer, meta=dataclasses.replace(b.tokenizer.meta, vocab_size=100))
    with pytest.raises(BundleError, match=r"the warm-up at max_len 48 with id 99"):
        check_session(session, dataclasses.replace(b, tokenizer=bigger))


def test_a_manifest_without_its_digest_is_refused(bundle: Path) -> None:
    edit_manifest(bundle, lambda m: m.pop("bundle_sha256"), sealed=False)
    with pytest.raises(BundleError, match=r"manifest\.json: field 'bundle_sha256' must be the manifest's own sha256 "
                                          r".*export it again"):
        verify_bundle(bundle)
