"""Attention over packed tokens described by cumulative sequence lengths (flash-attn's varlen and
TransformerEngine's THD convention), as segment ids on one row: the same code path as
dot_product_attention's query_segment_ids, so cuDNN's ragged layout on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sdpa.api.attention import dot_product_attention
from jax_sdpa.reference import empty_rows
from jax_sdpa.call.validation import int32_array


def _checked_cu_seqlens(cu_seqlens, name, total):
    cu = int32_array(cu_seqlens, name)
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be int32 [num_sequences + 1] with at least one sequence, "
                         f"got shape {cu.shape}")
    if cu.shape[0] - 1 > total:
        raise ValueError(f"{name} holds {cu.shape[0] - 1} sequences, more than the {total} "
                         "tokens")
    return cu


def _max_seqlen(max_seqlen_q, max_seqlen_kv):
    if max_seqlen_q is None:
        if max_seqlen_kv is not None:
            raise ValueError("max_seqlen_kv needs max_seqlen_q")
        return None
    return (max_seqlen_q, max_seqlen_q if max_seqlen_kv is None else max_seqlen_kv)


def _segment_ids(cu, total):
    """int32 [1, total]: each token's sequence, the number of sequence ends cu[1:] at or before
    it; tokens at or past cu[-1] get id len(cu) - 1. A count of ends per token and its running
    sum, O(total) with no loop (jnp.searchsorted is a while loop of small kernels on a GPU)."""
    ends = jnp.zeros((total,), jnp.int32).at[jnp.clip(cu[1:], 0, total)].add(1, mode="drop")
    return jnp.cumsum(ends, dtype=jnp.int32)[None]


def varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_kv=None, *, scale=None,
                     is_causal=False, local_window_size=None, implementation=None,
                     return_residual=False, deterministic=False, dropout_rate=0.0,
                     dropout_rng=None, logits_soft_cap=None, sinks=None, max_seqlen_q=None,
                     max_seqlen_kv=None, residual_dtype=None):
    """Attention of each sequence within itself, sequences packed along the token axis.

    Args:
      query: ``[total_q, N, H]``; key ``[total_kv, K, H]``, value ``[total_kv, K, Hv]``.
      cu_seqlens_q: int32 ``[num_sequences + 1]``, non-decreasing from 0: sequence i holds
        query tokens ``cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1``. Tokens at or past the last
        entry are padding: their output rows are zeros.
      cu_seqlens_kv: the same for key/value tokens; None: the queries' (self-attention, and
        then total_kv must equal total_q). Each sequence is an attention problem of its own: the
        queries of a sequence without keys give zero rows (and the residual of a row that sees
        no key), not the mean of other sequences' values.
      is_causal, local_window_size: within each sequence, from its first token; self-attention
        only (cu_seqlens_kv None): with keys of their own, flash-attn aligns causal bottom-right
        per sequence, which segment ids do not express.
      max_seqlen_q, max_seqlen_kv: static ints or None, as flash-attn's: no sequence holds
        more query (key) tokens (max_seqlen_kv defaults to max_seqlen_q). Given, the call runs
        one plan of cuDNN's ragged layout sized by them with no check on the device (faster:
        dot_product_attention's max_document_length, which they become); a sequence longer
        than stated makes the first token's output NaN, never a silently wrong value.
      The other arguments: as dot_product_attention.

    Returns ``[total_q, N, Hv]`` (and with return_residual the log-sum-exp ``[total_q, N]``, in
    the inputs' dtype or residual_dtype).
    Runs as dot_product_attention with query_segment_ids on one row, max_segments the number of
    sequences (+1 for padding): on cuDNN's ragged layout each sequence costs its own tokens.
    """
    if query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
        raise ValueError("varlen_attention takes query [total_q, N, H], key [total_kv, K, H] "
                         f"and value [total_kv, K, Hv], got shapes {query.shape}, {key.shape}, "
                         f"{value.shape}")
    total_q, total_kv = query.shape[0], key.shape[0]
    cu_q = _checked_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q)
    if cu_seqlens_kv is None:
        if total_kv != total_q:
            raise ValueError(f"cu_seqlens_kv is required when key/value hold other tokens than "
                             f"the queries ({total_kv} vs {total_q})")
        cu_kv = cu_q
    else:
        if is_causal or local_window_size is not None:
            raise NotImplementedError("varlen_attention takes is_causal and local_window_size "
                                      "for self-attention only (cu_seqlens_kv=None)")
        cu_kv = _checked_cu_seqlens(cu_seqlens_kv, "cu_seqlens_kv", total_kv)
        if cu_kv.shape != cu_q.shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_kv must count the same sequences, "
                             f"got shapes {cu_q.shape} and {cu_kv.shape}")
    # Behind a barrier: cu_seqlens known at compile time (a constant the caller closed over)
    # would otherwise have XLA evaluate the ids' running sums on the host while it compiles,
    # seconds per call.
    cu_q, cu_kv = jax.lax.optimization_barrier((cu_q, cu_kv))
    q_ids = _segment_ids(cu_q, total_q)
    kv_ids = None if cu_seqlens_kv is None else _segment_ids(cu_kv, total_kv)
    # Self-attention gives one array for both lengths: no row can then see no key, so the
    # packed path repairs none (jax_sdpa/packing/ragged.py).
    q_lengths = cu_q[-1:]
    kv_lengths = q_lengths if cu_seqlens_kv is None else cu_kv[-1:]
    result = dot_product_attention(
        query[None], key[None], value[None], scale=scale, is_causal=is_causal,
        local_window_size=local_window_size, implementation=implementation,
        return_residual=return_residual, deterministic=deterministic,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng, query_segment_ids=q_ids,
        kv_segment_ids=kv_ids, max_segments=cu_q.shape[0],
        query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
        logits_soft_cap=logits_soft_cap, sinks=sinks,
        max_document_length=_max_seqlen(max_seqlen_q, max_seqlen_kv),
        residual_dtype=residual_dtype)
    output, lse = result if return_residual else (result, None)
    output, lse = output[0], None if lse is None else lse[0]
    if cu_seqlens_kv is not None:
        output, lse = _clear_sequences_without_keys(cu_kv, q_ids, output, lse, sinks)
    return output if lse is None else (output, lse)


def _clear_sequences_without_keys(cu_kv, q_ids, output, lse, sinks):
    """Each sequence is an attention problem of its own: the queries of one without keys are
    zeros (dot_product_attention's rows of an entry without keys), their residual the fill of a
    row that sees no key. On one packed row they would see no key and take the mean of every
    sequence's values. The where also sends those rows no cotangent."""
    # Tokens past the last sequence carry id len(cu) - 1: padding, zeros already.
    no_keys = jnp.concatenate([cu_kv[1:] == cu_kv[:-1], jnp.zeros((1,), bool)])[q_ids[0]]
    output = jnp.where(no_keys[:, None, None], jnp.zeros((), output.dtype), output)
    if lse is not None:
        lse = jnp.where(no_keys[:, None], empty_rows.residual_fill(sinks, lse.dtype), lse)
    return output, lse
