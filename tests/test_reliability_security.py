"""Security of the serving stack and the load paths (issue 7, item 4), on the real server on 127.0.0.1.

  - TLS and mutual TLS with certificates generated here (the `cryptography` package: a CA, a server certificate
    for 127.0.0.1/localhost, a client certificate, a rogue CA's client certificate, an expired client
    certificate), through both protocols; a plain-text client is refused by a TLS server, a client without an
    accepted certificate by a mutual-TLS server, and neither gets anything computed;
  - bearer token: missing or wrong -> UNAUTHENTICATED on every model RPC of both protocols, nothing computed
    (the predictor's onnxruntime run counter does not move);
  - no pickle on any load path: no module of trainer/ or serving/ imports pickle or calls torch.load without
    weights_only=True (checked on the syntax tree, with the one DeepSpeed resume path named as an exception);
    artifacts, tokenizers, configs and bundles load with pickle disabled in the process; a pickle planted where
    a user file goes is refused and never executed;
  - a bundle whose file does not match its manifest checksum is refused, for every file.
"""

from __future__ import annotations

import ast
import datetime as dt
import ipaddress
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from serving_fixtures import REPO_ROOT, reviews, running_server, target

from serving.errors import BundleError
from serving.gen.inference import grpc_service_pb2 as kpb
from serving.gen.inference import grpc_service_pb2_grpc as kpb_grpc
from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.kserve import decode_bytes, encode_bytes
from serving.predictor import Predictor
from serving.server import SentimentServer

TOKEN = "reliability-token-0123456789abcdef"

# ------------------------------------------------------------------------------------- certificates


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
          *, ca: bool = False, server: bool = False, expired: bool = False) -> x509.Certificate:
    """A certificate for `key`, signed by issuer (None: self-signed). EC P-256: fast to generate."""
    now = dt.datetime.now(dt.timezone.utc)
    start, end = (now - dt.timedelta(days=10), now - dt.timedelta(days=1)) if expired else \
        (now - dt.timedelta(minutes=5), now + dt.timedelta(days=1))
    issuer_name, issuer_key = (subject, key) if issuer is None else issuer
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer_name))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(start).not_valid_after(end)
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                          crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
    elif server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEM files: ca, server (+key), client (+key), rogue_client (+key, another CA), expired_client (+key)."""
    folder = tmp_path_factory.mktemp("certs")
    keys = {n: ec.generate_private_key(ec.SECP256R1()) for n in
            ("ca", "rogue_ca", "server", "client", "rogue_client", "expired_client")}
    made = {
        "ca": _cert("test-ca", keys["ca"], None, ca=True),
        "rogue_ca": _cert("rogue-ca", keys["rogue_ca"], None, ca=True),
        "server": _cert("localhost", keys["server"], ("test-ca", keys["ca"]), server=True),
        "client": _cert("client", keys["client"], ("test-ca", keys["ca"])),
        "rogue_client": _cert("rogue-client", keys["rogue_client"], ("rogue-ca", keys["rogue_ca"])),
        "expired_client": _cert("expired-client", keys["expired_client"], ("test-ca", keys["ca"]), expired=True),
    }
    out = {}
    for name, cert in made.items():
        out[name] = folder / f"{name}.pem"
        out[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{name}_key"] = folder / f"{name}.key"
        out[f"{name}_key"].write_bytes(keys[name].private_bytes(serialization.Encoding.PEM,
                                                                serialization.PrivateFormat.PKCS8,
                                                                serialization.NoEncryption()))
    return out


def _secure(server: SentimentServer, certs: dict[str, Path], client: str | None = None,
            ca: str = "ca") -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=certs[ca].read_bytes(),
        private_key=certs[f"{client}_key"].read_bytes() if client else None,
        certificate_chain=certs[client].read_bytes() if client else None,
    )
    return grpc.secure_channel(target(server), creds)


def _infer_request(texts: list[str]) -> kpb.ModelInferRequest:
    req = kpb.ModelInferRequest(model_name="sentiment")
    req.inputs.add(name="TEXT", datatype="BYTES", shape=[len(texts)])
    req.raw_input_contents.append(encode_bytes([t.encode() for t in texts]))
    return req


def _both_protocols_answer(channel: grpc.Channel, reference: Predictor, texts: list[str],
                           metadata: list[tuple[str, str]] | None = None) -> None:
    """Classify and ModelInfer over `channel` both equal the in-process predictor."""
    want = np.stack([p.probabilities for p in reference.predict(texts)])
    got = pb_grpc.SentimentServiceStub(channel).Classify(pb.ClassifyRequest(texts=texts), timeout=10,
                                                          metadata=metadata)
    np.testing.assert_allclose([list(r.probabilities) for r in got.results], want, atol=1e-5)
    response = kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(_infer_request(texts), timeout=10,
                                                                     metadata=metadata)
    probs = dict(zip([o.name for o in response.outputs], response.raw_output_contents, strict=True))
    np.testing.assert_allclose(np.frombuffer(probs["probabilities"], "<f4").reshape(len(texts), -1), want, atol=1e-5)
    assert decode_bytes(probs["label"], len(texts)) == [p.label.encode() for p in reference.predict(texts)]


def _refused(channel: grpc.Channel, code: grpc.StatusCode, metadata: list[tuple[str, str]] | None = None) -> None:
    """Every model RPC of both protocols is refused with `code`."""
    s, k = pb_grpc.SentimentServiceStub(channel), kpb_grpc.GRPCInferenceServiceStub(channel)
    calls = [
        lambda: s.Classify(pb.ClassifyRequest(texts=["refusé"]), timeout=5, metadata=metadata),
        lambda: s.GetModelMetadata(pb.GetModelMetadataRequest(), timeout=5, metadata=metadata),
        lambda: k.ModelInfer(_infer_request(["refusé"]), timeout=5, metadata=metadata),
        lambda: k.ModelMetadata(kpb.ModelMetadataRequest(name="sentiment"), timeout=5, metadata=metadata),
        lambda: k.ServerReady(kpb.ServerReadyRequest(), timeout=5, metadata=metadata),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == code, info.value.details()


# ------------------------------------------------------------------------------------- TLS, mutual TLS


def test_tls_serves_both_protocols_and_refuses_plain_text(tiny_bundle: Path, certs: dict[str, Path],
                                                          reference: Predictor, data_dir: Path) -> None:
    texts = reviews(data_dir, 3) + ["Chiffré de bout en bout."]
    with running_server(tiny_bundle, device="cpu", tls_cert=str(certs["server"]),
                        tls_key=str(certs["server_key"])) as s:
        runs = s.predictor.runs
        with grpc.insecure_channel(target(s)) as plain:
            _refused(plain, grpc.StatusCode.UNAVAILABLE)
        with _secure(s, certs, ca="rogue_ca") as wrong_trust:  # the client must not trust an unknown server
            _refused(wrong_trust, grpc.StatusCode.UNAVAILABLE)
        assert s.predictor.runs == runs
        with _secure(s, certs) as channel:
            _both_protocols_answer(channel, reference, texts)


def test_mutual_tls_needs_a_client_certificate_from_the_trusted_ca(tiny_bundle: Path, certs: dict[str, Path],
                                                                    reference: Predictor) -> None:
    with running_server(tiny_bundle, device="cpu", tls_cert=str(certs["server"]), tls_key=str(certs["server_key"]),
                        tls_client_ca=str(certs["ca"])) as s:
        runs = s.predictor.runs
        for client in (None, "rogue_client", "expired_client"):
            with _secure(s, certs, client) as channel:
                _refused(channel, grpc.StatusCode.UNAVAILABLE)
        with grpc.insecure_channel(target(s)) as plain:
            _refused(plain, grpc.StatusCode.UNAVAILABLE)
        assert s.predictor.runs == runs
        with _secure(s, certs, "client") as channel:
            _both_protocols_answer(channel, reference, ["Mutuellement authentifié.", "Bof."])
        assert s.predictor.runs > runs


# ------------------------------------------------------------------------------------- bearer token


def test_token_missing_or_wrong_is_unauthenticated_and_nothing_is_computed(tiny_bundle: Path, certs: dict[str, Path],
                                                                           reference: Predictor) -> None:
    """Over TLS (a token in plain text would be readable on the wire): every wrong form is refused before any
    work; the onnxruntime run counter and the texts metric do not move; the right token is served."""
    with running_server(tiny_bundle, device="cpu", auth_token=TOKEN, tls_cert=str(certs["server"]),
                        tls_key=str(certs["server_key"])) as s, _secure(s, certs) as channel:
        runs, texts = s.predictor.runs, s.metrics.registry.get_sample_value("sentiment_texts_total")
        wrong = [None, [("authorization", "")], [("authorization", "Bearer")], [("authorization", "Bearer ")],
                 [("authorization", TOKEN)], [("authorization", f"bearer {TOKEN}")],
                 [("authorization", f"Bearer {TOKEN[:-1]}")], [("authorization", f"Bearer {TOKEN}x")],
                 [("authorization", f"Bearer  {TOKEN}")], [("authorization", f"Basic {TOKEN}")],
                 [("x-api-key", TOKEN)], [("authorization", f"Bearer {TOKEN.upper()}")]]
        for metadata in wrong:
            _refused(channel, grpc.StatusCode.UNAUTHENTICATED, metadata)
        assert s.predictor.runs == runs
        assert s.metrics.registry.get_sample_value("sentiment_texts_total") == texts
        refusals = s.metrics.registry.get_sample_value(
            "sentiment_requests_total", {"method": "sentiment.v1.SentimentService/Classify", "code": "UNAUTHENTICATED"})
        assert refusals == len(wrong)
        _both_protocols_answer(channel, reference, ["Avec le bon jeton."], [("authorization", f"Bearer {TOKEN}")])
        assert s.predictor.runs > runs


# ------------------------------------------------------------------------------------- no pickle

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve", "joblib", "marshal"}
# Calls that unpickle whatever the file holds (qualified names after resolving imports).
UNPICKLING_CALLS = {"pandas.read_pickle", "torch.jit.load", "numpy.lib.format.read_array"}
# DeepSpeed's engine checkpoints are pickles by DeepSpeed's design (torch.load(weights_only=False) inside
# DeepSpeed). They are read only to resume a run from a checkpoint folder the run itself wrote, after its sha256
# marker is verified (trainer/checkpoint.py). Fine-tuning, export and serving read model artifacts (safetensors)
# and bundles instead. These are the only places allowed to call them: (file, calling function).
DEEPSPEED_PICKLE_CALLS = {"load_checkpoint", "get_fp32_state_dict_from_zero_checkpoint",
                          "convert_zero_checkpoint_to_state_dict", "load_state_dict_from_zero_checkpoint"}
ALLOWED_DEEPSPEED = {("trainer/checkpoint.py", "load"), ("trainer/engine.py", "fp32_state_dict")}


def pickle_uses(source: str, filename: str) -> list[str]:
    """Every pickle load path in one module's source: imports of pickle-like modules, torch.load without
    weights_only=True, numpy.load with allow_pickle other than False, unpickling calls, DeepSpeed checkpoint
    loads outside ALLOWED_DEEPSPEED. Each as 'file:line: what'."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}  # local name -> qualified name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name.split(".")[0] in PICKLE_MODULES:
                    found.append(f"{filename}:{node.lineno}: imports {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            if node.module.split(".")[0] in PICKLE_MODULES:
                found.append(f"{filename}:{node.lineno}: imports from {node.module}")

    def qualified(func: ast.expr) -> str:
        parts = []
        while isinstance(func, ast.Attribute):
            parts.append(func.attr)
            func = func.value
        if isinstance(func, ast.Name):
            parts.append(aliases.get(func.id, func.id))
        return ".".join(reversed(parts))

    def keyword(call: ast.Call, name: str) -> object:
        for k in call.keywords:
            if k.arg == name:
                return k.value.value if isinstance(k.value, ast.Constant) else "<not a constant>"
        return None

    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = qualified(node.func)
        where = f"{filename}:{node.lineno}"
        if name in ("torch.load", "torch.serialization.load") and keyword(node, "weights_only") is not True:
            found.append(f"{where}: {name} without weights_only=True")
        elif name in ("numpy.load", "np.load") and keyword(node, "allow_pickle") not in (None, False):
            found.append(f"{where}: {name} with allow_pickle={keyword(node, 'allow_pickle')}")
        elif name in UNPICKLING_CALLS or name.split(".")[0] in PICKLE_MODULES:
            found.append(f"{where}: calls {name}")
        elif name.rsplit(".", 1)[-1] in DEEPSPEED_PICKLE_CALLS:
            inside = [f.name for f in functions if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)]
            if not any((filename, fn) in ALLOWED_DEEPSPEED for fn in inside):
                found.append(f"{where}: calls {name} (DeepSpeed checkpoints are pickles) in {inside or 'module'}")
    return found


def test_the_pickle_scanner_finds_what_it_must() -> None:
    bad = {
        "import pickle\npickle.loads(b'')": 2,
        "from pickle import loads": 1,
        "import torch\ntorch.load('w.pt')": 1,
        "import torch as t\nt.load('w.pt', weights_only=False)": 1,
        "from torch import load\nload('w.pt')": 1,
        "import numpy as np\nnp.load('a.npz', allow_pickle=True)": 1,
        "import joblib\njoblib.load('m.joblib')": 2,
        "import torch\ntorch.jit.load('m.pt')": 1,
        "def resume(engine):\n    engine.load_checkpoint('ckpt')": 1,
    }
    for source, count in bad.items():
        assert len(pickle_uses(source, "x.py")) == count, (source, pickle_uses(source, "x.py"))
    good = ["import torch\ntorch.load('w.pt', weights_only=True)", "import numpy as np\nnp.load('a.npz')",
            "import numpy as np\nnp.load('a.npz', allow_pickle=False)", "from safetensors.torch import load_file",
            "import json\njson.loads('{}')"]
    for source in good:
        assert pickle_uses(source, "x.py") == [], source
    assert pickle_uses("def load(engine):\n    engine.load_checkpoint('c')", "trainer/checkpoint.py") == []


def test_no_module_of_trainer_or_serving_unpickles() -> None:
    files = sorted(p for pkg in ("contract", "trainer", "serving") for p in (REPO_ROOT / pkg).rglob("*.py")
                   if "gen" not in p.relative_to(REPO_ROOT).parts)
    assert len(files) > 20
    found = [hit for p in files
             for hit in pickle_uses(p.read_text(encoding="utf-8"), p.relative_to(REPO_ROOT).as_posix())]
    assert found == []


NO_PICKLE_SCRIPT = r"""
import json, pickle, _pickle, sys
from pathlib import Path
import numpy as np, torch
from serving.predictor import Predictor
from trainer import artifact, config
from trainer.tokenizer import Tokenizer

class Refused(RuntimeError):
    pass

def refuse(*args, **kwargs):
    raise Refused("pickle is disabled in this process")

class RefusingUnpickler:
    def __init__(self, *args, **kwargs):
        refuse()

def audit(event, args):
    if event == "pickle.find_class":
        raise Refused(f"pickle.find_class{args}")

for module in (pickle, _pickle):
    module.load = module.loads = refuse
    module.Unpickler = RefusingUnpickler
sys.addaudithook(audit)
art_dir, bundle_dir, texts = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
# The guard works: each of these unpickles, and each is refused.
guarded = []
for attempt in (lambda: pickle.loads(pickle.dumps({"a": 1})), lambda: torch.load(sys.argv[4], weights_only=False)):
    try:
        attempt()
    except Refused:
        guarded.append(True)
art = artifact.load(art_dir)
model = art.model()
tok = Tokenizer.load(art_dir / "tokenizer")
cfg = config.load(art_dir / "config.json")
predictor = Predictor(bundle_dir, device="cpu", intra_op_threads=1)
preds = predictor.predict(texts)
ids = torch.tensor(np.array([tok.encode_batch([t])[0] for t in texts[:1]]))
with torch.no_grad():
    logits = model(ids, torch.zeros_like(ids, dtype=torch.bool))
print(json.dumps({"guarded": guarded, "parameters": sum(p.numel() for p in model.parameters()),
                  "model": cfg.model.d_model, "labels": [p.label for p in preds],
                  "torch_logits": logits.tolist()}))
"""


def test_artifacts_and_bundles_load_with_pickle_disabled(tiny_classifier_artifact: Path, tiny_bundle: Path,
                                                         tmp_path: Path, reference: Predictor) -> None:
    import torch

    weights = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, weights)
    texts = ["Un livre remarquable.", "Ennuyeux à mourir."]
    out = subprocess.run([sys.executable, "-c", NO_PICKLE_SCRIPT, str(tiny_classifier_artifact), str(tiny_bundle),
                          json.dumps(texts), str(weights)], capture_output=True, text=True, timeout=120,
                         cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().split("\n")[-1])
    assert result["guarded"] == [True, True]  # the guard really refuses pickles in that process
    assert result["labels"] == [p.label for p in reference.predict(texts)]
    assert result["parameters"] > 0 and result["model"] == 32


class _Planted:
    """Unpickling this creates the marker file: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


def test_a_planted_pickle_is_refused_and_never_executed(tiny_classifier_artifact: Path, tiny_bundle: Path,
                                                        tmp_path: Path) -> None:
    from contract.manifest import manifest_digest
    from trainer import artifact
    from trainer.corpus import Corpus
    from trainer.data import DataError

    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Planted(marker))
    # A model artifact whose weights file is a pickle (checksum updated to match: a deliberate swap).
    art = Path(shutil.copytree(tiny_classifier_artifact, tmp_path / "artifact"))
    (art / "model.safetensors").write_bytes(payload)
    with pytest.raises(artifact.ArtifactError, match="checksum"):
        artifact.load(art)
    meta = json.loads((art / "artifact.json").read_text())
    meta["weights_sha256"] = artifact.sha256_file(art / "model.safetensors")
    (art / "artifact.json").write_text(json.dumps(meta))
    with pytest.raises(artifact.ArtifactError, match="cannot read weights"):
        artifact.load(art)
    # A bundle whose model.onnx is a pickle, manifest updated to match.
    bundle = Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))
    (bundle / "model.onnx").write_bytes(payload)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"]["model.onnx"] = artifact.sha256_file(bundle / "model.onnx")
    manifest["bundle_sha256"] = manifest_digest(manifest)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"model\.onnx: not a readable ONNX model"):
        Predictor(bundle, device="cpu")
    # A saved corpus (.npz) holding a pickled object array.
    corpus = tmp_path / "corpus.npz"
    np.savez(corpus, tokens=np.array([_Planted(marker)], dtype=object), offsets=np.array([0, 1]),
             vocab_size=np.array(99), fingerprint=np.array("x"))
    with pytest.raises(DataError, match="not a saved corpus"):
        Corpus.load(corpus)
    assert not marker.exists()
    pickle.loads(payload)  # the control: unpickling it does create the marker
    assert marker.exists()


# ------------------------------------------------------------------------------------- checksums


@pytest.mark.parametrize("rel", ["model.onnx", "tokenizer/spm.model", "tokenizer/vocab.txt",
                                 "tokenizer/meta.json"])
@pytest.mark.parametrize("damage", ["flip a byte", "append a byte", "truncate"])
def test_a_bundle_file_not_matching_its_manifest_is_refused(tiny_bundle: Path, tmp_path: Path, rel: str,
                                                            damage: str) -> None:
    bundle = Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))
    path = bundle / rel
    data = bytearray(path.read_bytes())
    if damage == "flip a byte":
        data[len(data) // 2] ^= 0x01
    elif damage == "append a byte":
        data.append(0)
    else:
        data = data[: len(data) - 1]
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="checksum mismatch") as info:
        SentimentServer(bundle)
    assert str(path) in str(info.value)
