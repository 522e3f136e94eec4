"""FP8 attention in pure JAX: cuDNN's FP8 SDPA graphs' arithmetic, each rounding where those
graphs have it and with fp8_scaling.py's scales, behind the kernels' calling convention (a
KernelConfig and inputs by name). It is what fp8=True computes on the XLA path, and what the
cuDNN path is held to.

Forward: S = Q8 K8^T (float32 accumulation of the quantized operands) times the score scale;
P = softmax(S) quantized to e4m3; O = P8 V8 quantized to e4m3, returned dequantized in the
query's dtype. Backward: dP = dO8 V8^T; D = rowsum(dO8 * O8); dS = s P (dP - D) quantized;
dQ = dS8 K8, dK = dS8^T Q8, dV = P8^T dO8, each quantized and returned dequantized.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_sdpa import fp8_scaling as scaling
from jax_sdpa.reference import combined_mask, large_negative


def _expand_heads(x, heads):
    return jnp.repeat(x, heads // x.shape[2], axis=2) if x.shape[2] != heads else x


def _fold_heads(x, kv_heads):
    """[B, S, N, H] per query head -> [B, S, K, H] per key head (sums each group)."""
    batch, seq, heads, dim = x.shape
    return x.reshape(batch, seq, kv_heads, heads // kv_heads, dim).sum(3)


def _quantized_inputs(inputs):
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    scales = scaling.forward_scales(query, key, value)
    q, k, v = (scaling.round_trip(x, s, "e4m3") for x, s in
               ((query, scales.q), (key, scales.k), (value, scales.v)))
    return q, _expand_heads(k, q.shape[2]), _expand_heads(v, q.shape[2]), scales


def _keep(config, inputs, q_seq_len, kv_seq_len):
    """bool [B|1, 1, T, S]: causal (top-left) and the key lengths; None when nothing masks."""
    return combined_mask(q_seq_len, kv_seq_len, is_causal=config.window_right == 0,
                         key_value_seq_lengths=inputs.get("kv_lengths"))


def _weights(config, inputs, q, k, lse=None):
    """(P float32 [B, N, T, S], lse [B, N, T]) from the quantized q and k."""
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) * config.scale
    keep = _keep(config, inputs, q.shape[1], k.shape[1])
    if keep is not None:
        scores = jnp.where(keep, scores, large_negative())
    if lse is None:
        top = jnp.max(scores, axis=-1, keepdims=True)
        lse = (jnp.log(jnp.sum(jnp.exp(scores - top), axis=-1, keepdims=True)) + top)[..., 0]
    return jnp.exp(scores - lse[..., None]), lse


def query_rows(inputs, shape):
    """float32 mask [B, T, 1, 1] of the query rows within their lengths (a batch entry without
    keys has none), or None."""
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


def forward(config, inputs):
    """(output [B, T, N, Hv] in the query's dtype, stats float32 [B, N, T])."""
    q, k, v, scales = _quantized_inputs(inputs)
    p, lse = _weights(config, inputs, q, k)
    p8 = scaling.round_trip(p, jnp.float32(scaling.P_SCALE), "e4m3")
    out = scaling.round_trip(jnp.einsum("bnts,bsnh->btnh", p8, v), scales.o, "e4m3")
    out = _zero_outside(out, query_rows(inputs, out.shape))
    return out.astype(inputs["query"].dtype), lse


def backward(config, inputs, output, stats, d_output):
    """(dq, dk, dv, None) in the inputs' dtypes, from the forward's output and stats."""
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    fmt = config.fp8
    q, k, v, forward_scales = _quantized_inputs(inputs)
    rows = query_rows(inputs, query.shape)
    d_output = _zero_outside(d_output, rows)  # rows past the lengths have no gradient
    back = scaling.backward_scales(query, key, value, d_output, config.scale, fmt)
    p, _ = _weights(config, inputs, q, k, stats)
    p8 = scaling.round_trip(p, jnp.float32(scaling.P_SCALE), "e4m3")
    out8 = scaling.round_trip(output, forward_scales.o, "e4m3")
    d_o = scaling.round_trip(d_output, back.d_o, fmt)
    d_p = jnp.einsum("btnh,bsnh->bnts", d_o, v)
    row_sums = jnp.einsum("btnh,btnh->bnt", d_o, out8)
    d_s = scaling.round_trip(config.scale * p * (d_p - row_sums[..., None]), back.d_s, fmt)
    dq = jnp.einsum("bnts,bsnh->btnh", d_s, k)
    dk = _fold_heads(jnp.einsum("bnts,btnh->bsnh", d_s, q), key.shape[2])
    dv = _fold_heads(jnp.einsum("bnts,btnh->bsnh", p8, d_o), key.shape[2])
    dq = _zero_outside(scaling.round_trip(dq, back.dq, fmt), rows)
    dk = _zero_outside(scaling.round_trip(dk, back.dk, fmt), _key_rows(inputs, key.shape))
    dv = _zero_outside(scaling.round_trip(dv, back.dv, fmt), _key_rows(inputs, key.shape))
    return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype), None
