#!/usr/bin/env bash
# Builds the C++ extension against the newest cuDNN frontend we support beside the pinned one
# (FRONTEND, default 1.32.0: its headers include nvrtc.h, so NVRTC's wheel joins the build) in
# the project's .venv, in a build folder of its own, and imports it: both frontends keep
# building on every CI run. Only the frontend's headers are needed (installed without the
# wheel's own dependencies, which its Python kernels use).
set -euo pipefail
cd "$(dirname "$0")/.."
frontend="${FRONTEND:-1.32.0}"
. .venv/bin/activate
headers="build/frontend-$frontend"
python -m pip install -q --no-deps --target "$headers" "nvidia-cudnn-frontend==$frontend"
python -m pip install -q --no-deps "nvidia-cuda-nvrtc>=13.0,<14"
build="build/fe-$frontend"
JAX_SDPA_FRONTEND_INCLUDE_DIR="$PWD/$headers/include" cmake -S . -B "$build" -G Ninja \
  -DPython_EXECUTABLE="$(command -v python)" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build"
module=$(ls "$build"/_sdpa_ffi*.so)
python - "$module" <<'PY'
import importlib.util
import sys

from jax_sdpa.cudnn import extension

extension._preload_cudnn()
spec = importlib.util.spec_from_file_location("_sdpa_ffi", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print("frontend build: jax_sdpa extension built against", sys.argv[1].split("/")[1],
      "cuDNN headers", module.cudnn_header_version(), "with", len(module.registrations()),
      "targets")
PY
