#!/usr/bin/env bash
# On the GPU machine (the device tool), from the repo root: install carried wheels, build the
# extension with the machine's own Python, run the whole test suite, then the benchmark.
#   bash scripts/gpu_check.sh [pytest args...]     (BENCH=0 skips the benchmark; PACKED=1 adds
#   the packed-rows benchmark, benchmarks/packed.py; MULTIPROCESS=1 the one-process-per-GPU
#   check, scripts/multiprocess_check.py; SAVE_BUILD=1 sends the built extensions back under
#   $OUT/ext, and PREBUILT=dir uses such a folder instead of building; AGAINST=dir runs each
#   benchmark first in another checkout whose built extensions are in dir/.ext, for before/after
#   ratios in one call: scripts/compare_speed.py)
# Carried wheels live in .whl/ (see docs/DEVELOPING.md); logs go to $OUT when it is set.
set -uo pipefail
out="${OUT:-/tmp/jax_sdpa_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
start=$(date +%s)
if [ -n "${PREBUILT:-}" ]; then
  # The extensions a previous call built from the same ffi/ sources (SAVE_BUILD=1 sent them
  # back under $OUT/ext): placed next to the sources, so the ~70 s build is skipped.
  cp "$PREBUILT"/*.so jax_sdpa/ || exit 1
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "prebuilt extensions from $PREBUILT: $(ls "$PREBUILT")"
else
  python3 -m pip install --no-build-isolation --no-deps -Ccmake.define.JAX_SDPA_DEVTOOLS=ON -e . \
    >"$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
  if [ "${SAVE_BUILD:-0}" = "1" ]; then  # send the built extensions back (for PREBUILT)
    mkdir -p "$out/ext"
    for module in jax_sdpa._sdpa_ffi jax_sdpa._sdpa_devtools; do
      origin=$(python3 -c "import importlib.util as u; print(u.find_spec('$module').origin)")
      cp "$origin" "$out/ext/"
    done
  fi
fi
# Failed tests are named in $out/failures.txt as they fail (tests/conftest.py): a call cut by
# its time limit loses pytest's summary.
export JAX_SDPA_FAILURES_FILE="$out/failures.txt"
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
  python3 -m pytest -q -rs --durations=12 -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest.log" | tail -40
status=${PIPESTATUS[0]}
if [ "${TRAIN:-0}" = "1" ]; then
  # The GPT-2 example once per attention path, same seed; then the curves compared.
  for attention in jax_sdpa jax-cudnn xla; do
    python3 examples/train_gpt2.py --preset gpt2 --attention "$attention" ${TRAIN_ARGS:-} \
      --out-dir "/tmp/train-$attention" 2>&1 | grep -v "it/s\|step/s" | tail -4
    cp "/tmp/train-$attention/log.json" "$out/train-$attention.json"
  done
  python3 examples/compare_runs.py /tmp/train-jax_sdpa /tmp/train-jax-cudnn /tmp/train-xla \
    --out "$out/comparison.png"
fi
if [ "${MULTIPROCESS:-0}" = "1" ]; then
  # One process per visible GPU, jax.distributed on localhost (nvidia-h200-x2).
  python3 scripts/multiprocess_check.py --platform gpu 2>&1 | tail -30
fi
benchmark() {  # module, time limit, args: in $AGAINST first (if set), then here
  local module=$1 limit=$2
  shift 2
  if [ -n "${AGAINST:-}" ]; then
    mkdir -p "$out/against"
    cp "$AGAINST"/.ext/*.so "$AGAINST/jax_sdpa/" || return 1
    (cd "$AGAINST" && PYTHONPATH="$PWD:${PYTHONPATH:-}" timeout "$limit" \
      python3 -m "benchmarks.$module" --out "$out/against" "$@" 2>&1 | tail -3)
  fi
  timeout "$limit" python3 -m "benchmarks.$module" --out "$out" "$@" 2>&1 | tail -45
}
# PACKED_ARGS and BENCH_ARGS are read as shell words, so quotes group them:
# PACKED_ARGS="--impl 'ragged stated'".
if [ "${PACKED:-0}" = "1" ]; then
  eval "packed_args=(${PACKED_ARGS:-})"
  benchmark packed "${PACKED_TIMEOUT:-600}" "${packed_args[@]}"
fi
if [ "${BENCH:-1}" = "1" ]; then
  eval "bench_args=(${BENCH_ARGS:-})"
  benchmark attention "${BENCH_TIMEOUT:-600}" "${bench_args[@]}"
fi
if [ -n "${AGAINST:-}" ]; then
  python3 scripts/compare_speed.py "$out/against" "$out"
  rm -f "$out"/*.png "$out"/against/*.png "$out"/against/*.md  # $OUT brings back 8 files
fi
exit "$status"
