"""Context parallelism by all-gathering keys and values: ring_attention(strategy="all_gather").

Every device gathers the whole sequence's keys and values over the ring axis (one all-gather
each), then attends each of its query chunks with two kernel calls: the chunk against its own
key chunk (causal, a static diagonal) and against every key before it (no mask: the prefix's
length, which depends on the device, is the keys' valid length, and cuDNN's padding mask skips
every tile past it), merged through their log-sum-exp. One call over all keys with the causal
diagonal aligned bottom-right on the actual key count gives the same answer, but measured on
two H200s cuDNN 9.19 then computes the masked tiles too (2026-11-30: 0.78 of linear, against
0.92 for the ring). Without causality each chunk is one call over all keys.

The backward is the ring's (jax_sdpa/ring_blocks.py): each piece's kernel backward given the
chunk's global output and log-sum-exp; dk, dv over the gathered sequence go home through the
all-gather's transpose, a reduce-scatter. The exchange is the whole K/V once forward and once
backward instead of P - 1 ring steps: cheap where K/V are small against Q (GQA).
benchmarks/ring.py compares the two strategies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_sdpa import sinks as sinks_lib
from jax_sdpa.ring_blocks import (DIAGONAL, FULL, block_backward, block_forward, merge,
                                 with_sinks)


def _pieces(q_chunk, k_all, v_all, index, is_causal):
    """[(kind, key/value chunk, kv_length, where the keys start)] of one query chunk (global
    chunk index `index`, traced) against the gathered keys."""
    if not is_causal:
        return [(FULL, k_all, v_all, None, None)]
    size = q_chunk.shape[1]
    start = index * size
    own = lambda x: lax.dynamic_slice_in_dim(x, start, size, axis=1)  # noqa: E731
    return [(DIAGONAL, own(k_all), own(v_all), None, start),
            (FULL, k_all, v_all, start, None)]  # the keys before the chunk


def _forward(q, k_all, v_all, indices, is_causal, scores, implementation):
    parts = len(indices)
    outs, lses = [], []
    for q_chunk, index in zip(jnp.split(q, parts, axis=1), indices):
        out = lse = None
        for kind, k, v, kv_length, _ in _pieces(q_chunk, k_all, v_all, index, is_causal):
            out, lse = merge(out, lse, *block_forward(implementation, scores, kind, q_chunk, k,
                                                      v, kv_length))
        outs.append(out)
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attend(q, k_all, v_all, sinks, indices, is_causal, scores, implementation):
    out, lse = _forward(q, k_all, v_all, indices, is_causal, scores, implementation)
    out, lse = with_sinks(out, lse, sinks)
    return out.astype(q.dtype), lse


def _attend_fwd(q, k_all, v_all, sinks, indices, is_causal, scores, implementation):
    out, lse = _forward(q, k_all, v_all, indices, is_causal, scores, implementation)
    out, lse = with_sinks(out, lse, sinks)
    return (out.astype(q.dtype), lse), (q, k_all, v_all, sinks, indices, out, lse)


def _attend_bwd(is_causal, scores, implementation, residuals, cotangents):
    q, k_all, v_all, sinks, indices, out, lse = residuals
    d_out = cotangents[0]  # the lse carries no gradient, as elsewhere
    if sinks is not None:  # rows the sink took whole pass nothing back (jax_sdpa/sinks.py)
        d_out = jnp.where(sinks_lib.rows_kept(lse, sinks)[..., None], d_out, 0)
    parts = len(indices)
    split = lambda x, axis=1: jnp.split(x, parts, axis=axis)  # noqa: E731
    dq = []
    dk, dv = jnp.zeros_like(k_all, jnp.float32), jnp.zeros_like(v_all, jnp.float32)
    for q_chunk, out_chunk, lse_chunk, d_out_chunk, index in zip(
            split(q), split(out), split(lse, 2), split(d_out), indices):
        dq_chunk = jnp.zeros_like(q_chunk, jnp.float32)
        for kind, k, v, kv_length, start in _pieces(q_chunk, k_all, v_all, index, is_causal):
            piece_dq, piece_dk, piece_dv = block_backward(
                implementation, scores, kind, q_chunk, k, v, out_chunk, lse_chunk,
                d_out_chunk, kv_length)
            dq_chunk = dq_chunk + piece_dq
            if start is None:  # the piece's keys are all the keys
                dk, dv = dk + piece_dk, dv + piece_dv
            else:  # its own key chunk
                dk, dv = (lax.dynamic_update_slice_in_dim(
                    total, lax.dynamic_slice_in_dim(total, start, piece.shape[1], axis=1) + piece,
                    start, axis=1) for total, piece in ((dk, piece_dk), (dv, piece_dv)))
        dq.append(dq_chunk)
    d_sinks = None if sinks is None else sinks_lib.gradient(out, lse, d_out, sinks)
    return (jnp.concatenate(dq, axis=1).astype(q.dtype), dk.astype(k_all.dtype),
            dv.astype(v_all.dtype), d_sinks, None)  # indices: integers, no gradient


_attend.defvjp(_attend_fwd, _attend_bwd)


def all_gather_attention(q, k, v, sinks, axis_name, is_causal, scores, chunk_indices,
                         unpermute, implementation):
    """(output, lse [B, N, T_local]) of this device's query chunks against every device's keys.

    chunk_indices: the global index of each local query chunk (traced), in local order;
    unpermute: puts the gathered sequence (device order) back into sequence order."""
    k_all = unpermute(lax.all_gather(k, axis_name, axis=1, tiled=True))
    v_all = unpermute(lax.all_gather(v, axis_name, axis=1, tiled=True))
    indices = jnp.stack([jnp.asarray(i, jnp.int32) for i in chunk_indices])
    return _attend(q, k_all, v_all, sinks, indices, is_causal, scores, implementation)
