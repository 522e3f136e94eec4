"""fp8_params for jax_sdpa.fp8 built the way a framework with current scaling would: inputs
quantized per tensor, the backward's scales from the amaxes of a float32 reference run."""

import jax
import jax.numpy as jnp

from jax_sdpa import fp8


def scalar(x):
    return jnp.asarray(x, jnp.float32).reshape(1, 1, 1, 1)


def quantized_problem(q, k, v, d_out, *, causal, scale):
    """(q8, k8, v8, d_out8, fp8_params, float32 (out, dq, dk, dv) on the same inputs)."""
    (q8, dq_), (k8, dk_), (v8, dv_), (do8, ddo) = (fp8.quantize(x) for x in (q, k, v, d_out))
    up = [x.astype(jnp.float32) for x in (q, k, v, d_out)]

    def exact(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal)
    out, vjp = jax.vjp(exact, *up[:3])
    grads = vjp(up[3])
    top = 448.0
    amax = lambda x: jnp.max(jnp.abs(x))  # noqa: E731
    scale_o = top / amax(out)
    # dS's amax from float32: s P (dP - D), recomputed here as JAX's FP8 users measure it
    scores = jnp.einsum("btnh,bsnh->bnts", up[0], jnp.repeat(up[1], q.shape[2] // k.shape[2], 2))
    scores = scores * scale
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones(scores.shape[-2:], bool)), scores, -1e30)
    p = jax.nn.softmax(scores, axis=-1)
    d_p = jnp.einsum("btnh,bsnh->bnts", up[3], jnp.repeat(up[2], q.shape[2] // k.shape[2], 2))
    d_s = scale * p * (d_p - jnp.sum(p * d_p, -1, keepdims=True))
    scale_dp = top / amax(d_s)
    params = dict(descale_q=dq_, descale_k=dk_, descale_v=dv_, descale_s=scalar(1 / top),
                  scale_s=scalar(top), scale_o=scalar(scale_o), descale_o=scalar(1 / scale_o),
                  descale_dO=ddo, descale_dP=scalar(1 / scale_dp), scale_dP=scalar(scale_dp),
                  scale_dQ=scalar(top / amax(grads[0])), scale_dK=scalar(top / amax(grads[1])),
                  scale_dV=scalar(top / amax(grads[2])),
                  amax_dQ=scalar(0), amax_dK=scalar(0), amax_dV=scalar(0), amax_dP=scalar(0))
    return q8, k8, v8, do8, params, (out, *grads)
