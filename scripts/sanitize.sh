#!/usr/bin/env bash
# compute-sanitizer over the core GPU cases (scripts/sanitize_cases.py), on the GPU machine
# after scripts/gpu_check.sh has built the extension:
#   bash scripts/sanitize.sh [memcheck|racecheck|...] [part of a case name]
# Reports only what happens in our extension's and cuDNN's kernels matter; XLA's own kernels
# run too and are reported like any other. Logs go to $OUT when it is set.
set -uo pipefail
tool="${1:-memcheck}"
out="${OUT:-/tmp/jax_sdpa_out}"
mkdir -p "$out"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} XLA_PYTHON_CLIENT_PREALLOCATE=false
# XLA's autotuner would run thousands of extra kernels under the sanitizer.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
compute-sanitizer --tool "$tool" --print-limit 20 --error-exitcode 3 \
  python3 scripts/sanitize_cases.py "${@:2}" > "$out/sanitize-$tool.log" 2>&1
status=$?
tail -25 "$out/sanitize-$tool.log"
echo "compute-sanitizer --tool $tool: exit $status"
exit "$status"
