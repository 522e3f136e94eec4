"""Where a packed call's compile time goes, and what runs around its kernels.

    python -m benchmarks.packed_compile [--config 8x1024 ...] [--trace DIR] [--time ROUNDS]
                                        [--no-listing]

Compiles one packed fwd+bwd step (benchmarks/packed.py's 8x1024 config, one call) with parts of
the packed path taken out, to see which part costs: every branch (as shipped); the ragged
branches without the exact fallback (a stand-in that returns zeros: timing only, never run);
the fallback with one ragged plan; the dense (non-packed) call for scale. With --trace, writes a
jax.profiler trace (Perfetto JSON) of the shipped step's chain of calls, of the same call with the
documents' bound stated, of varlen_attention with it, and of the per-document bound to DIR, and prints the GPU time per kernel
name from each. With --time, times the fwd+bwd chains (interleaved rounds) of the shipped call,
of the plan it picks for these documents alone with and without the lax.switch around it (the
switch's predicate is read on the host before the branch can launch: the difference is that
round trip's cost and the branch choice's kernels; without the switch nothing checks the ids, so
that variant is for timing only), of the call with the bound stated (max_document_length: one
plan, no switch, checked by poisoning), and of the per-document bound.
Variants patch module globals while they trace; `_patched` clears JAX's caches around them.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import types

import jax
import jax.numpy as jnp

import jax_sdpa
from jax_sdpa import kernels
from jax_sdpa.validation import DEFAULT_MAX_SEGMENTS
from benchmarks.packed import (_our_varlen, _per_document, _varlen, configs, make_inputs, stated,
                               timed_functions)
from benchmarks.plans import ragged_layout
from benchmarks.traces import events_line, launch_table


@contextlib.contextmanager
def _patched(module, **values):
    """Module globals replaced while the block traces. JAX caches the custom_vjp's traced
    functions by (function, config, shapes), which a patched global is not part of: without
    clearing those caches on the way in and out, a later trace silently reuses the patched
    one, and every variant measures whichever was traced first."""
    saved = {name: getattr(module, name) for name in values}
    jax.clear_caches()
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        jax.clear_caches()


def _no_fallback():
    """A stand-in for the exact fallback with the same output types (zeros)."""
    def forward(config, inputs):
        q, v = inputs["query"], inputs["value"]
        return (jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype),
                jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32))

    def backward(config, inputs, output, lse, d_output, forward_fn=None):
        return (jnp.zeros_like(inputs["query"]), jnp.zeros_like(inputs["key"]),
                jnp.zeros_like(inputs["value"]), None)
    return types.SimpleNamespace(blockwise_forward=forward, backward=backward)


def compile_seconds(attention, inputs):
    step = timed_functions(attention)["fwd+bwd"]
    jax.clear_caches()
    start = time.perf_counter()
    lowered = step.lower(inputs)
    traced = time.perf_counter()
    lowered.compile()
    return traced - start, time.perf_counter() - traced


def variants(ids):
    def packed(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=True, query_segment_ids=ids,
                                              implementation="cudnn")

    def dense(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    yield "dense call (no segment ids)", dense, contextlib.nullcontext()
    yield "packed, as shipped", packed, contextlib.nullcontext()
    yield "packed, ragged branches only", packed, _patched(kernels,
                                                           reference_kernel=_no_fallback())
    yield "packed, one ragged plan + fallback", packed, _patched(
        kernels, _ENTRY_FRACTIONS=(1,), _LENGTH_FRACTIONS=(1,))
    yield "packed, one ragged plan only", packed, _patched(
        kernels, _ENTRY_FRACTIONS=(1,), _LENGTH_FRACTIONS=(1,),
        reference_kernel=_no_fallback())


def _without_switch():
    """lax.switch replaced by its first branch while a variant is traced (timing only)."""
    return _patched(jax.lax, switch=lambda index, branches, *operands: branches[0](*operands))


def _its_plan_only(config):
    """The plan table cut to the one plan the shipped call picks for this config's documents
    (the same kernels: with and without the switch then differ by the switch alone; the
    largest plan would run other kernels on cuDNN 9.28)."""
    entries, bound, _ = ragged_layout(config, DEFAULT_MAX_SEGMENTS)
    return _patched(kernels, _grids=lambda *args: [(entries, (bound, bound))])


def timed_variants(config, ids, rounds):
    """Prints the median ms per fwd+bwd call of each variant and its ratio to the bound."""
    from benchmarks.attention import interleaved_rounds  # noqa: PLC0415

    def packed(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=True, query_segment_ids=ids,
                                              implementation="cudnn")

    cases = [  # (name, attention, the patches active while it is traced)
        ("packed, as shipped", packed, []),
        ("packed, its plan + fallback, switch", packed, [_its_plan_only(config)]),
        # Does a switch cost more with more branches? Four plans (2 bounds x 2 entry levels)
        # here; 4x2048 picks the same plan from them (8x1024 does not: a 2048 bound).
        ("packed, 4 plans + fallback, switch", packed,
         [_patched(kernels, _LENGTH_FRACTIONS=(4, 1))]),
        ("packed, its plan, no switch", packed, [_its_plan_only(config), _without_switch()]),
        ("packed, stated bound", stated(config, ids), []),
        ("per-document bound", _per_document(config), []),
    ]
    inputs = make_inputs(config, seed=0)
    compiled = {}
    for name, attention, patches in cases:
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
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
    parser.add_argument("--no-listing", action="store_true",
                        help="skip the compile-time listing (~15 s per variant on the H200)")
    args = parser.parse_args(argv)
    for name in args.config or ["8x1024"]:
        run_config(next(c for c in configs() if c.name == name), args)


def run_config(config, args):
    ids = jnp.asarray(config.segment_ids())
    if not args.no_listing:
        inputs = make_inputs(config, seed=0)[:1]
        for name, attention, patch in variants(ids):
            with patch:
                lowering, compiling = compile_seconds(attention, inputs)
                print(f"{config.name}, one fwd+bwd call, {name}: trace+lower {lowering:.2f} s, "
                      f"XLA compile {compiling:.2f} s", flush=True)
    if args.time:
        timed_variants(config, ids, args.time)
    if args.trace:
        traced = {"packed": next(fn for name, fn, _ in variants(ids) if name == "packed, as shipped"),
                  "packed stated": stated(config, ids),
                  "varlen_attention stated": _varlen(config, _our_varlen),
                  "per-document bound": _per_document(config)}
        inputs = make_inputs(config, seed=0)
        for name, attention in traced.items():
            step = timed_functions(attention)["fwd+bwd"]
            jax.block_until_ready(step(inputs))
            directory = f"{args.trace}/{config.name}/{name.replace(' ', '-')}"
            with jax.profiler.trace(directory, create_perfetto_trace=True):
                for _ in range(3):
                    jax.block_until_ready(step(inputs))
            print(f"{name}: GPU µs per kernel name over 3 steps of {len(inputs)} fwd+bwd calls "
                  "(total, events), launch shapes:")
            print("\n".join(launch_table(directory, limit=12)))
            print(events_line(directory, "dot_do_o", width=300))


if __name__ == "__main__":
    main()
