"""Runs inside .venv-triton (unmodified `tritonclient[grpc]`, protobuf < 7), never imports the project.

    .venv-triton/bin/python tests/triton_client_check.py infer HOST:PORT MODEL [TOKEN] < texts.json
        -> JSON: health, metadata, the answers, and the errors of a few bad calls
    .venv-triton/bin/python tests/triton_client_check.py descriptors
        -> JSON: tritonclient's own descriptors of the KServe v2 messages (field numbers, types, labels)
Driven by tests/test_serving_triton.py.
"""

from __future__ import annotations

import json
import sys


def infer(url: str, model: str, token: str | None) -> dict:
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    texts = json.load(sys.stdin)
    headers = {"authorization": f"Bearer {token}"} if token else None
    client = grpcclient.InferenceServerClient(url)
    out = {
        "live": client.is_server_live(headers=headers),
        "ready": client.is_server_ready(headers=headers),
        "model_ready": client.is_model_ready(model, headers=headers),
        "server": client.get_server_metadata(headers=headers, as_json=True),
        "model": client.get_model_metadata(model, headers=headers, as_json=True),
    }
    tensor = grpcclient.InferInput("TEXT", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode("utf-8") for t in texts], dtype=np.object_))
    result = client.infer(model, [tensor], headers=headers, request_id="triton-1", client_timeout=30)
    out["id"] = result.get_response().id
    out["probabilities"] = result.as_numpy("probabilities").tolist()
    out["label"] = [b.decode("utf-8") for b in result.as_numpy("label")]
    out["token_count"] = result.as_numpy("token_count").tolist()
    out["truncated"] = result.as_numpy("truncated").tolist()
    picked = client.infer(model, [tensor], outputs=[grpcclient.InferRequestedOutput("label")], headers=headers)
    out["only_label"] = [o.name for o in picked.get_response().outputs]

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
    if sys.argv[1] == "infer":
        print(json.dumps(infer(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)))
    else:
        print(json.dumps(descriptors(json.loads(sys.stdin.read()))))
