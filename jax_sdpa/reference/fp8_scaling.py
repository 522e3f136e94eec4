"""The FP8 recipe of dot_product_attention(fp8=True): which tensors are quantized to which
format, and with which scale. The cuDNN path (kernels/fp8.py) and the reference
(reference/fp8.py) both take their scales from here, so both round the same numbers the same
way.

Forward, per-tensor current scaling: Q, K, V in e4m3 with scale = 448 / amax (computed on the
device); the softmax weights P <= 1 with the fixed scale 448; the output, a convex combination
of V's rows (up to P's rounding), with a scale from V's amax. Backward: dO in the gradient
format (e5m2 by default) with its current scale. cuDNN's FP8 backward on Hopper writes dS and
the gradients in FP8 directly, so their scales must be known before it runs: they come from
bounds that cannot be exceeded (below), never from a guess that could saturate. The bounds are
loose (up to T x the true amax for dK and dV); e5m2's 30 binades absorb that, e4m3's 18 would
not, which is why e5m2 is the gradients' format. Amaxes are per vmapped slice: the last four
axes, [B, T, N, H].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
GRADIENT_FORMATS = ("e5m2", "e4m3")
P_SCALE = 448.0  # softmax weights are at most 1: e4m3's largest value maps onto 1
_P_ROUNDING = 1.0 + 2.0 ** -4  # how far e4m3's rounding can lift a row of weights' sum
# Headroom on every backward bound for the FP8 roundings of its operands (each under 2^-3
# relative): the bounds hold for the quantized tensors cuDNN multiplies, not just the exact ones.
_BOUND_MARGIN = 2.0
_TINY = 1e-30


def largest(fmt: str) -> float:
    return float(jnp.finfo(FORMATS[fmt]).max)


def scalar(x):
    """float32 [1, 1, 1, 1]: the shape JAX's FP8 convention gives every scale and amax."""
    return jnp.asarray(x, jnp.float32).reshape(1, 1, 1, 1)


def amax(x):
    """float32 [...]: max |x| over the last four axes (one value per vmapped slice)."""
    return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(-4, -3, -2, -1))


def _scale_for(bound, fmt):
    """The scale that maps `bound` onto the format's largest value (1 where bound is 0)."""
    return largest(fmt) / jnp.where(bound > 0, bound, 1.0)


def current_scale(x, fmt):
    """Per-slice current scaling: x's amax maps onto the format's largest value."""
    return _scale_for(amax(x), fmt)


def _expand(scale, x):
    """A per-slice scale broadcast against x [..., B, T, N, H]."""
    return scale.reshape(scale.shape + (1,) * 4)


def quantize(x, scale, fmt):
    """x * scale (scale per vmapped slice) in the format, saturating at its largest value
    (float8_e4m3fn has no infinity: an overflowing cast would be NaN)."""
    top = largest(fmt)
    scaled = x.astype(jnp.float32) * _expand(scale, x)
    return jnp.clip(scaled, -top, top).astype(FORMATS[fmt])


def dequantize(x, scale, dtype):
    return (x.astype(jnp.float32) / _expand(scale, x)).astype(dtype)


def round_trip(x, scale, fmt):
    """x as the format holds it, back in float32. The barrier keeps the rounding: XLA's GPU
    compiler otherwise drops a convert pair that only loses precision (its default
    xla_allow_excess_precision)."""
    return dequantize(jax.lax.optimization_barrier(quantize(x, scale, fmt)), scale, jnp.float32)


@dataclasses.dataclass(frozen=True)
class ForwardScales:
    """Per-slice float32 scales of the forward's quantized tensors (descale = 1 / scale)."""

    q: jnp.ndarray
    k: jnp.ndarray
    v: jnp.ndarray
    o: jnp.ndarray


def forward_scales(query, key, value) -> ForwardScales:
    v_amax = amax(value)
    return ForwardScales(q=current_scale(query, "e4m3"), k=current_scale(key, "e4m3"),
                         v=_scale_for(v_amax, "e4m3"),
                         o=_scale_for(_P_ROUNDING * jnp.maximum(v_amax, _TINY), "e4m3"))


@dataclasses.dataclass(frozen=True)
class BackwardScales:
    """Per-slice float32 scales of dO, dS (times the score scale) and the gradients."""

    d_o: jnp.ndarray
    d_s: jnp.ndarray
    dq: jnp.ndarray
    dk: jnp.ndarray
    dv: jnp.ndarray


def _largest_row_norm(x):
    """float32 [...]: the largest 2-norm of x's head_dim rows, per slice."""
    norms = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1))
    return jnp.max(norms, axis=(-3, -2, -1))


def backward_scales(query, key, value, d_output, score_scale, fmt) -> BackwardScales:
    """Scales from bounds on the backward's tensors. With M >= |dP_ij| = |dO_i . V_j| (the
    largest dO row norm times the largest V row norm), dS_ij = P_ij (dP_ij - D_i) is at most
    2 P_ij (1 - P_ij) M <= M / 2, and a row of |dS| sums to at most 2 M; a column sums over at
    most T query rows of each of the g query heads sharing a key head. So |dQ| <= s 2 M
    amax(K), |dK| <= s (M / 2) T g amax(Q) and |dV| <= T g amax(dO) (a column of P sums to at
    most T), s the score scale."""
    q_seq_len, q_heads = query.shape[-3], query.shape[-2]
    rows = q_seq_len * (q_heads // key.shape[-2])
    m = _largest_row_norm(d_output) * _largest_row_norm(value)
    d_o_amax = amax(d_output)
    bound = lambda x: _BOUND_MARGIN * x  # noqa: E731
    return BackwardScales(
        d_o=_scale_for(d_o_amax, fmt),
        d_s=_scale_for(bound(score_scale * m / 2), fmt),
        dq=_scale_for(bound(score_scale * 2 * m * amax(key)), fmt),
        dk=_scale_for(bound(score_scale * m / 2 * rows * amax(query)), fmt),
        dv=_scale_for(bound(rows * d_o_amax), fmt))
