"""One block of context-parallel attention: a query chunk against a key/value chunk, forward and
backward, and the merge of partial results through their log-sum-exp. Both strategies of
ring_attention (ring/__init__.py: blocks travel around the ring; ring/all_gather.py: every
device gathers every block) are made of these.

The backward of a block is given the *global* output and log-sum-exp of its query rows as its
statistics: cuDNN's backward then returns that block's exact share of dq, dk, dv
(dS = P * (dP - rowsum(dO * O)) with P from the global normaliser).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from jax_sdpa.cudnn import command_buffers
from jax_sdpa.kernels import dispatch as kernels
from jax_sdpa.kernels import sink_softmax
from jax_sdpa.kernels.pieces import merge  # noqa: F401  (the ring's merge of partial results)
from jax_sdpa.call.spec import CallSpec
from jax_sdpa.reference import kernel as reference_kernel

FULL, DIAGONAL, SKIP = 0, 1, 2  # how a key/value chunk relates to a query chunk


class Scores(NamedTuple):
    """How a block's scores are formed: scale * Q K^T, then soft-capped (None: not)."""

    scale: float
    soft_cap: float | None


def split_chunks(x, parts, axis=1):
    """x cut into `parts` equal chunks along the sequence axis (the lse's is axis 2)."""
    return jnp.split(x, parts, axis=axis) if parts > 1 else [x]


def _config(implementation, scores, kind, has_lengths):
    return CallSpec(scale=scores.scale, window_right=0 if kind == DIAGONAL else -1,
                        has_lengths=has_lengths, implementation=implementation,
                        command_buffer=command_buffers.command_buffers(),
                        logits_soft_cap=scores.soft_cap or 0.0)


def _inputs(q, k, v, kv_length):
    """The kernel's inputs; kv_length (an int32 scalar, traced): only the first kv_length
    keys count (cuDNN's padding mask skips the tiles past them)."""
    inputs = dict(query=q, key=k, value=v)
    if kv_length is not None:
        batch = q.shape[0]
        inputs["q_lengths"] = jnp.full((batch,), q.shape[1], jnp.int32)
        inputs["kv_lengths"] = jnp.broadcast_to(kv_length, (batch,)).astype(jnp.int32)
    return inputs


def block_forward(implementation, scores, kind, q, k, v, kv_length=None):
    """(output float32 [B,t,N,H], lse float32 [B,N,t]) of one chunk pair; a skipped pair has
    lse -inf and output 0 (shaped from the inputs so they vary over the mesh as they do).
    With kv_length, rows that see no key (kv_length 0) come back the same way."""
    if kind == SKIP:
        out = jnp.zeros_like(q[..., :1], jnp.float32) * jnp.zeros_like(v[:, :1, :1, :],
                                                                      jnp.float32)
        lse = jnp.full_like(q[..., 0], -jnp.inf, jnp.float32).transpose(0, 2, 1)
        return out, lse
    if implementation == "xla":  # float32 blocks
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    out, lse = kernels.forward(_config(implementation, scores, kind, kv_length is not None),
                               _inputs(q, k, v, kv_length))
    out = out.astype(jnp.float32)
    if kv_length is not None:
        out = jnp.where(kv_length > 0, out, 0.0)
        lse = jnp.where(kv_length > 0, lse, -jnp.inf)
    return out, lse


def reference_block_backward(scores, kind, q, k, v, out, lse, d_out, kv_length=None):
    """The float32 reference of cuDNN's block backward under given (global) out and lse."""
    keep = None
    if kind == DIAGONAL:
        keep = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    if kv_length is not None:
        keys = jnp.arange(k.shape[1]) < kv_length
        keep = keys if keep is None else keep & keys
    return reference_kernel.backward_from_stats(scores.scale, scores.soft_cap, q, k, v, out,
                                                lse, d_out, keep)


def block_backward(implementation, scores, kind, q, k, v, out, lse, d_out, kv_length=None):
    """One chunk pair's exact share of (dq, dk, dv), float32, given the global out and lse."""
    if kind == SKIP:
        return (jnp.zeros_like(q, jnp.float32), jnp.zeros_like(k, jnp.float32),
                jnp.zeros_like(v, jnp.float32))
    if implementation == "xla":
        return reference_block_backward(scores, kind, q, k, v, out, lse, d_out, kv_length)
    dq, dk, dv, _ = kernels.backward(
        _config(implementation, scores, kind, kv_length is not None),
        _inputs(q, k, v, kv_length), out.astype(q.dtype), lse, d_out.astype(q.dtype))
    grads = tuple(x.astype(jnp.float32) for x in (dq, dk, dv))
    if kv_length is not None:  # no key seen, nothing to pass back (whatever the kernel left)
        grads = tuple(jnp.where(kv_length > 0, x, 0.0) for x in grads)
    return grads


def with_sinks(out, lse, sinks):
    """The merged rows' (out, lse) with the sinks joined once to each denominator."""
    return (out, lse) if sinks is None else sink_softmax.apply(out, lse, sinks)
