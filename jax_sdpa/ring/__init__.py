"""Context-parallel (ring) attention over a sequence axis sharded with shard_map.

Each device keeps its query block; key/value blocks travel around the ring (ppermute, issued a
step ahead so XLA can overlap it with the current block's attention) and the partial outputs
merge through their log-sum-exp. The backward is a ring too: cuDNN's backward of one key/value
block, given the *global* output and log-sum-exp as its statistics, is that block's exact share
of dq, dk, dv (dS = P * (dP - rowsum(dO * O)) with P from the global normaliser), so dq
accumulates locally while dk/dv travel with their block back to its owner.

Causal load balance: with layout="zigzag" device d holds sequence chunks d and 2P-1-d (of 2P),
so every device does the same work at every step (zigzag_permute puts a sequence in that order,
zigzag_unpermute takes it back). layout="contiguous" is the plain split: device d waits idle on
the blocks after its own.

strategy="all_gather" gathers every block once instead (jax_sdpa/ring/all_gather.py); the
blocks' kernels and their merge are shared (jax_sdpa/ring/blocks.py).

    from jax.sharding import PartitionSpec as P
    fn = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq", is_causal=True),
                       mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_sdpa.call import planning, validation
from jax_sdpa.call.spec import checked_scale, checked_soft_cap
from jax_sdpa.kernels import sink_softmax
from jax_sdpa.limits import dense, device
from jax_sdpa.ring import all_gather as ring_all_gather
from jax_sdpa.ring.blocks import (DIAGONAL, FULL, SKIP, Scores, block_backward, block_forward,
                                 merge, split_chunks, with_sinks)

LAYOUTS = ("contiguous", "zigzag")
STRATEGIES = ("ring", "all_gather")


def _chunks(layout, device, size):
    """Global indices of the sequence chunks a device holds, in local order."""
    if layout == "zigzag":
        return [device, 2 * size - 1 - device]
    return [device]


def _kind(query_chunk, key_chunk, is_causal):
    if not is_causal:
        return jnp.int32(FULL)
    return jnp.where(key_chunk == query_chunk, DIAGONAL,
                     jnp.where(key_chunk < query_chunk, FULL, SKIP))


def _switch(kind, implementation, scores, block_fn, *args):
    branches = [functools.partial(block_fn, implementation, scores, k)
                for k in (FULL, DIAGONAL, SKIP)]
    return lax.switch(kind, branches, *args)


def _ring_permutation(axis_name):
    size = lax.axis_size(axis_name)
    return [(j, (j + 1) % size) for j in range(size)]


def _ring_forward_pass(q, k, v, axis_name, is_causal, scores, layout, implementation):
    size, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    parts = len(_chunks(layout, 0, 1))
    q_chunks = split_chunks(q, parts)
    outs, lses = [None] * parts, [None] * parts
    kb, vb = k, v
    for step in range(size):
        # Issued before this step's attention, which does not need it: XLA may overlap them.
        following = (lax.ppermute((kb, vb), axis_name, _ring_permutation(axis_name))
                     if step + 1 < size else None)
        source = (me - step) % size
        for i, (q_chunk, q_index) in enumerate(zip(q_chunks, _chunks(layout, me, size))):
            for k_chunk, v_chunk, k_index in zip(split_chunks(kb, parts),
                                                  split_chunks(vb, parts),
                                                  _chunks(layout, source, size)):
                block = _switch(_kind(q_index, k_index, is_causal), implementation, scores,
                                block_forward, q_chunk, k_chunk, v_chunk)
                outs[i], lses[i] = merge(outs[i], lses[i], *block)
        if following is not None:
            kb, vb = following
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)


def _ring_backward_pass(q, k, v, out, lse, d_out, axis_name, is_causal, scores, layout,
                        implementation):
    size, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    parts = len(_chunks(layout, 0, 1))
    q_chunks, out_chunks, d_out_chunks = (split_chunks(x, parts) for x in (q, out, d_out))
    lse_chunks = split_chunks(lse, parts, axis=2)
    dq = [jnp.zeros_like(c, jnp.float32) for c in q_chunks]
    kb, vb = k, v
    dk, dv = jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)
    permutation = _ring_permutation(axis_name)
    for step in range(size):
        following = lax.ppermute((kb, vb), axis_name, permutation) if step + 1 < size else None
        source = (me - step) % size
        dk_chunks, dv_chunks = split_chunks(dk, parts), split_chunks(dv, parts)
        for j, (k_chunk, v_chunk, k_index) in enumerate(zip(
                split_chunks(kb, parts), split_chunks(vb, parts),
                _chunks(layout, source, size))):
            for i, q_index in enumerate(_chunks(layout, me, size)):
                block_dq, block_dk, block_dv = _switch(
                    _kind(q_index, k_index, is_causal), implementation, scores, block_backward,
                    q_chunks[i], k_chunk, v_chunk, out_chunks[i], lse_chunks[i],
                    d_out_chunks[i])
                dq[i] = dq[i] + block_dq
                dk_chunks[j] = dk_chunks[j] + block_dk
                dv_chunks[j] = dv_chunks[j] + block_dv
        dk, dv = jnp.concatenate(dk_chunks, axis=1), jnp.concatenate(dv_chunks, axis=1)
        # The dk/dv accumulators travel with their key/value block (home after the last step).
        dk, dv = lax.ppermute((dk, dv), axis_name, permutation)
        if following is not None:
            kb, vb = following
    return jnp.concatenate(dq, axis=1), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ring(q, k, v, sinks, axis_name, is_causal, scores, layout, implementation):
    out, lse = _ring_forward_pass(q, k, v, axis_name, is_causal, scores, layout, implementation)
    out, lse = with_sinks(out, lse, sinks)
    return out.astype(q.dtype), lse


def _ring_fwd(q, k, v, sinks, axis_name, is_causal, scores, layout, implementation):
    out, lse = _ring_forward_pass(q, k, v, axis_name, is_causal, scores, layout, implementation)
    out, lse = with_sinks(out, lse, sinks)
    return (out.astype(q.dtype), lse), (q, k, v, sinks, out, lse)


def _ring_bwd(axis_name, is_causal, scores, layout, implementation, residuals, cotangents):
    q, k, v, sinks, out, lse = residuals
    d_out = cotangents[0]  # the lse carries no gradient, as elsewhere
    # Given the sink attention's out and lse, each block's backward is its exact share
    # (jax_sdpa/kernels/sink_softmax.py); rows the sink took whole pass nothing back.
    if sinks is not None:
        d_out = jnp.where(sink_softmax.rows_kept(lse, sinks)[..., None], d_out, 0)
    dq, dk, dv = _ring_backward_pass(q, k, v, out, lse, d_out, axis_name, is_causal, scores,
                                     layout, implementation)
    d_sinks = None if sinks is None else sink_softmax.gradient(out, lse, d_out, sinks)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_sinks


_ring.defvjp(_ring_fwd, _ring_bwd)


def _mesh_platform(x):
    """The platform of the mesh x is sharded over inside shard_map ("cpu", "gpu", ...), or
    None where this JAX does not say."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    device = getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None)


def _implementation(query, key, value, requested, q_block, kv_block, logits_soft_cap):
    """"cudnn" where the block attention (forward and backward) can run there, else "xla":
    decided, warned about or refused as dot_product_attention decides
    (jax_sdpa/call/planning.py)."""
    reason = device.device_reason()
    platform = _mesh_platform(query)
    if reason is None and platform not in (None, "gpu", "cuda"):
        reason = f"the ring's mesh is on {platform} devices"
    reason = reason or dense.kernel_reason(query.dtype, (("head_dim", query.shape[-1]),
                                                            ("value head_dim", value.shape[-1])))
    reason = reason or dense.soft_cap_reason(logits_soft_cap)
    reason = reason or dense.backward_reason(q_block, kv_block, query.shape[-1],
                                                value.shape[-1], logits_soft_cap)
    return "cudnn" if planning.use_cudnn(reason, requested, query.dtype,
                                                "this ring attention") else "xla"


def ring_attention(query, key, value, *, axis_name, is_causal=False, scale=None,
                   return_residual=False, layout="contiguous", implementation=None,
                   logits_soft_cap=None, sinks=None, strategy="ring"):
    """Attention over a sequence split along mesh axis `axis_name`; call inside shard_map.

    query [B, T/P, N, H] and key/value [B, S/P, K, H] are this device's blocks (T = S when
    causal). layout="contiguous": device d holds block d; "zigzag": device d holds chunks d and
    2P-1-d of 2P (causal load balance; see zigzag_permute). implementation: None (cuDNN block
    kernels where they can run, else the reference path, with a warning naming why on a GPU),
    "cudnn" (or NotImplementedError naming why) or "xla". logits_soft_cap and sinks (float
    [N], replicated over the ring axis) as in dot_product_attention: the sinks join each row's
    merged denominator once. strategy="ring": key/value blocks travel around the ring,
    P - 1 exchanges overlapped with the block kernels; "all_gather": every device gathers the
    whole sequence's keys and values once and attends each local query chunk to them (causal:
    a diagonal call over the chunk's own keys plus one unmasked call over the keys before it;
    dk, dv reduce-scattered home): fewer, larger kernels at the cost of the full K/V and
    float32 dk, dv on every device (jax_sdpa/ring/all_gather.py). Returns the
    local output block (and, with return_residual, the float32 log-sum-exp [B, T/P, N] of the
    global softmax rows, the sink included).
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
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if layout == "zigzag" and (query.shape[1] % 2 or key.shape[1] % 2):
        raise ValueError(f"layout='zigzag' needs even blocks, got {query.shape[1]} and "
                         f"{key.shape[1]}")
    scale = checked_scale(scale, query.shape[-1])
    logits_soft_cap = checked_soft_cap(logits_soft_cap)
    sinks = validation.checked_sinks(sinks, query.shape[2], query.dtype)
    parts = len(_chunks(layout, 0, 1))
    scores = Scores(scale, logits_soft_cap)
    if strategy == "all_gather":
        size = lax.axis_size(axis_name)
        implementation = _implementation(query, key, value, implementation,
                                         query.shape[1] // parts, key.shape[1] * size,
                                         logits_soft_cap)
        unpermute = ((lambda x: zigzag_unpermute(x, size)) if layout == "zigzag"
                     else (lambda x: x))
        chunks = _chunks(layout, lax.axis_index(axis_name), size)
        out, lse = ring_all_gather.all_gather_attention(
            query, key, value, sinks, axis_name, bool(is_causal), scores, chunks, unpermute,
            implementation)
    else:
        implementation = _implementation(query, key, value, implementation,
                                         query.shape[1] // parts, key.shape[1] // parts,
                                         logits_soft_cap)
        out, lse = _ring(query, key, value, sinks, axis_name, bool(is_causal), scores, layout,
                         implementation)
    if return_residual:
        return out, lax.stop_gradient(lse).transpose(0, 2, 1)
    return out


def zigzag_permute(x, num_devices, axis=1):
    """Reorders the sequence axis so that a contiguous split over num_devices gives device d
    the chunks d and 2P-1-d: the layout ring_attention(layout="zigzag") expects."""
    chunks = jnp.split(x, 2 * num_devices, axis=axis)
    order = [c for d in range(num_devices) for c in (d, 2 * num_devices - 1 - d)]
    return jnp.concatenate([chunks[i] for i in order], axis=axis)


def zigzag_unpermute(x, num_devices, axis=1):
    """The inverse of zigzag_permute."""
    chunks = jnp.split(x, 2 * num_devices, axis=axis)
    order = [c for d in range(num_devices) for c in (d, 2 * num_devices - 1 - d)]
    inverse = [0] * len(order)
    for position, chunk in enumerate(order):
        inverse[chunk] = position
    return jnp.concatenate([chunks[inverse[i]] for i in range(len(order))], axis=axis)
