"""The kernel path of dot_product_attention: a validated call and its planned spec become the
kernel inputs (masks folded into one additive bias where cuDNN needs one, lengths completed,
the dropout seed drawn), run through the custom_vjp, and the rows that see no key made what the
reference path gives.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_sdpa.kernels import vjp as kernel_vjp
from jax_sdpa.pieces import plan as pieces_plan
from jax_sdpa.call.spec import CallSpec
from jax_sdpa.reference import empty_rows
from jax_sdpa.reference.attention import mask_to_bias
from jax_sdpa.call.validation import AttentionCall


def _dense_mask(call: AttentionCall, dense_segments: bool):
    """The user's mask, and segment ids as a [B, 1, T, S] mask where they take the dense path."""
    if not dense_segments:
        return call.mask
    q_ids = call.query_segment_ids
    kv_ids = q_ids if call.kv_segment_ids is None else call.kv_segment_ids
    segments = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
    return segments if call.mask is None else jnp.logical_and(call.mask, segments)


def _inputs(call: AttentionCall, config: CallSpec, mask):
    """The kernel inputs by name (call_spec.INPUTS) for the planned spec."""
    dtype = call.query.dtype
    batch, q_seq_len, _, _ = call.query.shape
    kv_seq_len = call.key.shape[1]
    inputs = dict(query=call.query, key=call.key, value=call.value)
    if config.has_bias:
        bias = None if call.bias is None else call.bias.astype(dtype)
        if mask is not None:
            mask_bias = mask_to_bias(mask, dtype)
            bias = mask_bias if bias is None else bias + mask_bias
        # cuDNN broadcasts batch and heads, not the score axes.
        inputs["bias"] = jnp.broadcast_to(bias, (*bias.shape[:2], q_seq_len, kv_seq_len))
    if config.has_lengths:
        full = lambda n: jnp.full((batch,), n, jnp.int32)  # noqa: E731
        inputs["q_lengths"] = (full(q_seq_len) if call.query_seq_lengths is None
                               else call.query_seq_lengths)
        inputs["kv_lengths"] = (full(kv_seq_len) if call.key_value_seq_lengths is None
                                else call.key_value_seq_lengths)
    if config.segments:
        inputs["q_segment_ids"] = call.query_segment_ids
        if config.segments == "cross":
            inputs["kv_segment_ids"] = call.kv_segment_ids
    if config.has_seed:
        inputs["dropout_seed"] = kernel_vjp.dropout_seed(call.dropout_rng)
    if config.has_sinks:
        inputs["sinks"] = call.sinks
    if config.score_mod_tables:
        inputs["score_mod_tables"] = call.score_mod_program.tables(batch, call.query.shape[2])
    return inputs


def _average_rows_seeing_nothing(call: AttentionCall, config: CallSpec, mask, output, lse):
    """Rows that see no key get the plain mean of all values, as the reference path (and
    jax.nn) give (reference/empty_rows.py). cuDNN disagrees there: a mask reaches it as a
    finite bias that in float16 does not swamp the scores, and rows emptied by padding are left
    to the kernel."""
    if call.sinks is not None:
        # The sink takes the whole weight of such rows: the kernels' output is zeros there,
        # as the reference's, and their lse the sink's.
        return output, lse
    q_seq_len, kv_seq_len = call.query.shape[1], call.key.shape[1]
    kv_lengths = call.key_value_seq_lengths
    if mask is None:
        empty = empty_rows.band_rows(q_seq_len, kv_seq_len, config, kv_lengths)
    else:
        empty = empty_rows.masked_rows(q_seq_len, kv_seq_len, config, mask, kv_lengths)
    if config.score_mod:  # rows the score_mod emptied: the kernel's lse alone tells which
        empty = empty | empty_rows.filled_rows(lse)
    return empty_rows.average_dense_rows(output, lse, empty, call.value,
                                         call.query_seq_lengths, kv_lengths)


def run(call: AttentionCall, config: CallSpec):
    """Runs a validated call on the kernels of its planned spec: (output [B, T, N, Hv], lse
    [B, N, T])."""
    # Segment ids that planning sent off the ragged layout become a dense bias.
    dense_segments = call.query_segment_ids is not None and not config.segments
    mask = _dense_mask(call, dense_segments)
    output, lse = kernel_vjp.attention(config, _inputs(call, config, mask))
    if config.pieces:
        uncovered = pieces_plan.uncovered_rows(config.pieces, call.query.shape[1],
                                               call.query.shape[2])
        # (with sinks such rows are the zeros and sink logit the kernels leave)
        if uncovered.any() and call.sinks is None:
            output, lse = empty_rows.average_dense_rows(output, lse, jnp.asarray(uncovered),
                                                        call.value, None, None)
    elif not config.segments and empty_rows.dense_rows_may_see_nothing(config, mask):
        output, lse = _average_rows_seeing_nothing(call, config, mask, output, lse)
    return output, lse
