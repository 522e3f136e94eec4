"""Where a packed call's compile time goes, and what runs around its kernels.

    python -m benchmarks.packed_compile [--config 8x1024 ...] [--trace DIR] [--time ROUNDS]
                                        [--no-listing] [--parts]

Compiles one fwd+bwd step (benchmarks/packed.py's 8x1024 config, one call) of each way the
public API runs packed documents: the checked call (segment ids alone: one ragged call, whose
grid the device picks and whose handler runs the exact fallback itself where the table cannot
hold the ids), the call with the documents' bound stated (max_document_length: one grid),
varlen_attention with it, the per-document bound (the documents as batch entries), and the
dense call for scale; trace+lower and XLA compile seconds each. With --parts, the checked call
again with its grids cut to the one that covers every case (not results: a measure of what
the choice among grids costs to compile). With --time,
times those fwd+bwd chains in interleaved rounds against the per-document bound. With
--trace, writes a jax.profiler trace (Perfetto JSON) of each to DIR and prints the GPU time
per kernel name.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp

import jax_sdpa
from benchmarks.packed import (_our_varlen, _per_document, _varlen, configs, make_inputs, stated,
                               timed_functions)
from benchmarks.traces import events_line, launch_table


def compile_seconds(attention, inputs):
    step = timed_functions(attention)["fwd+bwd"]
    jax.clear_caches()
    start = time.perf_counter()
    lowered = step.lower(inputs)
    traced = time.perf_counter()
    lowered.compile()
    return traced - start, time.perf_counter() - traced


def variants(config, ids):
    """{name: attention(q, k, v)}: the public ways to run this config's documents."""
    def checked(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=True, query_segment_ids=ids,
                                              implementation="cudnn")

    def dense(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return {"dense call (no segment ids)": dense, "packed, checked": checked,
            "packed, stated bound": stated(config, ids),
            "varlen_attention, stated": _varlen(config, _our_varlen),
            "per-document bound": _per_document(config)}


@contextlib.contextmanager
def _one_grid():
    """The checked call's program with the grid that covers every case alone (wrong speed:
    compile time only)."""
    from jax_sdpa.packing import grids  # noqa: PLC0415

    every = grids.ragged_grids
    with mock.patch.object(grids, "ragged_grids", lambda *a: every(*a)[-1:]):
        yield


def timed_variants(config, ids, rounds):
    """Prints the median ms per fwd+bwd call of each packed variant and its ratio to the
    per-document bound."""
    from benchmarks.attention import interleaved_rounds  # noqa: PLC0415

    inputs = make_inputs(config, seed=0)
    compiled = {}
    for name, attention in variants(config, ids).items():
        if name.startswith("dense"):
            continue
        compiled[name] = timed_functions(attention)["fwd+bwd"].lower(inputs).compile()
        jax.block_until_ready(compiled[name](inputs))
    samples = interleaved_rounds(compiled, lambda name: inputs, rounds)
    bound = statistics.median(samples["per-document bound"])
    for name, seconds in samples.items():
        median = statistics.median(seconds)
        print(f"{config.name} fwd+bwd, {name}: {median * 1e3:.3f} ms per call "
              f"({median / bound:.3f}x the per-document bound; median of {rounds})", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=None,
                        help="a benchmarks/packed.py config (repeatable; default 8x1024)")
    parser.add_argument("--trace", default=None)
    parser.add_argument("--time", type=int, default=0, metavar="ROUNDS")
    parser.add_argument("--parts", action="store_true",
                        help="the checked call's compile with one grid")
    parser.add_argument("--no-listing", action="store_true",
                        help="skip the compile-time listing (~15 s per variant on the H200)")
    args = parser.parse_args(argv)
    for name in args.config or ["8x1024"]:
        run_config(next(c for c in configs() if c.name == name), args)


def run_config(config, args):
    ids = jnp.asarray(config.segment_ids())
    if not args.no_listing:
        inputs = make_inputs(config, seed=0)[:1]
        for name, attention in variants(config, ids).items():
            lowering, compiling = compile_seconds(attention, inputs)
            print(f"{config.name}, one fwd+bwd call, {name}: trace+lower {lowering:.2f} s, "
                      f"XLA compile {compiling:.2f} s", flush=True)
    if args.parts:
        inputs = make_inputs(config, seed=0)[:1]
        checked = variants(config, ids)["packed, checked"]
        with _one_grid():
            lowering, compiling = compile_seconds(checked, inputs)
        print(f"{config.name}, one fwd+bwd call, packed, checked, without its grids but one: "
              f"trace+lower {lowering:.2f} s, XLA compile {compiling:.2f} s", flush=True)
    if args.time:
        timed_variants(config, ids, args.time)
    if args.trace:
        traced = {name: attention for name, attention in variants(config, ids).items()
                  if not name.startswith("dense")}
        inputs = make_inputs(config, seed=0)
        for name, attention in traced.items():
            step = timed_functions(attention)["fwd+bwd"]
            jax.block_until_ready(step(inputs))
            directory = f"{args.trace}/{config.name}/{name.replace(' ', '-').replace(',', '')}"
            with jax.profiler.trace(directory, create_perfetto_trace=True):
                for _ in range(3):
                    jax.block_until_ready(step(inputs))
            print(f"{name}: GPU µs per kernel name over 3 steps of {len(inputs)} fwd+bwd calls "
                  "(total, events), launch shapes:")
            print("\n".join(launch_table(directory, limit=12)))
            print(events_line(directory, "dot_do_o", width=300))


if __name__ == "__main__":
    main()
