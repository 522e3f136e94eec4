"""Context parallelism by all-gathering keys and values: ring_attention(strategy="all_gather").

Every device gathers the whole sequence's keys and values over the ring axis (one all-gather
each), then attends its own query chunks to them in one kernel call per chunk. Causal: a chunk
at global chunk index c (of size t) sees keys 0 .. (c + 1) t - 1; the call passes that count as
the keys' valid length with the causal diagonal aligned bottom-right, which cuDNN measures from
each batch entry's actual lengths, so the kernel skips every tile past the chunk and the work
is the chunk's share of the causal triangle. With layout="zigzag" device d's chunks d and
2P-1-d together do the same work on every device.

The backward is autodiff's: the kernels' backward gives dk, dv over the gathered sequence and
the all-gather's transpose reduce-scatters them home. The exchange is the whole K/V once
forward and once backward instead of P - 1 ring steps: cheap where K/V are small against Q
(GQA), and in one piece that XLA can overlap with other work. benchmarks/ring.py compares it
with the ring.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_sdpa import _ffi, kernels
from jax_sdpa import sinks as sinks_lib
from jax_sdpa.kernel_config import KernelConfig


def _config(implementation, scores, is_causal, has_sinks):
    return KernelConfig(scale=scores.scale, window_right=0 if is_causal else -1,
                        bottom_right=is_causal, has_lengths=is_causal, has_sinks=has_sinks,
                        implementation=implementation, command_buffer=_ffi.command_buffers(),
                        logits_soft_cap=scores.soft_cap or 0.0)


def _inputs(q, k, v, visible_keys, sinks):
    inputs = dict(query=q, key=k, value=v)
    if visible_keys is not None:
        batch = q.shape[0]
        inputs["q_lengths"] = jnp.full((batch,), q.shape[1], jnp.int32)
        inputs["kv_lengths"] = jnp.broadcast_to(visible_keys, (batch,)).astype(jnp.int32)
    if sinks is not None:
        inputs["sinks"] = sinks
    return inputs


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _chunk_attention(q, k, v, visible_keys, sinks, is_causal, scores, implementation):
    """(output [B, t, N, Hv], lse float32 [B, N, t]) of one query chunk over the gathered keys
    (the first visible_keys of them when causal)."""
    return _chunk_fwd(q, k, v, visible_keys, sinks, is_causal, scores, implementation)[0]


def _chunk_fwd(q, k, v, visible_keys, sinks, is_causal, scores, implementation):
    config = _config(implementation, scores, is_causal, sinks is not None)
    inputs = _inputs(q, k, v, visible_keys if is_causal else None, sinks)
    out, lse = kernels.forward(config, inputs)
    return (out, lse), (inputs, out, lse)


def _chunk_bwd(is_causal, scores, implementation, residuals, cotangents):
    inputs, out, lse = residuals
    d_out = cotangents[0]  # the lse carries no gradient
    sinks = inputs.get("sinks")
    config = _config(implementation, scores, is_causal, sinks is not None)
    if sinks is not None:  # rows the sink took whole pass nothing back (jax_sdpa/sinks.py)
        d_out = jnp.where(sinks_lib.rows_kept(lse, sinks)[..., None], d_out, 0)
    dq, dk, dv, _ = kernels.backward(config, inputs, out, lse, d_out.astype(out.dtype))
    d_sinks = None if sinks is None else sinks_lib.gradient(out, lse, d_out, sinks)
    return dq, dk, dv, None, d_sinks  # visible_keys: an integer, no gradient


_chunk_attention.defvjp(_chunk_fwd, _chunk_bwd)


def all_gather_attention(q, k, v, sinks, axis_name, is_causal, scores, chunk_indices,
                         unpermute, implementation):
    """(output, lse [B, N, T_local]) of this device's query chunks against every device's keys.

    chunk_indices: the global index of each local query chunk (traced), in local order;
    unpermute: puts the gathered sequence (device order) back into sequence order."""
    k_all = unpermute(lax.all_gather(k, axis_name, axis=1, tiled=True))
    v_all = unpermute(lax.all_gather(v, axis_name, axis=1, tiled=True))
    parts = len(chunk_indices)
    q_chunks = jnp.split(q, parts, axis=1) if parts > 1 else [q]
    chunk = q.shape[1] // parts
    outs, lses = [], []
    for q_chunk, index in zip(q_chunks, chunk_indices):
        visible = (index + 1) * chunk
        out, lse = _chunk_attention(q_chunk, k_all, v_all, visible, sinks, is_causal, scores,
                                    implementation)
        outs.append(out)
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)
