"""The cuDNN frontend sample "SDPA backward" (notebook 51), in JAX.

GPT-2's attention shape (b=4, h=12, s=1024, d=64), fp16, causal, scale 1/sqrt(d), tensors in
JAX's [batch, seq, heads, head_dim] layout (the sample's BSHD). The forward's float32 stats
flow to the backward inside jax.vjp; O, dQ, dK, dV are checked against a float32 reference
with the sample's tolerances (atol=5e-3, rtol=3e-3). On a machine without an NVIDIA GPU the
same flow runs through the pure-JAX path.

    python examples/seed_sdpa_backward.py
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa
from jax_sdpa.limits import device

B, H, S, D = 4, 12, 1024, 64
SCALE = 1.0 / math.sqrt(D)
ATOL, RTOL = 5e-3, 3e-3


def main():
    keys = jax.random.split(jax.random.key(42), 4)
    q, k, v, d_o = (jax.random.normal(key, (B, S, H, D), jnp.float32).astype(jnp.float16)
                    for key in keys)
    reason = device.device_reason()
    implementation = "cudnn" if reason is None else "xla"
    print(f"path: {implementation}" + (f" ({reason})" if reason else ""))

    def attention(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, scale=SCALE, is_causal=True,
                                              implementation=implementation)

    o, vjp = jax.vjp(jax.jit(attention), q, k, v)
    d_q, d_k, d_v = vjp(d_o)
    _, stats = jax_sdpa.dot_product_attention(q, k, v, scale=SCALE, is_causal=True,
                                              implementation=implementation,
                                              return_residual=True)
    print(f"stats (log-sum-exp) {stats.shape} {stats.dtype}")

    def reference(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, scale=SCALE, is_causal=True,
                                              implementation="xla")

    upcast = [x.astype(jnp.float32) for x in (q, k, v, d_o)]
    o_ref, vjp_ref = jax.vjp(jax.jit(reference), *upcast[:3])
    expected = (o_ref, *vjp_ref(upcast[3]))
    failed = False
    for name, ours, ref in zip(("O", "dQ", "dK", "dV"), (o, d_q, d_k, d_v), expected):
        ours = np.asarray(ours, np.float32)
        ref = np.asarray(ref)
        ok = np.allclose(ours, ref, atol=ATOL, rtol=RTOL)
        failed |= not ok
        print(f"{name}: max |error| {np.max(np.abs(ours - ref)):.2e}  "
              f"{'ok' if ok else 'FAILED'} (atol={ATOL}, rtol={RTOL})")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
