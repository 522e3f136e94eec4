"""Attention over a paged KV cache (decoding and chunked prefill) and the helper that writes new
keys and values into their pages.

Keys and values live in a pool of fixed-size pages shared by every sequence; a page table lists
each sequence's pages in order. The T newest tokens of each sequence attend causally, aligned
bottom-right: query i of sequence b sits at position kv_lengths[b] - T + i and sees the keys
up to it. Forward only (inference).

On an NVIDIA GPU this runs cuDNN's paged forward: the page table goes into the SDPA graph
(cuDNN >= 9.5), which reads each sequence's pages in place, with cuDNN's padding mask and
bottom-right band measured from the actual lengths. Elsewhere (or where cuDNN cannot, with a
warning on a GPU) the reference path gathers the pages, then runs attention with the same
semantics. Both are the kernel layer's (jax_sdpa/kernels/dispatch.py), for a CallSpec with
paged set.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_sdpa.call import planning, validation
from jax_sdpa.call.spec import CallSpec, checked_scale, checked_soft_cap, checked_window
from jax_sdpa.cudnn import command_buffers
from jax_sdpa.kernels import dispatch
from jax_sdpa.limits import paged as paged_limits
from jax_sdpa.reference import empty_rows


def _check_caches(key_cache, value_cache):
    if key_cache.ndim != 4 or value_cache.ndim != 4:
        raise ValueError("key_cache and value_cache must be [pages, page_size, K, H] and "
                         f"[pages, page_size, K, Hv], got {key_cache.shape} and "
                         f"{value_cache.shape}")
    if key_cache.shape[:3] != value_cache.shape[:3]:
        raise ValueError(f"key_cache {key_cache.shape} and value_cache {value_cache.shape} must "
                         "share pages, page_size and heads")
    if key_cache.dtype != value_cache.dtype:
        raise TypeError(f"key_cache and value_cache must share a dtype, got {key_cache.dtype} "
                        f"and {value_cache.dtype}")


def _check_lengths_fit(kv_lengths, capacity, name):
    """Where the lengths are concrete (not traced), none may pass the pages' capacity."""
    try:
        longest = int(jnp.max(kv_lengths))
    except jax.errors.ConcretizationTypeError:
        return
    if longest > capacity:
        raise ValueError(f"{name} holds {longest}, more than max_pages * page_size = "
                         f"{capacity}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _forward_only(compute, *arrays):
    return compute(*arrays)


def _forward_only_fwd(compute, *arrays):
    return compute(*arrays), None


def _forward_only_bwd(*_):
    raise NotImplementedError("paged_attention is forward only (inference): it has no "
                              "gradient; train with dot_product_attention")


_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd)


def _spec(implementation, scale, window, logits_soft_cap, q_seq_len, has_sinks):
    """The band: causal bottom-right (query i at kv_lengths[b] - T + i), a window's left bound
    from the same diagonal. One query with no window needs no band: the padding mask alone
    keeps it to its sequence's keys."""
    left = -1 if window is None else window[0]
    banded = q_seq_len > 1 or window is not None
    return CallSpec(scale=scale, window_left=left, window_right=0 if banded else -1,
                    bottom_right=banded, has_lengths=True, has_sinks=has_sinks,
                    logits_soft_cap=logits_soft_cap or 0.0, paged=True,
                    implementation=implementation,
                    command_buffer=command_buffers.command_buffers())


def _output(spec, query, key_cache, value_cache, page_table, kv_lengths, sinks):
    inputs = dict(query=query, key=key_cache, value=value_cache,
                  q_lengths=jnp.full((query.shape[0],), query.shape[1], jnp.int32),
                  kv_lengths=kv_lengths, page_table=page_table)
    if sinks is not None:
        inputs["sinks"] = sinks
    return dispatch.forward(spec, inputs)[0]


def paged_attention(query, key_cache, value_cache, page_table, kv_lengths, *, scale=None,
                    local_window_size=None, logits_soft_cap=None, sinks=None,
                    implementation=None):
    """Attention of the T newest tokens of each sequence over its keys in a paged cache.

    Args:
      query: ``[B, T, N, H]``; T = 1 when decoding, more for chunked prefill. Query i of
        sequence b sits at position ``kv_lengths[b] - T + i`` and sees the keys up to it.
      key_cache: ``[P, page_size, K, H]``, value_cache ``[P, page_size, K, Hv]``: the page
        pool; N a multiple of K (GQA / MQA).
      page_table: int32 ``[B, max_pages]``: each sequence's pages, in order. Entries past a
        sequence's last page are ignored (any value). Indices of used pages out of [0, P) are
        a user error that is not checked on the device: they read a clamped page.
      kv_lengths: int32 ``[B]``: valid keys per sequence, the T new ones included (write them
        first: paged_kv_update). At most ``max_pages * page_size`` (checked when concrete). A
        query whose position is negative (kv_lengths[b] < T) sees nothing and gives zeros.
      scale, local_window_size (w or (left, right) around the query's position),
      logits_soft_cap, sinks: as dot_product_attention.
      implementation: None (cuDNN's paged forward where it can run, else the reference path
        with a warning naming why on a GPU), "cudnn" (or NotImplementedError naming why) or
        "xla" (the reference path).

    Returns ``[B, T, N, Hv]``. Forward only: differentiating it raises NotImplementedError.
    """
    if implementation not in (None, "xla", "cudnn"):
        raise ValueError(f"implementation must be None, 'xla' or 'cudnn', got "
                         f"{implementation!r}")
    query, key_cache, value_cache = (jnp.asarray(x) for x in (query, key_cache, value_cache))
    if query.ndim != 4:
        raise ValueError(f"query must be [B, T, N, H], got shape {query.shape}")
    _check_caches(key_cache, value_cache)
    batch, q_seq_len, q_heads, head_dim = query.shape
    pages, page_size, kv_heads, key_dim = key_cache.shape
    if min(pages, page_size, kv_heads) == 0:
        raise ValueError(f"key_cache must hold at least one page of at least one token and one "
                         f"head, got shape {key_cache.shape}")
    if key_dim != head_dim:
        raise ValueError(f"query and key_cache must have the same head_dim, got {head_dim} and "
                         f"{key_dim}")
    if q_heads % kv_heads:
        raise ValueError(f"the number of query heads ({q_heads}) must be a multiple of the "
                         f"number of key/value heads ({kv_heads})")
    if query.dtype != key_cache.dtype:
        raise TypeError(f"query and the caches must share a dtype, got {query.dtype} and "
                        f"{key_cache.dtype}")
    page_table = validation.int32_array(page_table, "page_table", ndim=2)
    kv_lengths = validation.int32_array(kv_lengths, "kv_lengths", ndim=1)
    if page_table.shape[0] != batch or kv_lengths.shape != (batch,):
        raise ValueError(f"page_table [B, max_pages] and kv_lengths [B] must have B = {batch}, "
                         f"got {page_table.shape} and {kv_lengths.shape}")
    if page_table.shape[1] == 0:
        raise ValueError(f"page_table must list at least one page per sequence, got shape "
                         f"{page_table.shape}")
    _check_lengths_fit(kv_lengths, page_table.shape[1] * page_size, "kv_lengths")
    scale = checked_scale(scale, head_dim)
    window = checked_window(local_window_size)
    cap = checked_soft_cap(logits_soft_cap)
    sinks = validation.checked_sinks(sinks, q_heads, query.dtype)
    if query.size == 0:  # no query: nothing for a kernel to do
        return jnp.zeros((batch, q_seq_len, q_heads, value_cache.shape[-1]), query.dtype)
    reason = paged_limits.paged_reason(query.dtype, head_dim, value_cache.shape[-1], cap,
                                   q_seq_len == 1 and window is not None)
    cudnn = planning.use_cudnn(reason, implementation, query.dtype, "this paged_attention call")
    spec = _spec("cudnn" if cudnn else "xla", scale, window, cap, q_seq_len, sinks is not None)
    output = _forward_only(functools.partial(_output, spec), query, key_cache, value_cache,
                           page_table, kv_lengths, sinks)
    # Query i of sequence b sits at kv_lengths[b] - T + i; before 0 it sees no key (zeros).
    seen = empty_rows.paged_rows_seeing_keys(q_seq_len, kv_lengths)
    return jnp.where(seen[..., None, None], output, jnp.zeros((), output.dtype))


def paged_kv_update(key_cache, value_cache, page_table, start, key, value, lengths=None):
    """Writes new keys and values into their pages: returns (key_cache, value_cache).

    key ``[B, T, K, H]``, value ``[B, T, K, Hv]``: token t of sequence b goes to position
    ``start[b] + t`` (start int32 [B]: the sequence's length before these tokens), i.e. page
    ``page_table[b, p // page_size]``, slot ``p % page_size``. lengths (int32 [B], optional):
    only the first lengths[b] tokens of sequence b are written (chunks of different lengths).
    Negative positions (left padding: start[b] < 0) and positions past
    ``max_pages * page_size`` are dropped. The new kv_lengths are start + T (or
    start + lengths). Under jit, donate the caches to update them in place.
    """
    key_cache, value_cache = jnp.asarray(key_cache), jnp.asarray(value_cache)
    _check_caches(key_cache, value_cache)
    page_table = validation.int32_array(page_table, "page_table", ndim=2)
    start = validation.int32_array(start, "start", ndim=1)
    key, value = jnp.asarray(key), jnp.asarray(value)
    batch, new_tokens = key.shape[:2]
    if key.shape[2:] != key_cache.shape[2:] or value.shape[2:] != value_cache.shape[2:]:
        raise ValueError(f"key {key.shape} / value {value.shape} must be [B, T] + the caches' "
                         f"[K, H] {key_cache.shape[2:]} / {value_cache.shape[2:]}")
    if page_table.shape[0] != batch or start.shape != (batch,) or value.shape[:2] != (
            batch, new_tokens):
        raise ValueError(f"page_table {page_table.shape}, start {start.shape}, key "
                         f"{key.shape} and value {value.shape} must share B = {batch}")
    page_size = key_cache.shape[1]
    positions = start[:, None] + jnp.arange(new_tokens)[None, :]  # [B, T]
    capacity = page_table.shape[1] * page_size
    keep = (positions >= 0) & (positions < capacity)
    if lengths is not None:
        lengths = validation.int32_array(lengths, "lengths", ndim=1)
        keep &= jnp.arange(new_tokens)[None, :] < lengths[:, None]
    page_index = jnp.clip(jnp.maximum(positions, 0) // page_size, 0, page_table.shape[1] - 1)
    pages = jnp.take_along_axis(page_table, page_index, axis=1)
    # Dropped tokens point past the pool: mode="drop" leaves the cache as it was there.
    pages = jnp.where(keep, pages, key_cache.shape[0])
    slots = positions % page_size
    key_cache = key_cache.at[pages, slots].set(key.astype(key_cache.dtype), mode="drop")
    value_cache = value_cache.at[pages, slots].set(value.astype(value_cache.dtype), mode="drop")
    return key_cache, value_cache
