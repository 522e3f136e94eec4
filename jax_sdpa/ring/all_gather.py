"""Context parallelism by all-gathering keys and values: ring_attention(strategy="all_gather").

Every device gathers the whole sequence's keys and values over the ring axis (one all-gather
each), then attends each of its query chunks with two kernel calls: the chunk against its own
key chunk (causal, a static diagonal; this device holds that chunk already, so these kernels
need not wait for the all-gather) and against every key before it (no mask: the prefix's
length, which depends on the device, is the keys' valid length, and cuDNN's padding mask skips
every tile past it), merged through their log-sum-exp. One call over all keys with the causal
diagonal aligned bottom-right on the actual key count gives the same answer, but measured on
two H200s cuDNN 9.19 then computes the masked tiles too (0.78 of linear, against 0.92 for the
ring). Without causality each chunk is one call over all keys.

The backward is the ring's (jax_sdpa/ring/blocks.py): each piece's kernel backward given the
chunk's global output and log-sum-exp; dk, dv over the gathered sequence go home through the
all-gather's transpose, a reduce-scatter. The exchange is the whole K/V once forward and once
backward instead of P - 1 ring steps. On two H200s it beat the ring for MHA and GQA alike
(docs/PERFORMANCE.md); benchmarks/ring.py compares the two strategies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_sdpa.kernels import sink_softmax
from jax_sdpa.ring.blocks import (DIAGONAL, FULL, block_backward, block_forward, merge,
                                 split_chunks, with_sinks)


def _pieces(q_chunk, own_k, own_v, k_all, v_all, index, is_causal):
    """[(kind, keys, values, kv_length, own)] of one query chunk (global chunk index `index`,
    traced): own marks the piece over the chunk's own keys, which this device holds already,
    so that piece's kernels need not wait for the all-gather."""
    if not is_causal:
        return [(FULL, k_all, v_all, None, False)]
    before = index * q_chunk.shape[1]  # keys before the chunk
    return [(DIAGONAL, own_k, own_v, None, True), (FULL, k_all, v_all, before, False)]


def _forward(q, k, v, k_all, v_all, indices, is_causal, scores, implementation):
    parts = len(indices)
    outs, lses = [], []
    for q_chunk, own_k, own_v, index in zip(split_chunks(q, parts), split_chunks(k, parts),
                                            split_chunks(v, parts), indices):
        out = lse = None
        for kind, keys, values, kv_length, _ in _pieces(q_chunk, own_k, own_v, k_all, v_all,
                                                        index, is_causal):
            out, lse = merge(out, lse, *block_forward(implementation, scores, kind, q_chunk,
                                                      keys, values, kv_length))
        outs.append(out)
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attend(q, k, v, k_all, v_all, sinks, indices, is_causal, scores, implementation):
    return _attend_fwd(q, k, v, k_all, v_all, sinks, indices, is_causal, scores,
                       implementation)[0]


def _attend_fwd(q, k, v, k_all, v_all, sinks, indices, is_causal, scores, implementation):
    out, lse = _forward(q, k, v, k_all, v_all, indices, is_causal, scores, implementation)
    out, lse = with_sinks(out, lse, sinks)
    return (out.astype(q.dtype), lse), (q, k, v, k_all, v_all, sinks, indices, out, lse)


def _attend_bwd(is_causal, scores, implementation, residuals, cotangents):
    q, k, v, k_all, v_all, sinks, indices, out, lse = residuals
    d_out = cotangents[0]  # the lse carries no gradient, as elsewhere
    if sinks is not None:  # rows the sink took whole pass nothing back (sink_softmax.py)
        d_out = jnp.where(sink_softmax.rows_kept(lse, sinks)[..., None], d_out, 0)
    parts = len(indices)
    dq, dk_own, dv_own = [], [], []
    dk_all, dv_all = jnp.zeros_like(k_all, jnp.float32), jnp.zeros_like(v_all, jnp.float32)
    for q_chunk, own_k, own_v, out_chunk, lse_chunk, d_out_chunk, index in zip(
            *(split_chunks(x, parts) for x in (q, k, v, out)),
            split_chunks(lse, parts, axis=2), split_chunks(d_out, parts), indices):
        dq_chunk = jnp.zeros_like(q_chunk, jnp.float32)
        dk_chunk, dv_chunk = (jnp.zeros_like(own_k, jnp.float32),
                              jnp.zeros_like(own_v, jnp.float32))
        for kind, keys, values, kv_length, own in _pieces(q_chunk, own_k, own_v, k_all, v_all,
                                                          index, is_causal):
            piece_dq, piece_dk, piece_dv = block_backward(
                implementation, scores, kind, q_chunk, keys, values, out_chunk, lse_chunk,
                d_out_chunk, kv_length)
            dq_chunk = dq_chunk + piece_dq
            if own:
                dk_chunk, dv_chunk = dk_chunk + piece_dk, dv_chunk + piece_dv
            else:
                dk_all, dv_all = dk_all + piece_dk, dv_all + piece_dv
        dq.append(dq_chunk)
        dk_own.append(dk_chunk)
        dv_own.append(dv_chunk)
    d_sinks = None if sinks is None else sink_softmax.gradient(out, lse, d_out, sinks)
    cast = lambda chunks, like: jnp.concatenate(chunks, axis=1).astype(like.dtype)  # noqa: E731
    return (cast(dq, q), cast(dk_own, k), cast(dv_own, v), dk_all.astype(k_all.dtype),
            dv_all.astype(v_all.dtype), d_sinks, None)  # indices: integers, no gradient


_attend.defvjp(_attend_fwd, _attend_bwd)


def all_gather_attention(q, k, v, sinks, axis_name, is_causal, scores, chunk_indices,
                         unpermute, implementation):
    """(output, lse [B, N, T_local]) of this device's query chunks against every device's keys.

    chunk_indices: the global index of each local query chunk (traced), in local order;
    unpermute: puts the gathered sequence (device order) back into sequence order."""
    k_all = unpermute(lax.all_gather(k, axis_name, axis=1, tiled=True))
    v_all = unpermute(lax.all_gather(v, axis_name, axis=1, tiled=True))
    indices = jnp.stack([jnp.asarray(i, jnp.int32) for i in chunk_indices])
    return _attend(q, k, v, k_all, v_all, sinks, indices, is_causal, scores, implementation)
