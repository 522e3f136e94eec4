#!/usr/bin/env bash
# The main job: set up .venv, then train the GPT-2-style example (a small model on CPU, GPT-2
# small on a GPU). Extra arguments go to examples/train_gpt2.py (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
python examples/train_gpt2.py "$@"
