"""FP8 attention against bf16, side by side: jax_sdpa's bf16 call, fp8=True (bf16 in and out,
quantized inside), jax_sdpa.fp8 on inputs already in FP8 (a framework's own scaling: what the
kernels alone cost) and flash-attn3-jax's bf16, forward and forward+backward.

    python -m benchmarks.fp8 [--only d128-s4k-causal ...] [--rounds 7]

Method as benchmarks.attention (one process, a straight line of CALLS calls per jit, rounds
interleaved, median round); ratios against jax_sdpa's bf16 call.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp

from benchmarks.attention import interleaved_rounds, make_inputs, timed_functions
from benchmarks.configs import ANCHOR_CONFIGS
from benchmarks.implementations import available
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


def bench(config, rounds):
    inputs = make_inputs(config, seed=0)
    framework = _framework_inputs(inputs)
    impls = {name: fn for name, fn in available(config).items()
             if name in ("jax_sdpa", "jax_sdpa fp8", "flash-attn3-jax")}
    fns = {(name, mode): fn for name, attention in impls.items()
           for mode, fn in timed_functions(attention, config.causal).items()}
    fns.update({("jax_sdpa.fp8 (FP8 inputs)", mode): fn for mode, fn in
                _framework_functions(config.causal, config.head_dim ** -0.5).items()})
    inputs_of = lambda key: framework if key[0].startswith("jax_sdpa.fp8") else inputs  # noqa
    for key, fn in fns.items():  # compile and build outside the rounds
        jax.block_until_ready(fn(inputs_of(key)))
    samples = interleaved_rounds(fns, inputs_of, rounds)
    times = {key: statistics.median(s) * 1e3 for key, s in samples.items()}
    print(f"\n{config.name}: ms per call (x jax_sdpa bf16 = its time / this one's)")
    for (name, mode), ms in times.items():
        base = times[("jax_sdpa", mode)]
        flops = config.forward_flops() * (1 if mode == "fwd" else 3.5)
        print(f"| {name} | {mode} | {ms:.3f} | {flops / ms / 1e9:.0f} TFLOP/s | "
              f"{base / ms:.2f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    for config in ANCHOR_CONFIGS:
        if config.head_dim == 128 and (not args.only or config.name in args.only):
            bench(config, args.rounds)


if __name__ == "__main__":
    main()
