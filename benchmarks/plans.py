"""cuDNN's SDPA graphs timed alone, against the same shapes called through JAX.

    python -m benchmarks.plans [--only NAME ...] [--config name:B,S,Nq,Nkv,H,bf16,causal] [--out DIR]
                               [--ragged 4x2048 ...]

For each config: every plan cuDNN's heuristics offer (modes A, B, fallback), forward and
backward, timed by the extension with CUDA events around a straight run of executions on a
private stream, rotating over the CALLS input sets the JAX calls use (the same arrays: same
data, same memory; ffi/devtools/kernel_timing.h); then jax_sdpa (default
and with command buffers) and jax.nn's cuDNN path as the marginal cost of a call inside jit:
chains of CALLS and 2 * CALLS independent calls (benchmarks/attention.py's method, median of
interleaved rounds), (t(2n) - t(n)) / n, so that the fixed cost of dispatching a jit and
waiting for it drops out, as it does from the graph-alone run. Answers issue 8's questions:
how far a call through JAX is from the graph alone, and whether any plan beats the heuristics'
first (whether autotuning could pay). Writes plans.md and plans.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

from benchmarks.report import benchmark_parser, machine_line, write_markdown
from benchmarks.attention import CALLS, interleaved_rounds, make_inputs, timed_functions
from benchmarks.configs import ANCHOR_CONFIGS, parse_config
from benchmarks import packed
from benchmarks.implementations import available
from jax_sdpa.cudnn import extension as _extension
from jax_sdpa.packing import grids
from jax_sdpa.call.spec import DEFAULT_MAX_SEGMENTS


# The JAX calls timed next to the graph alone (benchmarks/implementations.py's names).
CALL_IMPLEMENTATIONS = ("jax_sdpa", "jax_sdpa plain", "jax_sdpa cmdbuf", "jax.nn cudnn")


def buffer_sets(config, direction, inputs):
    """Device pointers of q, k, v, o, stats[, d_o, dq, dk, dv] per input set: the benchmark's
    inputs, and fresh arrays for what the graphs write (never read back through JAX)."""
    sets, keep = [], []
    for q, k, v, d_out in inputs:
        o = jnp.zeros_like(q)
        stats = jnp.zeros((config.batch, config.q_heads, config.seq), jnp.float32)
        arrays = [q, k, v, o, stats]
        if direction == "backward":
            arrays += [d_out, jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)]
        jax.block_until_ready(arrays)
        keep.append(arrays)
        sets.append([x.unsafe_buffer_pointer() for x in arrays])
    return sets, keep


def devtools():
    """The developer-tools extension (ffi/devtools/), loaded after the product's (which loads
    the process's cuDNN first)."""
    _extension.extension()
    from jax_sdpa import _sdpa_devtools  # noqa: PLC0415

    return _sdpa_devtools


def time_plans(config, direction, rounds, inputs, implementation="auto"):
    sets, keep = buffer_sets(config, direction, inputs)
    timings = devtools().time_plans(
        direction=direction, dtype=jnp.dtype(config.dtype).name, batch=config.batch,
        q_seq_len=config.seq, kv_seq_len=config.seq, q_heads=config.q_heads,
        kv_heads=config.kv_heads, head_dim=config.head_dim, head_dim_v=config.head_dim,
        causal=config.causal, scale=config.head_dim ** -0.5, iterations=CALLS * rounds,
        input_sets=CALLS, buffers=sets, device=inputs[0][0].devices().pop().id,
        implementation=implementation)
    del keep  # the arrays lived while their memory was in use
    return timings


def ragged_layout(config, max_segments):
    """(entries, bound, lengths) of the ragged graph a packed config's call runs: the first of
    jax_sdpa's plans (cheapest first) that holds its documents, the lengths compacted to the
    front and padded with empty entries (as jax_sdpa/packing/ragged.py lays them out)."""
    lengths = [n for row in config.lengths for n in row]
    for entries, (bound, _) in grids.ragged_grids(config.batch, max_segments, config.seq,
                                                  config.seq):
        if len(lengths) <= entries and max(lengths) <= bound:
            return entries, bound, lengths + [0] * (entries - len(lengths))
    raise ValueError(f"no ragged plan holds {config.name}")


def time_ragged_plans(config, direction, rounds, max_segments):
    """Every plan of the ragged graph a packed config runs (random inputs: the graph alone)."""
    entries, bound, lengths = ragged_layout(config, max_segments)
    return devtools().time_plans(
        direction=direction, dtype=jnp.dtype(packed.DTYPE).name, batch=entries,
        q_seq_len=bound, kv_seq_len=bound, q_heads=packed.N_HEADS, kv_heads=packed.N_HEADS,
        head_dim=packed.HEAD_DIM, head_dim_v=packed.HEAD_DIM, causal=True,
        scale=packed.HEAD_DIM ** -0.5, iterations=CALLS * rounds, input_sets=CALLS,
        document_lengths=lengths, total_tokens=config.batch * config.seq)


def time_other_implementations(config, rounds, inputs, implementations):
    """{"forward <implementation>": plans} for the frontend's other SDPA forward
    implementations (set_implementation); a graph the implementation refuses is one row that
    carries cuDNN's message."""
    found = {}
    for implementation in implementations:
        try:
            plans = time_plans(config, "forward", rounds, inputs, implementation)
        except RuntimeError as error:
            plans = [dict(plan=0, name="-", workspace_bytes=0, ms=0.0, host_us=0.0,
                          error=str(error))]
        found[f"forward {implementation}"] = plans
    return found


def preferred(plans):
    """The plan calls run: the first in the heuristics' order that built."""
    return next(p for p in plans if p["ms"] > 0)


def time_calls(config, rounds):
    """{(impl, mode): marginal ms per call inside jit} for jax_sdpa (its default; every call
    recorded into command buffers; none) and jax.nn cudnn."""
    chains = {n: make_inputs(config, seed=0) + make_inputs(config, seed=1)[:n - CALLS]
              for n in (CALLS, 2 * CALLS)}
    impls = {name: fn for name, fn in available(config, command_buffers=True).items()
             if name in CALL_IMPLEMENTATIONS}
    fns = {(name, mode, n): fn for name, attention in impls.items()
           for mode, fn in timed_functions(attention, config.causal).items() for n in chains}
    for (_, _, n), fn in fns.items():
        jax.block_until_ready(fn(chains[n]))
    samples = interleaved_rounds(fns, lambda key: chains[key[2]], rounds)
    # time_once gives seconds per call of a CALLS-call chain: CALLS times it is one chain.
    chain_ms = {key: statistics.median(times) * CALLS * 1e3 for key, times in samples.items()}
    return {(name, mode): (chain_ms[(name, mode, 2 * CALLS)] - chain_ms[(name, mode, CALLS)])
            / CALLS for name, mode, _ in fns}


def markdown(results):
    lines = ["| config | mode | cuDNN graph alone ms | "
             + " | ".join(f"{impl} ms (×)" for impl in CALL_IMPLEMENTATIONS)
             + " | fastest plan ms (× heuristics' first) |",
             "|---|---|---|" + "---|" * len(CALL_IMPLEMENTATIONS) + "---|"]
    for r in results:
        if "calls_ms" not in r:  # a ragged graph: timed alone only
            continue
        for mode in ("fwd", "fwd+bwd"):
            alone = r["alone_ms"][mode]
            cells = [f"{r['calls_ms'][f'{impl}|{mode}']:.3f} "
                     f"({r['calls_ms'][f'{impl}|{mode}'] / alone:.3f})"
                     for impl in CALL_IMPLEMENTATIONS]
            best = r["best_ms"][mode]
            lines.append(f"| {r['config']} | {mode} | {alone:.3f} | {' | '.join(cells)} | "
                         f"{best:.3f} ({best / alone:.3f}) |")
    lines += ["", "| config | direction | plan | cuDNN engine config | ms | × first | "
              "workspace MiB | host µs per execute | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for direction, plans in r["plans"].items():
            # Against the frontend's own choice (auto) in that direction: other forward
            # implementations compare with it, and one that refused the graph has no plan.
            first = preferred(r["plans"][direction.split()[0]])["ms"]
            for p in plans:
                ms = f"{p['ms']:.3f}" if p["ms"] > 0 else "–"
                ratio = f"{p['ms'] / first:.3f}" if p["ms"] > 0 else "–"
                host = f"{p['host_us']:.1f}" if p["host_us"] > 0 else "–"
                lines.append(f"| {r['config']} | {direction} | {p['plan']} | {p['name']} | {ms} | "
                             f"{ratio} | {p['workspace_bytes'] / 2**20:.1f} | {host} | "
                             f"{p['error'][:80]} |")
    return "\n".join(lines)


def write_json(directory, header, results):
    with open(os.path.join(directory, "plans.json"), "w") as f:
        json.dump(dict(header=header, calls_per_round=CALLS, results=results), f, indent=1)


def main(argv=None):
    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[])
    parser.add_argument("--forward-implementation", action="append", default=[],
                        choices=("composite", "unified"),
                        help="also time each dense config's forward with this SDPA "
                             "implementation of the frontend (auto is always timed)")
    parser.add_argument("--ragged", action="append", default=[], metavar="PACKED",
                        help="also every plan of the ragged graph of benchmarks/packed.py's "
                             "config PACKED (e.g. 4x2048), alone; --only '' skips the dense ones")
    args = parser.parse_args(argv)
    configs = ANCHOR_CONFIGS + [parse_config(text) for text in args.config]
    if args.only:
        configs = [c for c in configs if c.name in args.only]
    header = machine_line()
    results = []
    for config in (c for c in packed.configs() if c.name in args.ragged):
        entries, bound, _ = ragged_layout(config, DEFAULT_MAX_SEGMENTS)
        plans = {d: time_ragged_plans(config, d, args.rounds, DEFAULT_MAX_SEGMENTS)
                 for d in ("forward", "backward")}
        results.append(dict(config=f"{config.name} ragged {entries}x{bound}", plans=plans))
        write_json(args.out, header, results)
    for index, config in enumerate(configs):
        print(f"[{index + 1}/{len(configs)}] {config.name}", file=sys.stderr, flush=True)
        inputs = make_inputs(config, seed=0)
        plans = {d: time_plans(config, d, args.rounds, inputs) for d in ("forward", "backward")}
        plans.update(time_other_implementations(config, args.rounds, inputs,
                                                args.forward_implementation))
        del inputs
        fwd, bwd = (preferred(plans[d])["ms"] for d in ("forward", "backward"))
        best_fwd, best_bwd = (min(p["ms"] for p in plans[d] if p["ms"] > 0)
                              for d in ("forward", "backward"))
        calls = time_calls(config, args.rounds)
        results.append(dict(config=config.name, plans=plans,
                            alone_ms={"fwd": fwd, "fwd+bwd": fwd + bwd},
                            best_ms={"fwd": best_fwd, "fwd+bwd": best_fwd + best_bwd},
                            calls_ms={f"{impl}|{mode}": ms for (impl, mode), ms in calls.items()}))
        write_json(args.out, header, results)
    table = markdown(results)
    write_markdown(args.out, "plans.md", header, table)


if __name__ == "__main__":
    main()
