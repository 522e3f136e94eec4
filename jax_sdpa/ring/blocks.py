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
from jax import lax

from jax_sdpa.cudnn import command_buffers
from jax_sdpa.kernels import dispatch as kernels
from jax_sdpa.kernels import sink_softmax
from jax_sdpa.call.spec import CallSpec
from jax_sdpa.reference.attention import fold_heads, repeat_heads

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
    scale, soft_cap = scores
    q, k, v, out, d_out = (x.astype(jnp.float32) for x in (q, k, v, out, d_out))
    kv_heads = k.shape[2]
    expand = lambda x: repeat_heads(x, q.shape[2])  # noqa: E731
    hp = lax.Precision.HIGHEST
    logits = jnp.einsum("btnh,bsnh->bnts", q, expand(k), precision=hp) * scale
    capped = None
    if soft_cap:
        capped = jnp.tanh(logits / soft_cap)
        logits = soft_cap * capped
    if kind == DIAGONAL:
        t, n = logits.shape[-2:]
        logits = jnp.where(jnp.tril(jnp.ones((t, n), bool)), logits, -jnp.inf)
    if kv_length is not None:
        logits = jnp.where(jnp.arange(k.shape[1]) < kv_length, logits, -jnp.inf)
    p = jnp.exp(logits - lse[..., None])
    dv = jnp.einsum("bnts,btnh->bsnh", p, d_out, precision=hp)
    dp = jnp.einsum("btnh,bsnh->bnts", d_out, expand(v), precision=hp)
    row_dot = jnp.sum(d_out * out, axis=-1).transpose(0, 2, 1)  # D = rowsum(dO * O), [B,N,T]
    ds = p * (dp - row_dot[..., None])
    if capped is not None:  # d(cap * tanh(x / cap)) / dx
        ds = ds * (1.0 - capped * capped)
    dq = jnp.einsum("bnts,bsnh->btnh", ds, expand(k), precision=hp) * scale
    dk = jnp.einsum("bnts,btnh->bsnh", ds, q, precision=hp) * scale
    return dq, fold_heads(dk, kv_heads), fold_heads(dv, kv_heads)


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


def merge(out, lse, block_out, block_lse):
    """Two partial results of the same query rows as one: weighted by their log-sum-exps."""
    if out is None:
        return block_out, block_lse
    merged = jnp.logaddexp(lse, block_lse)
    # Rows that no block has reached yet have lse -inf on both sides: keep them at 0.
    safe = jnp.where(jnp.isneginf(merged), 0.0, merged)
    weight = lambda x: jnp.exp(x - safe).transpose(0, 2, 1)[..., None]  # noqa: E731
    return out * weight(lse) + block_out * weight(block_lse), merged


def with_sinks(out, lse, sinks):
    """The merged rows' (out, lse) with the sinks joined once to each denominator."""
    return (out, lse) if sinks is None else sink_softmax.apply(out, lse, sinks)
