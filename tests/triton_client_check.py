"""Runs inside .venv-triton (unmodified `tritonclient[grpc,http]`, protobuf < 7), never imports the project.

    .venv-triton/bin/python tests/triton_client_check.py infer HOST:PORT MODEL [TOKEN] < texts.json
    .venv-triton/bin/python tests/triton_client_check.py infer-http HOST:PORT MODEL [TOKEN] < texts.json
        -> JSON: health, metadata, the answers, and the errors of a few bad calls (gRPC, or HTTP with
           tritonclient.http: binary tensors by default, JSON ones when asked, Triton's timeout parameter)
    .venv-triton/bin/python tests/triton_client_check.py descriptors
        -> JSON: tritonclient's own descriptors of the KServe v2 messages (field numbers, types, labels)
Driven by tests/test_serving_triton.py.
"""

from __future__ import annotations

import json
import sys


def infer(url: str, model: str, token: str | None, http: bool = False) -> dict:
    import numpy as np
    import tritonclient.grpc as grpc_client
    import tritonclient.http as http_client
    from tritonclient.utils import InferenceServerException

    grpcclient = http_client if http else grpc_client  # the same calls, one protocol or the other

    texts = json.load(sys.stdin)
    headers = {"authorization": f"Bearer {token}"} if token else None
    client = grpcclient.InferenceServerClient(url)
    out = {
        "live": client.is_server_live(headers=headers),
        "ready": client.is_server_ready(headers=headers),
        "model_ready": client.is_model_ready(model, headers=headers),
        # tritonclient.http answers with JSON already (it has no as_json)
        "server": client.get_server_metadata(headers=headers, **({} if http else {"as_json": True})),
        "model": client.get_model_metadata(model, headers=headers, **({} if http else {"as_json": True})),
    }
    tensor = grpcclient.InferInput("TEXT", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode("utf-8") for t in texts], dtype=np.object_))
    timing = {"timeout": 30_000_000} if http else {"client_timeout": 30}
    result = client.infer(model, [tensor], headers=headers, request_id="triton-1", **timing)
    response = result.get_response()
    out["id"] = response["id"] if http else response.id
    out["probabilities"] = result.as_numpy("probabilities").tolist()
    out["label"] = [b.decode("utf-8") for b in result.as_numpy("label")]
    out["token_count"] = result.as_numpy("token_count").tolist()
    out["truncated"] = result.as_numpy("truncated").tolist()
    picked = client.infer(model, [tensor], outputs=[grpcclient.InferRequestedOutput("label")], headers=headers)
    outputs = picked.get_response()["outputs"] if http else picked.get_response().outputs
    out["only_label"] = [o["name"] if http else o.name for o in outputs]
    if http:  # outputs as JSON (binary_data=False) and inputs as JSON: the same answers
        as_json = http_client.InferInput("TEXT", [len(texts)], "BYTES")
        as_json.set_data_from_numpy(np.array([t.encode("utf-8") for t in texts], dtype=np.object_), binary_data=False)
        wanted = [http_client.InferRequestedOutput(n, binary_data=False) for n in ("probabilities", "label")]
        # a new dict: tritonclient.http adds Inference-Header-Content-Length to the one it is given, and the calls
        # above left theirs in `headers`
        fresh = {"authorization": f"Bearer {token}"} if token else None
        plain = client.infer(model, [as_json], outputs=wanted, headers=fresh)
        out["json_probabilities"] = plain.as_numpy("probabilities").tolist()
        out["json_label"] = [b.decode("utf-8") if isinstance(b, bytes) else b for b in plain.as_numpy("label")]

    errors = {}
    bad_utf8 = grpcclient.InferInput("TEXT", [1], "BYTES")
    bad_utf8.set_data_from_numpy(np.array([b"caf\xc3"], dtype=np.object_))
    wrong_type = grpcclient.InferInput("TEXT", [1], "FP32")
    wrong_type.set_data_from_numpy(np.zeros([1], dtype=np.float32))
    for name, call in {
        "unknown model": lambda: client.infer("resnet", [tensor], headers=headers),
        "invalid utf-8": lambda: client.infer(model, [bad_utf8], headers=headers),
        "wrong datatype": lambda: client.infer(model, [wrong_type], headers=headers),
        "no token": lambda: client.infer(model, [tensor]),
    }.items():
        try:
            call()
            errors[name] = None
        except InferenceServerException as e:
            errors[name] = {"status": e.status(), "message": e.message()}
    out["errors"] = errors
    client.close()
    return out


def descriptors(names: list[str]) -> dict:
    from tritonclient.grpc import service_pb2

    def fields(d) -> dict:
        return {
            "fields": {f.name: [f.number, f.type, f.is_repeated, f.message_type.name if f.message_type else None,
                                f.containing_oneof.name if f.containing_oneof else None] for f in d.fields},
            "nested": {n.name: fields(n) for n in d.nested_types},
        }

    return {n: fields(service_pb2.DESCRIPTOR.message_types_by_name[n]) for n in names}


if __name__ == "__main__":
    if sys.argv[1] in ("infer", "infer-http"):
        print(json.dumps(infer(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None,
                               http=sys.argv[1] == "infer-http")))
    else:
        print(json.dumps(descriptors(json.loads(sys.stdin.read()))))
