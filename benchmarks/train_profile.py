"""Where a GPT-2 training step's time goes, per way of cutting rows (windows, packed, padded).

    python -m benchmarks.train_profile [--rows windows packed padded] [--steps 10] [--trace DIR]
                                       [--compare] [--prefetch] [--pipelined]

Builds examples/train_gpt2.py's step (gpt2 preset unless told otherwise), runs a few warm-up
steps, then times single steps (each waited for) and prints the median, the spread, the first
steps' times (graph builds show up there) and the host's dispatch time per step. With --trace,
also traces two warm steps per mode with jax.profiler and prints the GPU time per kernel name,
the GPU's span and idle gaps, and the GPU-busy share of the wall time: a step far longer than
its kernels waits on the host. With --compare (and --trace), also the kernels whose time per
step differs most between the first mode and each other one.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import train_gpt2  # noqa: E402
from gpt2_model import GPT  # noqa: E402
from benchmarks.traces import kernel_table, kernel_times, span_line  # noqa: E402


def _step_and_batches(rows, extra):
    args = train_gpt2.parse_args(["--rows", rows, *extra])
    rng = np.random.default_rng(args.seed)
    next_batch, _, _ = train_gpt2.batches(args, rng)
    config = train_gpt2.model_config(args)
    from flax import nnx  # noqa: PLC0415
    import optax  # noqa: PLC0415
    graphdef, params = nnx.split(GPT(config, nnx.Rngs(args.seed)))
    optimizer = optax.adamw(1e-4)
    opt_state = optimizer.init(params)
    train_step, _ = train_gpt2.make_train_step(graphdef, optimizer)
    return train_step, next_batch, params, opt_state


_TRACED_STEPS = 2


def profile(rows, steps, extra, trace_dir=None, prefetch=False):
    """Times the mode's steps; with trace_dir, traces two more and returns their
    ({kernel name: µs}, {kernel name: events}), else None. prefetch: each batch is on the
    device before its step's clock starts (the host-to-device copies left out)."""
    train_step, next_batch, params, opt_state = _step_and_batches(rows, extra)
    seconds, dispatch, tokens = [], [], 0
    for step in range(steps + 3):
        batch = next_batch()
        if prefetch:
            batch = jax.block_until_ready(train_gpt2.on_device(batch))
        x, y, batch_rows, count = batch
        start = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, x, y, batch_rows)
        dispatch.append(time.perf_counter() - start)
        float(loss)
        seconds.append(time.perf_counter() - start)
        tokens += count if step >= 3 else 0
    timed = seconds[3:]
    print(f"{rows}: first steps {', '.join(f'{s * 1e3:.0f}' for s in seconds[:3])} ms; then "
          f"median {statistics.median(timed) * 1e3:.1f} ms, min {min(timed) * 1e3:.1f}, max "
          f"{max(timed) * 1e3:.1f} over {len(timed)} steps; {tokens / sum(timed):,.0f} "
          "loss-carrying tokens/s", flush=True)
    # The host's share: until the step's call returns, the host is launching its work (and
    # updating XLA's command buffers); a step whose dispatch nears its time waits on the host.
    print(f"  host dispatch: median {statistics.median(dispatch[3:]) * 1e3:.1f} ms per step",
          flush=True)
    print(f"  per step (ms): {' '.join(f'{s * 1e3:.0f}' for s in timed)}", flush=True)
    if trace_dir:
        directory = f"{trace_dir}/{rows}"
        batches = [next_batch() for _ in range(_TRACED_STEPS)]
        start = time.perf_counter()
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            for x, y, batch_rows, _ in batches:
                params, opt_state, loss = train_step(params, opt_state, x, y, batch_rows)
                float(loss)
        wall = time.perf_counter() - start
        totals, counts = kernel_times(directory)
        print(f"  {span_line(directory, per=_TRACED_STEPS, what='per traced step')}", flush=True)
        busy = sum(totals.values()) / 1e6
        print(f"  traced {_TRACED_STEPS} steps: wall {wall * 1e3:.0f} ms (tracing included), "
              f"GPU kernels {busy * 1e3:.0f} ms in {sum(counts.values())} events", flush=True)
        print("\n".join(kernel_table(totals, counts, limit=15)))
        return totals, counts
    return None


def pipelined(rows, steps, extra):
    """The example's loop (each batch copied while the step before it runs, each loss read
    after the next step is dispatched; train_gpt2.StepLog times it): prints the median time
    per step, the steps' times and the example's tokens/s."""
    train_step, next_batch, params, opt_state = _step_and_batches(rows, extra)
    step_log, batch = train_gpt2.StepLog(), train_gpt2.on_device(next_batch())
    collections = _FullCollections()
    for step in range(1, steps + 3):
        x, y, batch_rows, count = batch
        params, opt_state, loss = train_step(params, opt_state, x, y, batch_rows)
        batch = train_gpt2.on_device(next_batch())
        step_log.dispatched(step, loss, count)  # freezes the collector's objects at step 2
        if step == 2:
            gc.callbacks.append(collections)
    step_log.flush()
    gc.callbacks.remove(collections)
    gc.unfreeze()  # the next mode starts from the collector as it was
    timed = [entry["seconds"] for entry in step_log.history[2:]]  # as StepLog counts them
    print(f"{rows}, pipelined: median {statistics.median(timed) * 1e3:.1f} ms per step over "
          f"{len(timed)} steps; {step_log.tokens_per_s:,.0f} loss-carrying tokens/s", flush=True)
    print(f"  per step (ms): {' '.join(f'{s * 1e3:.0f}' for s in timed)}", flush=True)
    print(f"  the collector's full passes meanwhile: {len(collections.seconds)}, "
          f"{sum(collections.seconds) * 1e3:.1f} ms in all", flush=True)


class _FullCollections:
    """A gc callback: the seconds of each full (generation 2) collection."""

    def __init__(self):
        self.seconds, self._start = [], None

    def __call__(self, phase, info):
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds.append(time.perf_counter() - self._start)


def compare(first, other, name, limit=20):
    """The kernels whose GPU time per traced step differs most between two modes' traces."""
    (totals, counts), (base, base_counts) = other, first
    names = sorted(set(totals) | set(base), key=lambda k: -abs(totals[k] - base[k]))
    print(f"{name}, GPU µs per step against the first mode (this, first, difference, events):")
    for kernel in names[:limit]:
        mine, theirs = totals[kernel] / _TRACED_STEPS, base[kernel] / _TRACED_STEPS
        print(f"    {mine:9.0f} {theirs:9.0f} {mine - theirs:+9.0f}  x{counts[kernel]:<5} "
              f"x{base_counts[kernel]:<5} {kernel[:90]}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["windows", "packed", "padded"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--trace", default=None, help="a directory for jax.profiler traces")
    parser.add_argument("--compare", action="store_true",
                        help="with --trace: per-kernel differences against the first mode")
    parser.add_argument("--prefetch", action="store_true",
                        help="put each batch on the device before its step's clock starts")
    parser.add_argument("--pipelined", action="store_true",
                        help="also the example's loop with each loss read a step late")
    args, extra = parser.parse_known_args(argv)  # the rest goes to train_gpt2's parser
    if args.compare and not args.trace:
        parser.error("--compare needs --trace")
    traced = {rows: profile(rows, args.steps, extra, args.trace, args.prefetch)
              for rows in args.rows}
    if args.pipelined:
        for rows in args.rows:
            pipelined(rows, args.steps, extra)
    if args.compare:
        first, *others = args.rows
        for rows in others:
            compare(traced[first], traced[rows], rows)


if __name__ == "__main__":
    main()
