"""The training image's two build steps (Containerfile.train); stdlib only, Python >= 3.11.

    python3 deploy/train_image.py requirements [onnxruntime | onnxruntime-gpu] [--pyproject FILE]
    /opt/venv/bin/python deploy/train_image.py check-torch TORCH_INDEX

`requirements` prints what the image installs after torch, one per line: pyproject.toml's dependencies and its
`train` extra, without torch (installed first, from TORCH_INDEX) and with onnxruntime's package chosen explicitly
(pyproject.toml picks it by platform marker; export validates its graphs on the CPU, so the CPU package is the
default for both variants). Versions come from requirements.lock (`pip -c`).

`check-torch` fails the build when the torch just installed is not the variant asked for: a CPU index
(`.../whl/cpu`) that gave a CUDA build, or a CUDA build whose major differs from the base image's `nvcc` (DeepSpeed
compiles its fused ops with that nvcc and refuses a torch built for another CUDA major), or a CUDA build on a base
without nvcc.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ORT_PACKAGES = ("onnxruntime", "onnxruntime-gpu")


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[@]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def train_requirements(pyproject: Path, ort_package: str) -> list[str]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    out: list[str] = []
    for req in [*project["dependencies"], *project["optional-dependencies"]["train"]]:
        name = _name(req)
        if name == "torch":
            continue
        line = f"{ort_package}{req[len(name):].split(';')[0].rstrip()}" if name in ORT_PACKAGES else req
        if line not in out:  # the CPU and the GPU package, one marker each: one line
            out.append(line)
    return out


def nvcc_major() -> int | None:
    """The CUDA major of the base image's nvcc (PATH, then /usr/local/cuda/bin), None without one."""
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        return None
    found = re.search(r"release (\d+)\.", subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout)
    return int(found.group(1)) if found else None


def torch_problem(torch_cuda: str | None, torch_index: str, nvcc: int | None) -> str:
    """Why this torch does not fit the variant ('' when it does)."""
    if torch_index.rstrip("/").endswith("/cpu"):
        return f"TORCH_INDEX={torch_index} asks for the CPU build, got a CUDA {torch_cuda} build" if torch_cuda else ""
    if torch_cuda is None:
        return ""  # a CPU build from a CUDA index: only on platforms without CUDA wheels; it trains on the CPU
    if nvcc is None:
        return (f"torch is a CUDA {torch_cuda} build but the base image has no nvcc, which DeepSpeed needs for its "
                f"fused ops: use a CUDA {torch_cuda.split('.')[0]}.x devel base (BASE_IMAGE)")
    if int(torch_cuda.split(".")[0]) != nvcc:
        return (f"torch is a CUDA {torch_cuda} build but the base image's nvcc is CUDA {nvcc}: pick a base of CUDA "
                f"{torch_cuda.split('.')[0]}.x, or a TORCH_INDEX of CUDA {nvcc}")
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("requirements", help="print the image's requirements after torch")
    r.add_argument("ort_package", nargs="?", default="onnxruntime", choices=ORT_PACKAGES,
                   help="the onnxruntime package to install (default: onnxruntime, the CPU one)")
    r.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"),
                   help="the pyproject.toml to read (default: ./pyproject.toml)")
    c = sub.add_parser("check-torch", help="fail when the installed torch is not the variant asked for")
    c.add_argument("torch_index", help="the TORCH_INDEX build argument (empty: PyPI's own build)")
    args = p.parse_args(argv)
    if args.command == "requirements":
        print("\n".join(train_requirements(args.pyproject, args.ort_package)))
        return 0
    import torch

    problem = torch_problem(torch.version.cuda, args.torch_index, nvcc_major())
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}: " + (f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
