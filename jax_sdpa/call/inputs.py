"""The kernel path of dot_product_attention: a validated call and its planned spec become the
kernel inputs (masks folded into one additive bias where cuDNN needs one, lengths completed,
the dropout seed drawn), run through the custom_vjp, and the rows that see no key made what the
reference path gives.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_sdpa.kernels import vjp as kernel_vjp
from jax_sdpa.call.spec import CallSpec
from jax_sdpa.reference.attention import combined_mask, fill_empty_rows, mask_to_bias, mean_value
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
    return inputs


def _may_hide_whole_rows(config: CallSpec, mask) -> bool:
    """Whether some query row may see no key on a dense cuDNN call. A causal or windowed row
    always sees its diagonal key when cuDNN runs it (T <= S for windows, or padding mode),
    unless key lengths cut that key off; masks (and dense segment ids) can hide anything.
    (Packed calls fix their own rows: jax_sdpa/kernels.py.)"""
    return mask is not None or (config.window_left >= 0 and config.has_lengths)


def _rows_seeing_nothing(call: AttentionCall, config: CallSpec, mask):
    """[B|1, N|1, T] bool: rows whose every key is hidden by the mask, causal, window or the
    key/value lengths. Without a dense mask the band and the key lengths say it per row,
    O(T); with one, the mask itself has to be read."""
    q_seq_len, kv_seq_len = call.query.shape[1], call.key.shape[1]
    if mask is None:
        return _band_rows_seeing_nothing(call, config)
    keep = combined_mask(q_seq_len, kv_seq_len, mask=mask, local_window_size=config.window(),
                         key_value_seq_lengths=call.key_value_seq_lengths,
                         diagonal_offset=config.diagonal_offset(q_seq_len, kv_seq_len))
    return ~jnp.any(keep, axis=-1)


def _band_rows_seeing_nothing(call: AttentionCall, config: CallSpec):
    """[B|1, 1, T]: rows whose band of keys (the config's, measured from its diagonal) holds no
    key below the key/value length: an interval per row."""
    q_seq_len, kv_seq_len = call.query.shape[1], call.key.shape[1]
    positions = jnp.arange(q_seq_len)[None, :] + config.diagonal_offset(q_seq_len, kv_seq_len)
    low = (jnp.zeros_like(positions) if config.window_left < 0 else
           jnp.maximum(positions - config.window_left, 0))
    high = jnp.full_like(positions, kv_seq_len)
    if call.key_value_seq_lengths is not None:
        high = jnp.minimum(high, call.key_value_seq_lengths[:, None])
    if config.window_right >= 0:
        high = jnp.minimum(high, positions + config.window_right + 1)
    return (high <= low)[:, None, :]


def _average_rows_seeing_nothing(call: AttentionCall, config: CallSpec, mask, output,
                                 lse):
    """Rows that see no key get the plain average of all values, as the reference path (and
    jax.nn) give. cuDNN disagrees there: a mask reaches it as a finite bias that in float16
    does not swamp the scores, and rows emptied by padding are left to the kernel. The where
    also sends those rows a zero cotangent, so the backward matches the reference's
    gradient."""
    _, q_seq_len, q_heads, _ = call.query.shape
    if call.sinks is not None:
        # The sink takes the whole weight of such rows: the kernels' output is zeros there,
        # as the reference's, and their lse the sink's.
        return output, lse
    empty = _rows_seeing_nothing(call, config, mask)  # [B|1, N|1, T]
    average = mean_value(q_heads, call.value)[:, None]  # [B, 1, N, Hv]
    output, lse = fill_empty_rows(output, lse, empty, average)
    if call.query_seq_lengths is not None:
        valid = jnp.arange(q_seq_len)[None, :] < call.query_seq_lengths[:, None]
        output = output * valid[:, :, None, None].astype(output.dtype)
    if call.key_value_seq_lengths is not None:
        output = output * (call.key_value_seq_lengths > 0)[:, None, None, None].astype(
            output.dtype)
    return output, lse


def run(call: AttentionCall, config: CallSpec):
    """Runs a validated call on the kernels of its planned spec: (output [B, T, N, Hv], lse
    [B, N, T])."""
    # Segment ids that planning sent off the ragged layout become a dense bias.
    dense_segments = call.query_segment_ids is not None and not config.segments
    mask = _dense_mask(call, dense_segments)
    output, lse = kernel_vjp.attention(config, _inputs(call, config, mask))
    if not config.segments and _may_hide_whole_rows(config, mask):
        output, lse = _average_rows_seeing_nothing(call, config, mask, output, lse)
    return output, lse
