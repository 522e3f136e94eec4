"""The ragged backward's kernels through jax_sdpa and as the graph alone, with their launch grids.

    python -m benchmarks.ragged_kernels [--config 4x2048] [--trace DIR] [--call-first]
                                        [--executions N]

Traces, in one process, the ragged graph alone (the developer tools' plan timing, on random
inputs laid out like the call's: benchmarks.plans --ragged) and jax_sdpa's packed fwd+bwd call
as shipped, and prints for each the GPU time per kernel name, the kernels' launch shapes
(grid and block) and, for the call, the document bounds its lowered plans pass and the dO.O and
bprop events in time order. The launch shapes say which plan ran (e.g. on 4x2048 the largest
plan's dO.O grid is 1024x256x16 for 256 entries x 8192, the shipped one's 256x32x16 for
32 x 2048), so a figure measured on the wrong plan shows.
"""

from __future__ import annotations

import argparse
import re

import jax

from benchmarks import plans
from benchmarks.packed import configs, make_inputs, timed_functions
from benchmarks.packed_compile import variants
from benchmarks.traces import events_line, launch_table
from jax_sdpa.call.spec import DEFAULT_MAX_SEGMENTS


def report(name, directory, per):
    print(f"{name}: GPU µs per kernel name per call (events per call), launch shapes:")
    print("\n".join(launch_table(directory, per=per, limit=8)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="4x2048")
    parser.add_argument("--trace", default="/tmp/ragged_kernels")
    parser.add_argument("--call-first", action="store_true",
                        help="trace the call before the graph alone (as a process that never "
                             "ran the developer tools sees it)")
    parser.add_argument("--executions", type=int, default=1,
                        help="executions of the chain of calls traced")
    args = parser.parse_args(argv)
    config = next(c for c in configs() if c.name == args.config)
    ids = jax.numpy.asarray(config.segment_ids())
    shipped = next(fn for name, fn, _ in variants(ids) if name == "packed, as shipped")

    if not args.call_first:
        alone(config, args.trace)
    inputs = make_inputs(config, seed=0)
    lowered = timed_functions(shipped)["fwd+bwd"].lower(inputs)
    compiled = lowered.compile()
    bounds = sorted(set(re.findall(r"max_document_\w+ = \d+", lowered.as_text())))
    print(f"call as shipped: lowered bounds {bounds}")
    jax.block_until_ready(compiled(inputs))
    directory = f"{args.trace}/call"
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(args.executions):
            jax.block_until_ready(compiled(inputs))
    report("call as shipped", directory, per=len(inputs) * args.executions)
    print(events_line(directory, "dot_do_o"))
    print(events_line(directory, "bprop"))
    if args.call_first:
        alone(config, args.trace)


def alone(config, trace):
    plans.time_ragged_plans(config, "backward", 1, DEFAULT_MAX_SEGMENTS)  # warm: graphs built
    directory = f"{trace}/alone"
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        timings = plans.time_ragged_plans(config, "backward", 1, DEFAULT_MAX_SEGMENTS)
    print("graph alone, backward plans:", [(t["plan"], t["name"], round(t["ms"], 3))
                                           for t in timings])
    report("graph alone (every backward plan, forward first)", directory, per=1)


if __name__ == "__main__":
    main()
