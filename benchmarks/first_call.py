"""The first call, measured fairly: every implementation in a fresh process of its own.

    python -m benchmarks.first_call [--only CONFIG ...] [--impl NAME ...] [--graph-cache
                                    [--xla-cache]] [--out DIR]

benchmarks/attention.py times first calls inside one process, where whichever implementation
runs first warms cuDNN (handles, loaded kernels) for the others. Here each (config,
implementation, mode) starts a new Python process that imports JAX, makes the inputs, then
measures: trace + lower, XLA compile, the first execution (cuDNN graphs are built there for the
custom-call paths), and a second execution for scale. Process start and imports are reported
apart (they are the same for everyone). With --graph-cache, each row runs twice, in a
process that fills a new JAX_SDPA_GRAPH_CACHE_DIR and in one that reads it (--xla-cache: JAX's
persistent compilation cache as well). Writes first_call.md and first_call.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.report import output_directory

MODES = ("fwd", "fwd+bwd")


def child(config_name, implementation, mode):
    """Runs in the fresh process: prints one JSON line of seconds."""
    started = time.perf_counter()
    import jax  # noqa: PLC0415 - timed
    import jax_sdpa  # noqa: F401, PLC0415 - timed
    from benchmarks.attention import make_inputs, timed_functions  # noqa: PLC0415
    from benchmarks.configs import ANCHOR_CONFIGS  # noqa: PLC0415
    from benchmarks.implementations import available  # noqa: PLC0415
    jax.devices()
    imported = time.perf_counter()
    config = next(c for c in ANCHOR_CONFIGS if c.name == config_name)
    attention = available(config)[implementation]
    inputs = make_inputs(config, seed=0)[:1]  # one call: the first call's cost, not a chain's
    jax.block_until_ready(inputs)
    fn = timed_functions(attention, config.causal)[mode]
    start = time.perf_counter()
    lowered = fn.trace(inputs).lower()
    traced = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    jax.block_until_ready(compiled(inputs))
    first = time.perf_counter()
    jax.block_until_ready(compiled(inputs))
    second = time.perf_counter()
    print(json.dumps(dict(imports_s=imported - started, trace_lower_s=traced - start,
                          compile_s=compiled_at - traced, first_run_s=first - compiled_at,
                          second_run_s=second - first,
                          first_call_s=first - start)), flush=True)


def in_fresh_process(module, child_args, timeout, env=None):
    """`python -m module --child *child_args` (with env's variables added): the JSON line it
    printed last, or {"error": why} (its exception's line)."""
    command = [sys.executable, "-m", module, "--child", *child_args]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        return dict(error=f"over {timeout} s")
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        errors = result.stderr.strip().splitlines() or ["no output"]
        raised = [line for line in errors if "Error" in line.split(":")[0]]
        return dict(error=(raised or errors)[-1][:200])
    return json.loads(lines[-1])


# JAX's persistent compilation cache, for every executable however quick to compile.
_XLA_CACHE = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def runs(module, child_args, timeout, graph_cache=False, xla_cache=False):
    """[(stage, measured)]: ("", one fresh process), or with graph_cache ("graph files
    filling", a process that fills a new JAX_SDPA_GRAPH_CACHE_DIR) then ("graph files warm",
    a second process that reads it); xla_cache: JAX's persistent compilation cache too, in
    the same new directory (a restarted job with both caches)."""
    if not graph_cache:
        return [("", in_fresh_process(module, child_args, timeout))]
    with tempfile.TemporaryDirectory(prefix="jax_sdpa_graphs_") as directory:
        env = {"JAX_SDPA_GRAPH_CACHE_DIR": directory}
        label = "graph files"
        if xla_cache:
            env.update(_XLA_CACHE, JAX_COMPILATION_CACHE_DIR=os.path.join(directory, "xla"))
            label = "graph files and XLA cache"
        return [(f"{label} {stage}", in_fresh_process(module, child_args, timeout, env))
                for stage in ("filling", "warm")]


def stage_name(implementation, stage):
    return f"{implementation}, {stage}" if stage else implementation


def markdown(rows):
    lines = ["| config | implementation | mode | first call s (trace+lower, compile, first run) "
             "| second run ms | imports s |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['impl']} | {r['mode']} | {r['error']} | – "
                         "| – |")
            continue
        lines.append(f"| {r['config']} | {r['impl']} | {r['mode']} | {r['first_call_s']:.2f} "
                     f"({r['trace_lower_s']:.2f}, {r['compile_s']:.2f}, {r['first_run_s']:.2f}) "
                     f"| {r['second_run_s'] * 1e3:.2f} | {r['imports_s']:.1f} |")
    return "\n".join(lines)


def fresh_process_parser(description, child_args, implementations=None):
    """--only CONFIG, --impl NAME (repeatable), --out DIR, --timeout s, and the child's own
    --child with child_args values."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--impl", action="append", default=[], choices=implementations)
    parser.add_argument("--out", type=output_directory, default=os.environ.get("OUT", "."))
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--graph-cache", action="store_true",
                        help="each row twice: filling a new JAX_SDPA_GRAPH_CACHE_DIR, then "
                             "reading it in another fresh process")
    parser.add_argument("--xla-cache", action="store_true",
                        help="with --graph-cache: JAX's persistent compilation cache as well")
    parser.add_argument("--child", nargs=child_args, default=None, help=argparse.SUPPRESS)
    return parser


def record(out, name, header, rows, row):
    """Appends row (printed as it comes) and rewrites name.json under out."""
    print(row, file=sys.stderr, flush=True)
    rows.append(row)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(dict(header=header, rows=rows), f, indent=1)


def main(argv=None):
    args = fresh_process_parser(__doc__.splitlines()[0], 3).parse_args(argv)
    if args.child:
        child(*args.child)
        return
    from benchmarks.configs import ANCHOR_CONFIGS  # noqa: PLC0415
    from benchmarks.implementations import available  # noqa: PLC0415
    from benchmarks.report import machine_line, write_markdown  # noqa: PLC0415
    header = f"{machine_line()}; one fresh process per row"
    rows = []
    for config in ANCHOR_CONFIGS:
        if args.only and config.name not in args.only:
            continue
        for implementation in available(config):
            if args.impl and implementation not in args.impl:
                continue
            for mode in MODES:
                for stage, measured in runs("benchmarks.first_call",
                                            (config.name, implementation, mode), args.timeout,
                                            args.graph_cache, args.xla_cache):
                    record(args.out, "first_call", header, rows,
                           dict(config=config.name, impl=stage_name(implementation, stage),
                                mode=mode, **measured))
    write_markdown(args.out, "first_call.md", header, markdown(rows))


if __name__ == "__main__":
    main()
