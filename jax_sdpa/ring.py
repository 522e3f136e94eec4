"""Context-parallel (ring) attention over a sequence axis sharded with shard_map.

Each device keeps its query block; key/value blocks travel around the ring (ppermute) and the
partial outputs merge through their log-sum-exp. The backward is a ring too: it recomputes each
block's probabilities from the *global* log-sum-exp, accumulates dq locally, and lets dk/dv
travel with their key/value block back to its owner.

Status: the block kernels here are pure JAX (float32); the cuDNN block kernels, load-balanced
causal layouts (zigzag) and the GPU runs are open work (docs/NOTES.md, issue 6). Not in the
README until they are done.

    from jax.sharding import PartitionSpec as P
    fn = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq", is_causal=True),
                       mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

_FULL, _DIAGONAL, _SKIP = 0, 1, 2  # how a key/value block relates to the local query block


def _expand_heads(x, q_heads):
    return jnp.repeat(x, q_heads // x.shape[2], axis=2)


def _scores(q, k, scale, diagonal):
    s = jnp.einsum("btnh,bsnh->bnts", q, _expand_heads(k, q.shape[2]),
                   precision=lax.Precision.HIGHEST) * scale
    if diagonal:  # the block on the diagonal: causal, top-left
        t, n = s.shape[-2:]
        s = jnp.where(jnp.tril(jnp.ones((t, n), bool)), s, -jnp.inf)
    return s


def _block_forward(q, k, v, scale, kind):
    """(output float32 [B,T,N,H], lse [B,N,T]); a skipped block has lse -inf and output 0."""
    if kind == _SKIP:  # shaped from the inputs, so that they vary over the mesh axis as they do
        out = jnp.zeros_like(q[..., :1]) * jnp.zeros_like(v[:, :1, :1, :])
        lse = jnp.full_like(q[..., 0], -jnp.inf).transpose(0, 2, 1)
        return out, lse
    s = _scores(q, k, scale, kind == _DIAGONAL)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bnts,bsnh->btnh", p, _expand_heads(v, q.shape[2]),
                     precision=lax.Precision.HIGHEST)
    return out, lse


def _block_backward(q, k, v, out, lse, d_out, scale, kind):
    """This block's exact share of (dq, dk, dv), given the global output and lse."""
    if kind == _SKIP:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    b, s_len, kv_heads, h = k.shape
    groups = q.shape[2] // kv_heads
    p = jnp.exp(_scores(q, k, scale, kind == _DIAGONAL) - lse[..., None])
    hp = lax.Precision.HIGHEST
    dv = jnp.einsum("bnts,btnh->bsnh", p, d_out, precision=hp)
    dp = jnp.einsum("btnh,bsnh->bnts", d_out, _expand_heads(v, q.shape[2]), precision=hp)
    row_dot = jnp.sum(d_out * out, axis=-1).transpose(0, 2, 1)  # D = rowsum(dO * O), [B,N,T]
    ds = p * (dp - row_dot[..., None])
    dq = jnp.einsum("bnts,bsnh->btnh", ds, _expand_heads(k, q.shape[2]), precision=hp) * scale
    dk = jnp.einsum("bnts,btnh->bsnh", ds, q, precision=hp) * scale
    fold = lambda x: x.reshape(b, s_len, kv_heads, groups, x.shape[-1]).sum(3)  # noqa: E731
    return dq, fold(dk), fold(dv)


def _block_kind(axis_name, step, is_causal):
    """_FULL / _DIAGONAL / _SKIP for the block that arrives at this device at `step`."""
    if not is_causal:
        return jnp.int32(_FULL)
    me = lax.axis_index(axis_name)
    source = (me - step) % lax.axis_size(axis_name)
    return jnp.where(source == me, _DIAGONAL, jnp.where(source < me, _FULL, _SKIP))


def _ring_permutation(axis_name):
    size = lax.axis_size(axis_name)
    return [(j, (j + 1) % size) for j in range(size)]


def _ring_forward_pass(q, k, v, axis_name, is_causal, scale):
    q32, kb, vb = (x.astype(jnp.float32) for x in (q, k, v))
    out, lse = None, None
    for step in range(lax.axis_size(axis_name)):
        if step:
            kb, vb = lax.ppermute((kb, vb), axis_name, _ring_permutation(axis_name))
        branches = [functools.partial(_block_forward, scale=scale, kind=kind)
                    for kind in (_FULL, _DIAGONAL, _SKIP)]
        block_out, block_lse = lax.switch(_block_kind(axis_name, step, is_causal), branches,
                                          q32, kb, vb)
        if out is None:  # step 0 is the local block: never skipped, every row sees a key
            out, lse = block_out, block_lse
            continue
        merged = jnp.logaddexp(lse, block_lse)
        weight = lambda x: jnp.exp(x - merged).transpose(0, 2, 1)[..., None]  # noqa: E731
        out = out * weight(lse) + block_out * weight(block_lse)
        lse = merged
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring(q, k, v, axis_name, is_causal, scale):
    out, lse = _ring_forward_pass(q, k, v, axis_name, is_causal, scale)
    return out.astype(q.dtype), lse


def _ring_fwd(q, k, v, axis_name, is_causal, scale):
    out, lse = _ring_forward_pass(q, k, v, axis_name, is_causal, scale)
    return (out.astype(q.dtype), lse), (q, k, v, out, lse)


def _ring_bwd(axis_name, is_causal, scale, residuals, cotangents):
    q, k, v, out, lse = residuals
    d_out = cotangents[0].astype(jnp.float32)  # the lse carries no gradient, as elsewhere
    q32, kb, vb = (x.astype(jnp.float32) for x in (q, k, v))
    dq = jnp.zeros_like(q32)
    dk, dv = jnp.zeros_like(kb), jnp.zeros_like(vb)
    permutation = _ring_permutation(axis_name)
    for step in range(lax.axis_size(axis_name)):
        if step:  # the dk/dv accumulators travel with their key/value block
            kb, vb, dk, dv = lax.ppermute((kb, vb, dk, dv), axis_name, permutation)
        branches = [functools.partial(_block_backward, scale=scale, kind=kind)
                    for kind in (_FULL, _DIAGONAL, _SKIP)]
        block_dq, block_dk, block_dv = lax.switch(_block_kind(axis_name, step, is_causal),
                                                  branches, q32, kb, vb, out, lse, d_out)
        dq, dk, dv = dq + block_dq, dk + block_dk, dv + block_dv
    dk, dv = lax.ppermute((dk, dv), axis_name, permutation)  # home to the block's owner
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(query, key, value, *, axis_name, is_causal=False, scale=None,
                   return_residual=False):
    """Attention over a sequence split in contiguous blocks along mesh axis `axis_name`.

    Call inside shard_map with query [B, T/P, N, H] and key/value [B, S/P, K, H] blocks (T = S
    when causal; device i holds block i). Returns the local output block (and, with
    return_residual, the float32 log-sum-exp [B, T/P, N] of the global softmax rows).
    """
    if query.ndim != 4 or key.ndim != 4 or key.shape != value.shape:
        raise ValueError(f"ring_attention takes [B, T, N, H] blocks, got {query.shape}, "
                         f"{key.shape}, {value.shape}")
    if query.shape[2] % key.shape[2]:
        raise ValueError(f"query heads ({query.shape[2]}) must be a multiple of key/value heads "
                         f"({key.shape[2]})")
    if is_causal and query.shape[1] != key.shape[1]:
        raise ValueError("causal ring_attention needs equal query and key/value blocks, got "
                         f"{query.shape[1]} and {key.shape[1]}")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    out, lse = _ring(query, key, value, axis_name, bool(is_causal), scale)
    if return_residual:
        return out, lax.stop_gradient(lse).transpose(0, 2, 1)
    return out
