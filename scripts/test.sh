#!/usr/bin/env bash
# The test command: set up .venv (building the C++ extension), then run every test, one pytest
# worker per core (PYTEST_WORKERS sets another count). GPU tests skip cleanly without an NVIDIA
# GPU. Extra arguments go to pytest; PYTHON and VENV as for scripts/setup_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. "${VENV:-.venv}/bin/activate"
python -m pytest -q -n "${PYTEST_WORKERS:-auto}" "$@"
