#!/usr/bin/env bash
# Creates .venv (if needed) with everything jax_sdpa needs, and builds the C++ extension into it
# (an editable install: edits to jax_sdpa/*.py apply at once; ffi/*.cc rebuild on the next run).
# A compile error in ffi/ fails this script. Uses python3 (3.10+) unless PYTHON is set.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The build requirements, read from pyproject.toml, installed once into the venv so that the
# extension builds without an isolated environment (cuDNN's wheel is large).
mapfile -t build_requires < <(python -c \
  "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml','rb'))['build-system']['requires']))")
python -m pip install -q "${build_requires[@]}" ninja cmake
python -m pip install -q --no-build-isolation -Ceditable.rebuild=false -e ".[cuda13,test,examples]"
python -c "import jax_sdpa; print('jax_sdpa', jax_sdpa.__version__, 'with cuDNN', jax_sdpa.cudnn_version())"
