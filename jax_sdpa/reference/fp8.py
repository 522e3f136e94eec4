"""FP8 attention in pure JAX: cuDNN's FP8 SDPA graphs' arithmetic, each rounding where those
graphs have it, behind the kernels' calling convention (a CallSpec and inputs by name). It
is what fp8=True and jax_sdpa.fp8 compute on the XLA path, and what the cuDNN path is held to.

Forward: S = Q8 K8^T (float32 accumulation of the quantized operands) times the score scale;
P = exp(S - rowmax S) quantized to e4m3 (before normalisation, as flash attention's FP8 kernels
round it); O = P8 V8 / rowsum(P), quantized to e4m3. Backward: dP = dO8 V8^T;
D = rowsum(dO8 * O8); dS = s P (dP - D) quantized; dQ = dS8 K8, dK = dS8^T Q8, dV = P8^T dO8,
each quantized. The cores take tensors already rounded (float32) and the scales; forward and
backward below take fp8=True's bfloat16/float16 inputs and fp8_scaling.py's scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sdpa.reference import fp8_scaling as scaling
from jax_sdpa.reference.attention import combined_mask, fold_heads, large_negative, repeat_heads


def _weights(config, inputs, q, k, lse=None):
    """(P float32 [B, N, T, S], lse [B, N, T]) from rounded q [B, T, N, H], k [B, S, K, H]:
    causal (top-left) and the key lengths mask."""
    scores = jnp.einsum("btnh,bsnh->bnts", q, repeat_heads(k, q.shape[2])) * config.scale
    keep = combined_mask(q.shape[1], k.shape[1], is_causal=config.window_right == 0,
                         key_value_seq_lengths=inputs.get("kv_lengths"))
    if keep is not None:
        scores = jnp.where(keep, scores, large_negative())
    if lse is None:
        lse = jax.nn.logsumexp(scores, axis=-1)
    return jnp.exp(scores - lse[..., None]), lse


def query_rows(inputs, shape):
    """bool [B, T, 1, 1]: the query rows within their lengths (a batch entry without keys has
    none), or None without lengths."""
    q_lengths, kv_lengths = inputs.get("q_lengths"), inputs.get("kv_lengths")
    if q_lengths is None and kv_lengths is None:
        return None
    batch, q_seq_len = shape[:2]
    valid = jnp.ones((batch, q_seq_len), bool)
    if q_lengths is not None:
        valid &= jnp.arange(q_seq_len)[None, :] < q_lengths[:, None]
    if kv_lengths is not None:
        valid &= (kv_lengths > 0)[:, None]
    return valid[:, :, None, None]


def _key_rows(inputs, shape):
    kv_lengths = inputs.get("kv_lengths")
    if kv_lengths is None:
        return None
    return (jnp.arange(shape[1])[None, :] < kv_lengths[:, None])[:, :, None, None]


def _zero_outside(x, rows):
    return x if rows is None else jnp.where(rows, x, 0)


def forward_core(config, inputs, q, k, v, p_scale=scaling.P_SCALE):
    """(output float32 before its rounding, lse, amax of P): q, k, v rounded; P rounded to
    e4m3 with p_scale as flash attention's FP8 forward rounds it: a row's weights before
    their normalisation (exp(S - the row's largest score): the largest weight is 1), the
    product divided by their sum afterwards. (Rounding the normalised weights instead put
    JAX's own FP8 training tests off in 18 of 128 checks on CPU, one element each: a row's
    largest weight, in [0.5, 1), lost up to 2^-5 and its dS the sum over the row.)"""
    p, lse = _weights(config, inputs, q, k)
    largest = jnp.max(p, axis=-1, keepdims=True)  # [B, N, T, 1]
    p8 = scaling.round_trip(p / largest, jnp.asarray(p_scale, jnp.float32), "e4m3")
    out = jnp.einsum("bnts,bsnh->btnh", p8, repeat_heads(v, q.shape[2]))
    out = out * jnp.moveaxis(largest, 1, 2)
    out = _zero_outside(out, query_rows(inputs, out.shape))
    return out, lse, jnp.max(p, axis=(-4, -3, -2, -1))


def backward_core(config, inputs, q, k, v, out8, lse, d_o, d_s_scale, fmt,
                  p_scale=scaling.P_SCALE):
    """(dq, dk, dv) float32 before their rounding, and the amax of dS: q, k, v, out8 and d_o
    rounded (d_o zero past the lengths); dS is rounded to fmt with d_s_scale."""
    kv_heads = k.shape[2]
    p, _ = _weights(config, inputs, q, k, lse)
    p8 = scaling.round_trip(p, jnp.asarray(p_scale, jnp.float32), "e4m3")
    d_p = jnp.einsum("btnh,bsnh->bnts", d_o, repeat_heads(v, q.shape[2]))
    row_sums = jnp.einsum("btnh,btnh->bnt", d_o, out8)
    d_s = config.scale * p * (d_p - row_sums[..., None])
    d_s_amax = scaling.amax(d_s)
    d_s = scaling.round_trip(d_s, d_s_scale, fmt)
    dq = jnp.einsum("bnts,bsnh->btnh", d_s, repeat_heads(k, q.shape[2]))
    dk = fold_heads(jnp.einsum("bnts,btnh->bsnh", d_s, q), kv_heads)
    dv = fold_heads(jnp.einsum("bnts,btnh->bsnh", p8, d_o), kv_heads)
    keys = _key_rows(inputs, k.shape)
    return (_zero_outside(dq, query_rows(inputs, q.shape)), _zero_outside(dk, keys),
            _zero_outside(dv, keys), d_s_amax)


def _rounded_inputs(inputs):
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    scales = scaling.forward_scales(query, key, value)
    return (*(scaling.round_trip(x, s, "e4m3") for x, s in
              ((query, scales.q), (key, scales.k), (value, scales.v))), scales)


def forward(config, inputs):
    """fp8=True: (output [B, T, N, Hv] in the query's dtype, lse float32 [B, N, T])."""
    q, k, v, scales = _rounded_inputs(inputs)
    out, lse, _ = forward_core(config, inputs, q, k, v)
    out = scaling.round_trip(out, scales.o, "e4m3")
    return out.astype(inputs["query"].dtype), lse


def backward(config, inputs, output, lse, d_output):
    """fp8=True: (dq, dk, dv, None) in the inputs' dtypes, from the forward's output and
    lse."""
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    fmt = config.fp8
    q, k, v, forward_scales = _rounded_inputs(inputs)
    d_output = _zero_outside(d_output, query_rows(inputs, query.shape))
    back = scaling.backward_scales(query, key, value, d_output, config.scale, fmt)
    out8 = scaling.round_trip(output, forward_scales.o, "e4m3")
    d_o = scaling.round_trip(d_output, back.d_o, fmt)
    dq, dk, dv, _ = backward_core(config, inputs, q, k, v, out8, lse, d_o, back.d_s, fmt)
    return tuple(scaling.round_trip(g, s, fmt).astype(x.dtype)
                 for g, s, x in ((dq, back.dq, query), (dk, back.dk, key), (dv, back.dv, value))
                 ) + (None,)
