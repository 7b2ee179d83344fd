#!/usr/bin/env bash
# Makes VENV (default .venv-torch-2.11) a venv with torch 2.11.0 -- the GPU machines' release -- and the rest
# of paratrain's dependencies, for running the CPU suite under it (make test-torch-2.11).
#
# PyPI's torch 2.11.0 for Linux x86_64 is a CUDA 13 build. With its dependencies it brings ~4 GB of CUDA
# libraries and triton; without them `import torch` fails, as libtorch links against cuDNN, cuBLAS, NCCL
# and a few more. So the wheel goes in without its dependencies, followed by its pure-Python ones and only
# the ten CUDA libraries libtorch's shared objects link against (2.2 GB installed, about a minute); triton,
# cuSOLVER, NVRTC, CUPTI and the CUDA toolkit meta-package stay out, as nothing loads them on a CPU. pip
# then warns that torch's other requirements are missing: expected.
set -euo pipefail
venv=${1:-.venv-torch-2.11}
cd "$(dirname "$0")/.."
test -x "$venv/bin/python" || "${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/pip" install -q)
"${pip[@]}" --upgrade pip
"${pip[@]}" --no-deps torch==2.11.0 \
    nvidia-cublas==13.1.0.3 nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35 \
    nvidia-cusparse==12.6.3.3 nvidia-nvjitlink==13.0.88 nvidia-cudnn-cu13==9.19.0.56 \
    nvidia-cusparselt-cu13==0.8.0 nvidia-nccl-cu13==2.28.9 nvidia-nvshmem-cu13==3.4.5
"${pip[@]}" filelock 'typing-extensions>=4.10.0' 'setuptools<82' 'sympy>=1.13.3' 'networkx>=2.5.1' jinja2 \
    'fsspec>=0.8.5'
# paratrain's own requirements but torch, from pyproject.toml
"$venv/bin/python" - > "$venv/requirements.txt" <<'EOF'
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
    if re.match(r"[\w.-]+", requirement).group() != "torch":
        print(requirement)
EOF
"${pip[@]}" -r "$venv/requirements.txt"
"${pip[@]}" --no-deps -e .
"$venv/bin/python" -c 'import torch; assert torch.__version__.startswith("2.11.0"), torch.__version__
print(f"torch {torch.__version__} imports and computes on the CPU: {(torch.ones(2) @ torch.ones(2)).item()}")'
bash tools/install_tcmalloc.sh "$venv"
