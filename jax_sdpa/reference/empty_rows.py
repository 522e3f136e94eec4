"""Rows that see no key, in one place: which rows they are (the rule), what they hold (the
reference's value), and the repair that makes a kernel's rows so.

The value, as jax.nn.dot_product_attention gives it: a row whose every key is masked holds the
plain mean of all values (its scores all equal the same large negative fill); a row past its
query length, or of a batch entry whose key/value length is 0, holds zeros; with sinks every
such row holds zeros (the sink takes all the weight). Its log-sum-exp is the large negative
fill (the sink's logit with sinks). The reference path (attention.py) computes exactly that;
cuDNN does not: it leaves such rows non-finite, zero or unwritten, so every kernel path
repairs them here after the kernel ran, and sends their cotangent where the reference's
gradient sends it (to V alike, for rows that are the mean of the values).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_sdpa.reference.attention import combined_mask, large_negative

# --- the value ---------------------------------------------------------------------------------


def mean_value(q_heads, value):
    """[B, N, Hv] float32: each of the q_heads query heads' plain average of all values [B, S,
    K, Hv], what a row that sees no key gives (jax.nn's convention: all its scores equal)."""
    groups = q_heads // value.shape[2]
    return jnp.repeat(jnp.mean(value.astype(jnp.float32), axis=1), groups, axis=1)


def mean_value_gradient(q_heads, value, d_output):
    """d/dV [B, S, K, Hv] float32 of rows that are the mean of all values (mean_value), given
    their cotangents d_output [B, T, N, Hv] (zero elsewhere): every key alike."""
    batch, kv_seq_len, kv_heads, head_dim_v = value.shape
    per_head = jnp.sum(d_output.astype(jnp.float32), axis=1)  # [B, N, Hv]
    per_kv_head = per_head.reshape(batch, kv_heads, q_heads // kv_heads, head_dim_v).sum(2)
    return jnp.broadcast_to((per_kv_head / kv_seq_len)[:, None], value.shape)


def residual_fill(sinks, dtype):
    """The residual (log-sum-exp) of a row that sees no key, broadcastable over a last axis of
    heads: jax.nn's large negative fill, or with sinks each head's sink logit."""
    if sinks is None:
        return jnp.full((), large_negative(), dtype)
    return jnp.asarray(sinks).astype(dtype)


def padded_rows(batch, q_seq_len, q_lengths, kv_lengths):
    """bool [B, T]: rows past their query length, and every row of an entry without keys:
    zeros, whatever the masks."""
    padded = jnp.zeros((batch, q_seq_len), bool)
    if q_lengths is not None:
        padded |= jnp.arange(q_seq_len)[None, :] >= q_lengths[:, None]
    if kv_lengths is not None:
        padded |= (kv_lengths <= 0)[:, None]
    return padded


# --- the rule ----------------------------------------------------------------------------------


def band_rows(q_seq_len, kv_seq_len, spec, kv_lengths):
    """[B|1, 1, T]: rows whose band of keys (the spec's, measured from its diagonal) holds no
    key below the key/value length: an interval per row, O(T)."""
    positions = jnp.arange(q_seq_len)[None, :] + spec.diagonal_offset(q_seq_len, kv_seq_len)
    low = (jnp.zeros_like(positions) if spec.window_left < 0 else
           jnp.maximum(positions - spec.window_left, 0))
    high = jnp.full_like(positions, kv_seq_len)
    if kv_lengths is not None:
        high = jnp.minimum(high, kv_lengths[:, None])
    if spec.window_right >= 0:
        high = jnp.minimum(high, positions + spec.window_right + 1)
    return (high <= low)[:, None, :]


def masked_rows(q_seq_len, kv_seq_len, spec, mask, kv_lengths):
    """[B|1, N|1, T]: rows whose every key is hidden by a dense mask, the band or the key/value
    lengths (the mask itself has to be read)."""
    keep = combined_mask(q_seq_len, kv_seq_len, mask=mask, local_window_size=spec.window(),
                         key_value_seq_lengths=kv_lengths,
                         diagonal_offset=spec.diagonal_offset(q_seq_len, kv_seq_len))
    return ~jnp.any(keep, axis=-1)


def filled_rows(lse):
    """bool [B, N, T]: rows whose log-sum-exp is the fill's, every score of theirs the large
    negative fill (as a score_mod's -inf becomes): the kernel's own account of such rows, where
    no mask says which they are."""
    return ~(lse > large_negative() / 2)


def dense_rows_may_see_nothing(spec, mask) -> bool:
    """Whether some query row of a dense cuDNN call may see no key. A causal or windowed row
    always sees its diagonal key when cuDNN runs it (T <= S for windows, or padding mode),
    unless key lengths cut that key off; masks (and dense segment ids) and score_mods can hide
    anything."""
    return mask is not None or bool(spec.score_mod) or (spec.window_left >= 0 and
                                                        spec.has_lengths)


def packed_rows_may_see_nothing(spec) -> bool:
    """Whether a query of a packed call can see no key: its id missing among the keys, or key
    lengths cutting its document's keys. A row always sees its own position otherwise, and
    with the keys' lengths the queries' own, that key is inside them."""
    return spec.segments == "cross" or (spec.has_lengths and not spec.same_lengths)


def packed_rows(docs, window_left=-1, window_right=-1, q_lengths=None):
    """bool [B, T]: query tokens inside a document of the table (packing/documents.py) and
    before their row's query length whose band of keys within the document is empty. The band
    is CallSpec's (inclusive bounds, -1: none), measured from the document's first token, keys
    aligned with queries."""
    positions = jnp.arange(docs.q_slot.shape[1], dtype=jnp.int32)[None, :]
    slot = jnp.maximum(docs.q_slot, 0)
    take = lambda x: jnp.take_along_axis(x, slot, axis=1)  # noqa: E731
    q_start, kv_start, kv_len = take(docs.q_start), take(docs.kv_start), take(docs.kv_len)
    relative = positions - q_start
    low = kv_start if window_left < 0 else jnp.maximum(kv_start, kv_start + relative - window_left)
    high = kv_start + kv_len
    if window_right >= 0:
        high = jnp.minimum(high, kv_start + relative + window_right + 1)
    inside = docs.q_slot >= 0
    if q_lengths is not None:
        inside &= positions < q_lengths[:, None]
    return inside & (high <= low)


def paged_rows_seeing_keys(q_seq_len, kv_lengths):
    """bool [B, T]: a paged call's queries at a position >= 0 (query i of sequence b sits at
    kv_lengths[b] - T + i); the others see no key."""
    return (kv_lengths[:, None] - q_seq_len + jnp.arange(q_seq_len)[None, :]) >= 0


def averaged_rows(batch, q_seq_len, q_lengths, kv_lengths):
    """bool [B, 1, T]: rows that hold the mean of all values when they see no key (within the
    query lengths, in an entry with keys); other such rows are zeros."""
    if q_lengths is None:
        return jnp.ones((batch, 1, q_seq_len), bool)
    return ~padded_rows(batch, q_seq_len, q_lengths, kv_lengths)[:, None, :]


# --- the repair --------------------------------------------------------------------------------


def fill(output, lse, empty, value):
    """output [B, T, N, Hv] and lse [B, N, T] with the rows `empty` (bool, broadcastable to
    [B, N, T]) holding `value` (broadcastable to [B, T, N, Hv]: 0, or the mean of the values)
    and the lse of a row that sees no key."""
    empty_btn = jnp.swapaxes(empty, -1, -2)[..., None]  # [B|1, T, N|1, 1]
    output = jnp.where(empty_btn, jnp.asarray(value).astype(output.dtype), output)
    return output, jnp.where(empty, large_negative(), lse)


def zero_padded_rows(output, q_lengths, kv_lengths):
    """output [B, T, N, Hv] with the rows past the query lengths and of entries without keys
    zeros."""
    batch, q_seq_len = output.shape[:2]
    padded = padded_rows(batch, q_seq_len, q_lengths, kv_lengths)
    return jnp.where(padded[:, :, None, None], jnp.zeros((), output.dtype), output)


def clear_nonfinite_rows(output, lse):
    """Rows a kernel left non-finite (every score masked inside a score modifier) become zeros
    with the large negative lse, which also keeps a backward's exp(scores - lse) at 0 there."""
    return fill(output, lse, ~jnp.isfinite(lse), 0)


def average_dense_rows(output, lse, empty, value, q_lengths, kv_lengths):
    """A dense call's rows `empty` ([B|1, N|1, T]) made the mean of the values [B, S, K, Hv],
    then the padded rows zeros. The where also sends those rows a zero cotangent, so the
    backward matches the reference's gradient."""
    average = mean_value(output.shape[2], value)[:, None]  # [B, 1, N, Hv]
    output, lse = fill(output, lse, empty, average)
    return zero_padded_rows(output, q_lengths, kv_lengths), lse


def average_rows(output, lse, rows, value):
    """output and lse [B, N, T] with the rows `rows` (bool [B, T], or None) the mean of the
    values."""
    if rows is None:
        return output, lse
    return fill(output, lse, rows[:, None, :], mean_value(output.shape[2], value)[:, None])


def averaged_rows_gradient(d_output, rows, value):
    """(d_output without the rows average_rows filled, those rows' dV float32 or None)."""
    if rows is None:
        return d_output, None
    rows = rows[:, :, None, None]
    return (jnp.where(rows, 0, d_output),
            mean_value_gradient(d_output.shape[2], value, jnp.where(rows, d_output, 0)))


def add_value_gradient(dv, extra):
    """dV plus the mean rows' share (averaged_rows_gradient), in dV's dtype."""
    return dv if extra is None else (dv.astype(jnp.float32) + extra).astype(dv.dtype)
