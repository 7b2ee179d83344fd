#!/usr/bin/env bash
# Prints the python that runs the GPU targets (make gpu-test, make bench-gpu, tools/gpu_check.sh): $GPU_PYTHON
# when set, else the first of the machine's own python3 (the lent GPU machines': torch with CUDA preinstalled,
# no network for a venv) and this project's .venv/bin/python (make install) whose torch sees a GPU and is
# a release paratrain supports. Its other imports are checked too, with the wheels of wheels/ on the path
# (make gpu-wheels). Without such a python it says why and exits 1: for $GPU_PYTHON in one line, else one line
# per candidate and a last one.
set -u
cd "$(dirname "$0")/.."
wheels=$(ls wheels/*.whl 2>/dev/null | sed "s|^|:$PWD/|" | tr -d '\n')
candidates=(python3 .venv/bin/python)
[ -n "${GPU_PYTHON:-}" ] && candidates=("$GPU_PYTHON")
for python in "${candidates[@]}"; do
    if ! command -v "$python" >/dev/null 2>&1; then
        [ -n "${GPU_PYTHON:-}" ] && echo "gpu: GPU_PYTHON=$python: no such command" >&2
        continue
    fi
    why=$(PYTHONPATH="$PWD$wheels" "$python" - 2>&1 <<'EOF'
import importlib.util
import re
import sys

try:
    import torch
except ImportError:
    sys.exit("no torch")
version = torch.torch_version.__version__
if not (2, 11) <= version < (2, 14):
    sys.exit(f"torch {version}: paratrain runs on torch 2.11 to 2.13")
if not torch.cuda.is_available():
    build = f"CUDA {torch.version.cuda}, no GPU visible" if torch.version.cuda else "a CPU-only build"
    sys.exit(f"torch {version}: {build}")
import tomllib  # Python 3.11 on

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
# the GPU targets import the runtime dependencies and run pytest (the test extra's jsonschema is for a CPU test)
names = [re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0] for r in project["dependencies"]
         + ["pytest", "pytest-timeout"] if ";" not in r]  # those with a marker: older Pythons'
missing = [n for n in names if n != "torch" and importlib.util.find_spec(n.replace("-", "_")) is None]
if missing:
    sys.exit(f"torch {version} with CUDA, but missing {', '.join(missing)}: add their wheels to wheels/ "
             f"(make gpu-wheels on a machine with network)")
EOF
)
    if [ -z "$why" ]; then
        command -v "$python"
        exit 0
    fi
    echo "gpu: $python: $why" >&2
done
[ -n "${GPU_PYTHON:-}" ] && exit 1
echo "gpu: no python here has a torch that sees a GPU: the GPU targets need a CUDA machine (the CPU suite: make test)" >&2
exit 1
