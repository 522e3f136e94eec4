"""What runs around the attention kernels: one traced fwd+bwd chain per implementation.

    python -m benchmarks.profile_calls [--only gpt2-seed --only llama3.1-s16k] [--trace DIR]
                                       [--impl jax_sdpa --impl "jax.nn cudnn"] [--config SPEC]
                                       [--mode fwd]

For each config, each implementation's chain of CALLS fwd+bwd (or forward) calls inside one jit (the
benchmarks' method) runs once to compile and build, then once under jax.profiler; printed: the
chain's wall time per call and, per call, the GPU time of every kernel, memset and copy by name
(the trace shows each GPU kernel on two timelines on the H200: the figures here are halved for
that, as docs/PERFORMANCE.md does). What differs between the columns is what runs around
cuDNN's kernels (issue 15, item 1).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax

from benchmarks.attention import CALLS, make_inputs, timed_functions
from benchmarks.configs import ANCHOR_CONFIGS, parse_config
from benchmarks.implementations import available
from benchmarks.traces import kernel_table, kernel_times, span_line

TIMELINES_PER_KERNEL = 2  # seen on the H200: each kernel appears on two GPU lines


def profile(config, name, attention, directory, mode="fwd+bwd"):
    """Prints the chain's wall time per call and the GPU time per kernel name per call."""
    inputs = make_inputs(config, seed=0)
    step = timed_functions(attention, config.causal)[mode]
    jax.block_until_ready(step(inputs))  # compile, build graphs
    start = time.perf_counter()
    jax.block_until_ready(step(inputs))
    wall = (time.perf_counter() - start) / CALLS
    trace_dir = os.path.join(directory, f"{config.name}-{name.replace(' ', '-')}-{mode}")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(step(inputs))
    totals, counts = kernel_times(trace_dir)
    per_call = TIMELINES_PER_KERNEL * CALLS
    busy = sum(totals.values()) / per_call
    print(f"{config.name} | {name}: {wall * 1e3:.3f} ms per {mode} call, GPU busy "
          f"{busy / 1e3:.3f} ms of it in {sum(counts.values()) // per_call} kernels/copies",
          flush=True)
    print(f"    {span_line(trace_dir, per=CALLS)}")
    print("\n".join(kernel_table(totals, counts, per=per_call)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[],
                        help="extra config name:B,S,Nq,Nkv,H,fp16|bf16,causal|full")
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--impl", action="append", default=[])
    parser.add_argument("--trace", default=None, help="keep the traces here")
    parser.add_argument("--mode", choices=("fwd+bwd", "fwd"), default="fwd+bwd")
    args = parser.parse_args(argv)
    directory = args.trace or tempfile.mkdtemp(prefix="jax_sdpa_profile_")
    for config in ANCHOR_CONFIGS + [parse_config(text) for text in args.config]:
        if args.only and config.name not in args.only:
            continue
        for name, attention in available(config).items():
            if (args.impl and name not in args.impl) or (not args.impl and name == "jax.nn xla"):
                continue
            profile(config, name, attention, directory, args.mode)


if __name__ == "__main__":
    main()
