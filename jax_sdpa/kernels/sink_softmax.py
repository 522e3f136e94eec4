"""Attention sinks: one logit per query head that joins every softmax denominator and carries no
value (gpt-oss style).

No kernel needs to know about them. With Z = sum_j exp(s_ij) (a kernel's lse = log Z) and the
head's sink logit c, the sink attention's row is the plain row scaled by Z / (Z + e^c):

    output' = output * exp(lse - lse'),   lse' = logaddexp(lse, c).

A flash-attention backward given (output', lse') — P = exp(s - lse'), D = rowsum(dO * output')
— is then exactly the sink attention's backward for q, k and v, and the sink's own gradient is
d c = -sum over rows of exp(c - lse') * rowsum(dO * output'). So the sink enters once, after
every block or document of a row is merged (ring attention, packed rows), at the cost of one
elementwise pass over the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sdpa.common.varying import varying_axes


def _per_row(sinks):
    return sinks.astype(jnp.float32)[None, :, None]  # [1, N, 1] against lse [B, N, T]


def apply(output, lse, sinks):
    """(output [B, T, N, Hv], lse float32 [B, N, T]) of plain attention -> those of attention
    with sinks float [N]. A row that sees no key (lse -inf or the large negative fill) gets
    zeros: the sink takes all its weight."""
    merged = jnp.logaddexp(lse, _per_row(sinks))
    kept = jnp.exp(lse - merged).transpose(0, 2, 1)[..., None]  # Z / (Z + e^c), in [0, 1]
    return (output.astype(jnp.float32) * kept).astype(output.dtype), merged


def rows_kept(lse, sinks):
    """bool [B, T, N]: rows of a sink attention (lse its lse') that keep any weight on keys.
    The others are zeros whatever the keys: no gradient flows through them."""
    return (lse > _per_row(sinks)).transpose(0, 2, 1)


def gradient(output, lse, d_output, sinks):
    """d sinks ([N], the sinks' dtype) from the sink attention's output, lse and d_output."""
    row_dot = jnp.sum(d_output.astype(jnp.float32) * output.astype(jnp.float32), axis=-1)
    sink_weight = jnp.exp(_per_row(sinks) - lse).transpose(0, 2, 1)  # [B, T, N]
    d_sinks = -jnp.sum(sink_weight * row_dot, axis=(0, 1))
    return _sum_over_varying_axes(d_sinks, sinks).astype(sinks.dtype)


def _sum_over_varying_axes(gradient_value, primal):
    """Inside shard_map, a gradient summed over this device's rows only: add up the other
    devices' shares along every mesh axis the rows vary over and the sinks do not."""
    axes = tuple(sorted(varying_axes(gradient_value) - varying_axes(primal)))
    return jax.lax.psum(gradient_value, axes) if axes else gradient_value
