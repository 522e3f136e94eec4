"""Probe (GPU): JAX's fused FP8 inference test (tests/fused_attention_stablehlo_test.py,
test_sdpa_fp8_inference) over its whole parameter product, with JAX's own cuDNN FP8 path and
jax_sdpa.fp8 on the same inputs. Per case: the largest error of each against the test's
reference (JAX's non-FP8 attention on the FP8-representable inputs) and the elements past
atol = rtol = 0.05 and 0.08 (the test's tolerances in JAX's versions), and the largest
difference between the two FP8 paths. Prints, does not assert: it says whether an element
past the tolerance is ours or FP8's (scales of 1 round the output and the softmax weights to
e4m3 as they are).

    python scripts/probe_fp8_inference.py [--all]

Without --all, the product's cases of 32,768 elements (B = 4, T = 16, N = 16, H = 32: the size
of the one that missed with jax_sdpa.fp8 swapped in); with it, all 128 (three compiles each).
"""

from __future__ import annotations

import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as jax_cudnn

import jax_sdpa.fp8

_PRODUCT = dict(batch=[4, 2], seq=[4, 16], heads=[4, 16], head_dim=[16, 32],
                layout=["BNTH", "BTNH"], scale=[1.0, 0.75], dtype=[jnp.bfloat16, jnp.float16])
_TOLERANCES = (0.05, 0.08)


def _inputs(batch, seq, heads, head_dim, layout, dtype):
    shape = ((batch, heads, seq, head_dim) if layout == "BNTH" else
             (batch, seq, heads, head_dim))
    keys = jax.random.split(jax.random.key(0), 3)
    # representable in e4m3, as the test makes them: its reference sees the FP8 values
    return [jax.random.normal(k, shape, dtype).astype(jnp.float8_e4m3fn) for k in keys]


def _past(out, ref, tolerance):
    return int(np.sum(np.abs(out - ref) > tolerance + tolerance * np.abs(ref)))


def _case(batch, seq, heads, head_dim, layout, scale, dtype):
    q8, k8, v8 = _inputs(batch, seq, heads, head_dim, layout, dtype)
    ones = {name: jnp.ones((1, 1, 1, 1), jnp.float32) for name in jax_sdpa.fp8.FP8_PARAMS}
    options = dict(scale=scale, mask_type=jax_cudnn.MaskType.NO_MASK, qkv_layout=layout)
    ref = jax.jit(lambda q, k, v: jax_cudnn.dot_product_attention(q, k, v, **options))(
        *(x.astype(dtype) for x in (q8, k8, v8)))
    theirs = jax.jit(lambda q, k, v, p: jax_cudnn.dot_product_attention(
        q, k, v, fp8_params=p, use_fp8=True, **options)[0])(q8, k8, v8, ones)
    ours = jax.jit(lambda q, k, v, p: jax_sdpa.fp8.dot_product_attention(
        q, k, v, fp8_params=p, **options)[0])(q8, k8, v8, ones)
    ref, theirs, ours = (np.asarray(x.astype(dtype), np.float32) for x in (ref, theirs, ours))
    return dict(jax_err=float(np.abs(theirs - ref).max()), ours_err=float(np.abs(ours - ref).max()),
                ours_vs_jax=float(np.abs(ours - theirs).max()),
                past={t: (_past(theirs, ref, t), _past(ours, ref, t)) for t in _TOLERANCES},
                elements=ref.size)


def main():
    print(f"jax {jax.__version__}, cuDNN {jax_sdpa.cudnn_version()}, "
          f"{jax.devices()[0].device_kind}")
    print("| B | T | N | H | layout | scale | dtype | max err JAX fp8 | max err jax_sdpa.fp8 | "
          "max ours - JAX | past 0.05 (JAX, ours) | past 0.08 (JAX, ours) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    totals = {t: [0, 0] for t in _TOLERANCES}
    product = dict(_PRODUCT) if "--all" in sys.argv[1:] else dict(
        _PRODUCT, batch=[4], seq=[16], heads=[16], head_dim=[32])
    for values in itertools.product(*product.values()):
        case = dict(zip(product, values))
        result = _case(**case)
        for t, (theirs, ours) in result["past"].items():
            totals[t][0] += theirs
            totals[t][1] += ours
        print(f"| {' | '.join(str(getattr(v, '__name__', v)) for v in values)} | "
              f"{result['jax_err']:.3f} | {result['ours_err']:.3f} | {result['ours_vs_jax']:.3f} | "
              + " | ".join(f"{a}, {b}" for a, b in result["past"].values()) + " |", flush=True)
    for t, (theirs, ours) in totals.items():
        print(f"elements past atol = rtol = {t}: JAX's FP8 path {theirs}, jax_sdpa.fp8 {ours}")


if __name__ == "__main__":
    main()
