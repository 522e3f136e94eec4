#!/usr/bin/env bash
# Creates .venv (if needed) with everything jax_sdpa needs, and builds the C++ extension into it
# (an editable install: edits to jax_sdpa/*.py apply at once; ffi/*.cc rebuild on the next run).
# A compile error in ffi/ fails this script. Uses PYTHON if set, else a python3 of 3.11+; VENV
# names another environment folder (default .venv: CI's second Python has its own).
# With an NVIDIA GPU (nvidia-smi answers) it installs the CUDA 13 runtime too (the cuda13
# extra and jax[cuda13]); without one, only what building the extension needs: cuDNN's and the
# CUDA runtime's wheels without their own dependencies (cuBLAS and the rest are for running).
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "setup_env.sh: $*" >&2; exit 1; }
new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; }
# JAX 0.10 (and so jax_sdpa) runs on Python 3.11 or newer: a PYTHON that is older fails here,
# naming why; without PYTHON, the first of python3, python3.13, python3.12, python3.11 that is
# new enough is taken.
if [ -n "${PYTHON:-}" ]; then
  python="$PYTHON"
  new_enough "$python" || fail "PYTHON=$python ($("$python" --version 2>&1)) cannot run jax_sdpa: it needs JAX 0.10 or newer, which runs on Python 3.11 or newer (set PYTHON=python3.11 or newer)"
else
  python=
  for candidate in python3 python3.13 python3.12 python3.11; do
    if new_enough "$candidate"; then python="$candidate"; break; fi
  done
  [ -n "$python" ] || fail "no Python 3.11 or newer found (python3 is $(python3 --version 2>&1)): jax_sdpa needs JAX 0.10 or newer, which runs on Python 3.11 or newer; install one and set PYTHON to it"
  [ "$python" = python3 ] || echo "setup_env.sh: python3 is $(python3 --version 2>&1), too old for JAX 0.10: using $python"
fi
venv="${VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  echo "setup_env.sh: creating $venv with $("$python" --version 2>&1)"
  "$python" -m venv "$venv" || fail "could not create $venv with $python (is python3-venv installed?)"
fi
. "$venv/bin/activate"
pip() { python -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade pip || fail "could not upgrade pip in $venv"
# The build requirements, read from pyproject.toml, installed once into the venv so that the
# extension builds without an isolated environment (cuDNN's wheel is large).
build_requires=$(python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires']))") \
  || fail "could not read [build-system] requires from pyproject.toml"
mapfile -t build_requires <<<"$build_requires"
nvidia=() other=()
for requirement in "${build_requires[@]}"; do
  case "$requirement" in nvidia-*) nvidia+=("$requirement") ;; *) other+=("$requirement") ;; esac
done
if nvidia-smi -L >/dev/null 2>&1; then
  extras="cuda13,test,examples"
  gpu_packages=("jax[cuda13]")
  echo "setup_env.sh: NVIDIA GPU found: installing the CUDA 13 runtime as well"
else
  extras="test,examples"
  gpu_packages=()
  echo "setup_env.sh: no NVIDIA GPU: installing what building the extension needs, not the CUDA runtime"
fi
echo "setup_env.sh: installing build requirements: ${build_requires[*]} ninja cmake"
pip install "${other[@]}" ninja cmake || fail "the build requirements did not install (pip's messages above say why)"
pip install --no-deps "${nvidia[@]}" || fail "the CUDA/cuDNN wheels did not install (pip's messages above say why)"
echo "setup_env.sh: building the C++ extension and installing jax_sdpa[$extras] (about 2 minutes)"
# Its own build folder: CMake caches JAX_SDPA_DEVTOOLS, which a later `pip install .` of the
# product alone must not inherit.
pip install --no-build-isolation -Ceditable.rebuild=false -Ccmake.define.JAX_SDPA_DEVTOOLS=ON \
  -Cbuild-dir=build/dev-{wheel_tag} \
  -e ".[$extras]" "${gpu_packages[@]}" \
  || fail "building or installing jax_sdpa failed: the compiler's or pip's messages above say why"
python -c "import jax_sdpa; print('jax_sdpa', jax_sdpa.__version__, 'with cuDNN', jax_sdpa.cudnn_version())"
