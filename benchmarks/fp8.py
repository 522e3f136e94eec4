"""FP8 attention against bf16, side by side: jax_sdpa's bf16 call, fp8=True (bf16 in and out,
quantized inside), jax_sdpa.fp8 on inputs already in FP8 (a framework's own scaling: what the
kernels alone cost) and flash-attn3-jax's bf16, forward and forward+backward.

    python -m benchmarks.fp8 [--only d128-s4k-causal ...] [--config name:B,S,Nq,Nkv,H,bf16,causal]
                             [--rounds 7] [--span] [--per-call]

Without --only or --config, the anchor rows of head_dim 128 (where cuDNN's FP8 backward runs on
Hopper); --only names any anchor row, --config adds one of any size.

Method as benchmarks.attention (one process, a straight line of CALLS calls per jit, rounds
interleaved, median round); ratios against jax_sdpa's bf16 call. With --span, each chain also
runs once under jax.profiler, and the GPU's span per call (first kernel's start to last
kernel's end) is printed beside the wall time: the wall time holds the chain's launch and
wait, which weigh most where the calls are short. With --per-call, each chain also runs at
twice its length (on other inputs) in the same rounds: the extra calls' time is the calls'
alone, printed as ms per call beside the chain's fixed cost (its launch and wait).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.attention import CALLS, interleaved_rounds, make_inputs, timed_functions
from benchmarks.configs import ANCHOR_CONFIGS, parse_config
from benchmarks.implementations import available
from benchmarks.traces import gpu_span
import jax_sdpa.fp8


def _framework_inputs(inputs):
    """Each call's q, k, v, dO quantized once, outside the timed step, and its fp8_params."""
    quantized = []
    for q, k, v, d_out in inputs:
        (q8, dq), (k8, dk), (v8, dv), (do8, ddo) = (jax_sdpa.fp8.quantize(x)
                                                     for x in (q, k, v, d_out))
        one = jnp.ones((1, 1, 1, 1), jnp.float32)
        params = {name: one for name in jax_sdpa.fp8.FP8_PARAMS}
        # Scales a framework's amax history would give random normal inputs (measured: P's
        # largest weight 1, |O| < |V|, the backward's amaxes within a few of the inputs').
        params.update(descale_q=dq, descale_k=dk, descale_v=dv, descale_dO=ddo,
                      descale_s=one / 448, scale_s=one * 448, scale_o=one * 64,
                      descale_o=one / 64, scale_dP=one * 448, descale_dP=one / 448,
                      scale_dQ=one * 64, scale_dK=one * 64, scale_dV=one * 64)
        quantized.append((q8, k8, v8, do8, params))
    return quantized


def _framework_functions(causal, scale):
    def attention(q8, k8, v8, params):
        return jax_sdpa.fp8.dot_product_attention(
            q8, k8, v8, fp8_params=params, scale=scale,
            mask_type="CAUSAL" if causal else "NO_MASK")[0]

    def forward(inputs):
        return [attention(q8, k8, v8, p) for q8, k8, v8, _, p in inputs]

    def forward_backward(inputs):
        results = []
        for q8, k8, v8, do8, params in inputs:
            out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, params), q8, k8, v8)
            results.append((out, *vjp(do8)))
        return results
    return {"fwd": jax.jit(forward), "fwd+bwd": jax.jit(forward_backward)}


def _span_ms(fn, inputs):
    """GPU span per call of one traced run of the chain, ms."""
    with tempfile.TemporaryDirectory(prefix="jax_sdpa_fp8_span_") as directory:
        with jax.profiler.trace(directory):
            jax.block_until_ready(fn(inputs))
        return gpu_span(directory)[0] / CALLS / 1e3


def per_call(short, long):
    """(ms per call, the chain's fixed ms) from the times per CALLS calls (as time_once gives
    them) of a chain of CALLS calls and one of 2 * CALLS: the long chain's extra calls cost
    only what calls cost."""
    short, long = short * CALLS, long * CALLS
    return (long - short) / CALLS, 2 * short - long


def bench(config, rounds, span=False, doubled=False):
    inputs = [make_inputs(config, seed=0)]
    if doubled:
        inputs.append(inputs[0] + make_inputs(config, seed=1))
    framework = [_framework_inputs(i) for i in inputs]
    impls = {name: fn for name, fn in available(config).items()
             if name in ("jax_sdpa", "jax_sdpa fp8", "flash-attn3-jax")}
    fns = {(name, mode): fn for name, attention in impls.items()
           for mode, fn in timed_functions(attention, config.causal).items()}
    fns.update({("jax_sdpa.fp8 (FP8 inputs)", mode): fn for mode, fn in
                _framework_functions(config.causal, config.head_dim ** -0.5).items()})
    # A key (name, mode, chain): chain 0 the CALLS-call chain, 1 the doubled one.
    runs = {(*key, chain): fn for key, fn in fns.items() for chain in range(len(inputs))}
    inputs_of = lambda key: (framework if key[0].startswith("jax_sdpa.fp8")  # noqa: E731
                             else inputs)[key[2]]
    for key, fn in runs.items():  # compile and build outside the rounds
        jax.block_until_ready(fn(inputs_of(key)))
    samples = interleaved_rounds(runs, inputs_of, rounds)
    times = {key: statistics.median(s) * 1e3 for key, s in samples.items()}
    spans = ({key: _span_ms(fn, inputs_of((*key, 0))) for key, fn in fns.items()} if span
             else {})
    calls = {key: per_call(times[(*key, 0)], times[(*key, 1)]) for key in fns} if doubled else {}
    print(f"\n{config.name}: ms per call (x jax_sdpa bf16 = its time / this one's)"
          + ("; then GPU span per call, ms (x jax_sdpa bf16's)" if span else "")
          + ("; then ms per call without the chain's fixed cost (x), and that cost, ms"
             if doubled else ""))
    for name, mode in fns:
        ms, base = times[(name, mode, 0)], times[("jax_sdpa", mode, 0)]
        flops = config.forward_flops() * (1 if mode == "fwd" else 3.5)
        line = f"| {name} | {mode} | {ms:.3f} | {flops / ms / 1e9:.0f} TFLOP/s | {base / ms:.2f}x |"
        if span:
            gpu, gpu_base = spans[(name, mode)], spans[("jax_sdpa", mode)]
            line += f" {gpu:.3f} | {gpu_base / gpu:.2f}x |"
        if doubled:
            (call, fixed), base_call = calls[(name, mode)], calls[("jax_sdpa", mode)][0]
            line += f" {call:.3f} | {base_call / call:.2f}x | {fixed:.3f} |"
        print(line)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--config", action="append", default=[], type=parse_config)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--span", action="store_true",
                        help="also each chain's GPU span per call, from one traced run")
    parser.add_argument("--per-call", action="store_true",
                        help="also time each chain at twice its length: ms per call without "
                             "the chain's fixed cost")
    args = parser.parse_args()
    chosen = [config for config in ANCHOR_CONFIGS if config.name in args.only or
              (not args.only and not args.config and config.head_dim == 128)]
    for config in chosen + args.config:
        bench(config, args.rounds, args.span, args.per_call)


if __name__ == "__main__":
    main()
