"""FP8 attention in pure JAX: the quantize -> attention -> dequantize semantics of cuDNN's FP8
SDPA graphs, each rounding where those graphs have it, so that an FP8 call means the same
numbers in distribution on every platform (and the cuDNN path has a reference to be held to).

Forward, per tensor current scaling (scale = the format's largest value / the tensor's amax,
computed on the device): Q, K, V in e4m3; S = Q K^T (float32 accumulation) times the descales
and the score scale; P = softmax(S) in float32, quantized to e4m3 with the fixed scale 448
(P <= 1); O = P V times the descales, quantized to e4m3 with a scale from V's amax (a convex
combination of V's rows, up to P's rounding, cannot exceed it), and returned dequantized.
Backward: dO quantized (grad_format, e5m2 by default: its range); dP = dO V^T; dS = P (dP - D),
D the row sums of dO * O; dS quantized (grad_format, current scaling); dQ = dS K, dK = dS^T Q,
dV = P^T dO (float32 accumulation of the quantized operands), each quantized to grad_format
and returned dequantized. Quantizing saturates (float8_e4m3fn has no infinity: an overflowing
cast would be NaN).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_sdpa.reference import combined_mask, large_negative

FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
_P_SCALE = 448.0  # softmax weights are at most 1: e4m3's largest value maps onto 1
_P_ROUNDING = 1.0 + 2.0 ** -4  # how far e4m3's rounding can lift a row of weights' sum


def largest(fmt: str) -> float:
    return float(jnp.finfo(FORMATS[fmt]).max)


def quantize(x, scale, fmt):
    """x * scale rounded to the format, saturating at its largest value."""
    top = largest(fmt)
    return jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(FORMATS[fmt])


def current_scale(x, fmt):
    """float32 []: the format's largest value over x's amax (1 for a tensor of zeros)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    return largest(fmt) / jnp.where(amax > 0, amax, 1.0)


def round_trip(x, scale, fmt):
    """x as the format holds it, back in float32: quantize then dequantize."""
    return quantize(x, scale, fmt).astype(jnp.float32) / scale


def _scaled(x, fmt):
    return round_trip(x, current_scale(x, fmt), fmt)


def _expand_heads(x, heads):
    return jnp.repeat(x, heads // x.shape[2], axis=2) if x.shape[2] != heads else x


def _scores(q, k, scale, is_causal):
    """float32 [B, N, T, S] scaled scores of already rounded q [B, T, N, H], k [B, S, N, H];
    causal: top-left, as jax.nn's."""
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    if is_causal:
        keep = combined_mask(*scores.shape[-2:], is_causal=True)
        scores = jnp.where(keep, scores, large_negative())
    return scores


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def attention(query, key, value, scale, is_causal=False, grad_format="e5m2"):
    """FP8 attention of query [B, T, N, H], key [B, S, K, H], value [B, S, K, Hv] (any float
    dtype; K divides N) with the score scale `scale`: the output [B, T, N, Hv] in the query's
    dtype. grad_format: "e5m2" or "e4m3", the backward's operands and gradients."""
    return _forward(query, key, value, scale, is_causal, grad_format)[0]


def _forward(query, key, value, scale, is_causal, grad_format):
    heads = query.shape[2]
    q, k, v = _scaled(query, "e4m3"), _scaled(key, "e4m3"), _scaled(value, "e4m3")
    scores = _scores(q, _expand_heads(k, heads), scale, is_causal)
    lse = jax.nn.logsumexp(scores, axis=-1)
    p8 = round_trip(jnp.exp(scores - lse[..., None]), _P_SCALE, "e4m3")
    out = jnp.einsum("bnts,bsnh->btnh", p8, _expand_heads(v, heads))
    out_scale = largest("e4m3") / (_P_ROUNDING * jnp.maximum(jnp.max(jnp.abs(v)), 1e-30))
    out = round_trip(out, out_scale, "e4m3")
    # (empty arrays carry the inputs' dtypes to the backward)
    dtypes = tuple(jnp.zeros((0,), x.dtype) for x in (query, key, value))
    return out.astype(query.dtype), (q, k, v, out, lse, dtypes)


def _backward(scale, is_causal, grad_format, residuals, d_out):
    q, k, v, out, lse, dtypes = residuals
    heads, kv_heads = q.shape[2], k.shape[2]
    k_full, v_full = _expand_heads(k, heads), _expand_heads(v, heads)
    p = jnp.exp(_scores(q, k_full, scale, is_causal) - lse[..., None])
    p8 = round_trip(p, _P_SCALE, "e4m3")
    d_o = _scaled(d_out, grad_format)
    d_p = jnp.einsum("btnh,bsnh->bnts", d_o, v_full)
    row_sums = jnp.einsum("btnh,btnh->bnt", d_o, out)
    d_s = _scaled(p * (d_p - row_sums[..., None]), grad_format)
    dq = jnp.einsum("bnts,bsnh->btnh", d_s, k_full) * scale
    dk = jnp.einsum("bnts,btnh->bsnh", d_s, q) * scale
    dv = jnp.einsum("bnts,btnh->bsnh", p8, d_o)
    if kv_heads != heads:  # a shared key/value head gathers its query heads' gradients
        fold = lambda x: x.reshape(*x.shape[:2], kv_heads, heads // kv_heads,  # noqa: E731
                                   x.shape[-1]).sum(3)
        dk, dv = fold(dk), fold(dv)
    return tuple(_scaled(g, grad_format).astype(x.dtype) for g, x in zip((dq, dk, dv), dtypes))


attention.defvjp(_forward, _backward)
