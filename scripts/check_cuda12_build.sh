#!/usr/bin/env bash
# Builds the C++ extension against the CUDA 12 wheels, in a venv of its own (.venv-cu12), and
# imports it: the cuda12 packaging is checked on every CI run (a CPU machine can build it, the
# headers come from wheels). Headers: nvidia-cudnn-cu12, nvidia-cuda-runtime-cu12,
# nvidia-cuda-nvcc-cu12 (crt/), nvidia-cuda-cccl-cu12 (nv/); the cuDNN frontend as for CUDA 13.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
[ -x .venv-cu12/bin/python ] || "$python" -m venv .venv-cu12
. .venv-cu12/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "jax>=0.10" numpy "scikit-build-core>=0.10" "nanobind>=2.0" cmake ninja \
  "nvidia-cudnn-frontend==1.18.0"
# Headers and libcudnn only: the libraries cuDNN loads when it runs (cuBLAS, ...) are not needed
# to build and import the extension.
python -m pip install -q --no-deps "nvidia-cudnn-cu12>=9.8" "nvidia-cuda-runtime-cu12>=12.4" \
  nvidia-cuda-nvcc-cu12 nvidia-cuda-cccl-cu12
python -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/cu12 .
cd /tmp
python - <<'PY'
from jax_sdpa.cudnn import extension
module = extension.extension()
print("CUDA 12 build: jax_sdpa extension built against cuDNN", module.cudnn_header_version(),
      "loads cuDNN", module.cudnn_version(), "with targets", sorted(module.registrations()))
PY
