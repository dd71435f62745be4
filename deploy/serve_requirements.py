"""Print the server's requirements, one per line: pyproject.toml's dependencies and its `serve` extra, with
onnxruntime's package chosen explicitly. Used by the Containerfile's build stage (stdlib only, Python >= 3.11).

    python3 deploy/serve_requirements.py [onnxruntime | onnxruntime-gpu] [--pyproject FILE]

pyproject.toml picks onnxruntime or onnxruntime-gpu by platform marker; an image decides by build argument
(ORT_PACKAGE) instead, so the marker is dropped here. onnxruntime-gpu comes as the `gpu` extra asks for it: with its
`cuda` and `cudnn` extras, the CUDA and cuDNN libraries it is built for. Versions come from requirements.lock
(`pip -c`).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ORT_PACKAGES = ("onnxruntime", "onnxruntime-gpu")


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[@]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _without_marker(requirement: str) -> str:
    return requirement.split(";")[0].rstrip()


def serve_requirements(pyproject: Path, ort_package: str) -> list[str]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    gpu = [_without_marker(r) for r in extras.get("gpu", []) if _name(r) == "onnxruntime-gpu"]
    out: list[str] = []
    for req in [*project["dependencies"], *extras["serve"]]:
        if _name(req) in ORT_PACKAGES:
            line = f"{ort_package}{_without_marker(req)[len(_name(req)):]}"
            if ort_package == "onnxruntime-gpu" and gpu:
                line = gpu[0]  # with the CUDA and cuDNN libraries it needs
            if line not in out:  # the CPU and the GPU package, one marker each: one line
                out.append(line)
        else:
            out.append(req)
    if not any(_name(r) == ort_package for r in out):
        raise SystemExit(f"{pyproject}: no onnxruntime requirement in dependencies or the serve extra")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ort_package", nargs="?", default="onnxruntime", choices=ORT_PACKAGES,
                   help="the onnxruntime package to require (default: onnxruntime)")
    p.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"), help="the project file to read")
    args = p.parse_args(argv)
    print("\n".join(serve_requirements(args.pyproject, args.ort_package)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
