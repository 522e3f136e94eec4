"""Segment ids -> packed documents: the table cuDNN's ragged layout runs on, built on the device.

A row of segment ids names each token's document; the ragged layout runs each document as its
own batch entry, which is only the same function when every document is one contiguous run of
tokens (and, with a causal band or window, starts at the same position among the queries and
the keys). That cannot be known at trace time, so the table carries `ok`: whether every row of
this call satisfies it, with at most `max_segments` documents per row. Where it does not, the
caller computes the segment-id semantics another way (ragged.py, fallback.py). Every array here is
O(tokens): no [T, S] mask is ever formed.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Documents(NamedTuple):
    """Per row, `max_segments` document slots in order of position; unused slots are empty.

    q_start, q_len, kv_start, kv_len: int32 [B, M], a document's query run [q_start, q_start +
    q_len) and key/value run, clipped to the sequence lengths (a document whose queries see no
    key has q_len 0: its rows are the caller's to fill). q_slot: int32 [B, T], each query
    token's slot, -1 for tokens in none. row_ok: bool [B], whether the table expresses that
    row's ids (see the module docstring); ok: bool [], every row's."""

    q_start: jax.Array
    q_len: jax.Array
    kv_start: jax.Array
    kv_len: jax.Array
    q_slot: jax.Array
    row_ok: jax.Array
    ok: jax.Array


class _Runs(NamedTuple):
    start: jax.Array  # [B, M] first token of each run; the row's length for unused slots
    end: jax.Array    # [B, M] one past its last token
    ids: jax.Array    # [B, M] its segment id
    used: jax.Array   # [B, M] bool
    slot: jax.Array   # [B, L] each token's run (may be >= M when a row overflows)
    fits: jax.Array   # [B] bool: at most M runs, each with an id no other run of the row has


def _runs(ids, max_segments):
    batch, length = ids.shape
    positions = jnp.arange(length, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((batch, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    slot = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1
    count = slot[:, -1] + 1
    rows = jnp.arange(batch)[:, None]
    full = lambda value: jnp.full((batch, max_segments), value, jnp.int32)  # noqa: E731
    start = full(length).at[rows, slot].min(jnp.broadcast_to(positions, ids.shape), mode="drop")
    end = full(0).at[rows, slot].max(jnp.broadcast_to(positions + 1, ids.shape), mode="drop")
    run_ids = full(0).at[rows, slot].set(ids, mode="drop")
    used = jnp.arange(max_segments)[None, :] < count[:, None]
    start = jnp.where(used, start, length)
    end = jnp.where(used, end, length)
    # Two runs with one id would be one document split in two: the layout cannot say that.
    same = ((run_ids[:, :, None] == run_ids[:, None, :]) & used[:, :, None] & used[:, None, :] &
            ~jnp.eye(max_segments, dtype=bool))
    fits = (count <= max_segments) & ~jnp.any(same, axis=(1, 2))
    return _Runs(start, end, run_ids, used, slot, fits)


def _clip(start, end, lengths):
    """Run lengths once tokens at or past the row's valid length are dropped."""
    if lengths is not None:
        end = jnp.minimum(end, lengths[:, None])
    return jnp.maximum(end - start, 0)


def documents(q_ids, kv_ids, *, max_segments, q_lengths=None, kv_lengths=None,
              aligned=False) -> Documents:
    """The document table of a call. kv_ids None: the keys share the queries' ids (and
    positions). aligned: each document's key run must start where its query run does (a causal
    band or window measured from the document's first token equals one measured in row
    positions only then)."""
    q_runs = _runs(q_ids, max_segments)
    q_len = _clip(q_runs.start, q_runs.end, q_lengths)
    row_ok = q_runs.fits
    if kv_ids is None:
        kv_start = q_runs.start
        kv_len = _clip(q_runs.start, q_runs.end, kv_lengths)
    else:
        kv_runs = _runs(kv_ids, max_segments)
        row_ok &= kv_runs.fits
        match = ((q_runs.ids[:, :, None] == kv_runs.ids[:, None, :]) & q_runs.used[:, :, None] &
                 kv_runs.used[:, None, :])
        found = jnp.any(match, axis=2)
        index = jnp.argmax(match, axis=2)
        take = lambda x: jnp.take_along_axis(x, index, axis=1)  # noqa: E731
        kv_len = jnp.where(found, _clip(take(kv_runs.start), take(kv_runs.end), kv_lengths), 0)
        # Documents without keys take the start of the last one before them, so that the
        # offsets stay in order; those with keys must be in the queries' order themselves.
        kv_start = jax.lax.cummax(jnp.where(found, take(kv_runs.start), 0), axis=1)
        row_ok &= jnp.all(jnp.where(found, take(kv_runs.start) == kv_start, True), axis=1)
        if aligned:
            row_ok &= jnp.all(jnp.where(found & (q_len > 0) & (kv_len > 0),
                                        kv_start == q_runs.start, True), axis=1)
        kv_start = jnp.where(q_runs.used, kv_start, kv_ids.shape[1])
    # Queries that see no key at all are left out of the layout (the caller fills their rows).
    q_len = jnp.where(kv_len > 0, q_len, 0)
    q_slot = jnp.where(q_runs.slot < max_segments, q_runs.slot, -1)
    return Documents(q_runs.start, q_len, kv_start, kv_len, q_slot, row_ok, jnp.all(row_ok))


def ragged_operands(docs: Documents, q_heads, kv_heads, head_dim, head_dim_v, kv_seq_len,
                    entries=None):
    """(q_lengths, kv_lengths int32 [entries], offsets int32 [5, R]) for the ragged FFI call.

    The documents of every row that have queries are compacted, in order, into the first of
    `entries` cuDNN batch entries (default: every slot, B * M); the rest have length 0. Each
    entry's element offsets into q, k, v, o and the token-major lse; rows padded to a
    multiple of 4 entries (16-byte aligned pointers per row). The caller makes sure the
    documents fit (count_documents(docs) <= entries): fewer entries mean fewer empty tiles in
    cuDNN's grid."""
    batch, max_segments = docs.q_start.shape
    q_seq_len = docs.q_slot.shape[1]
    entries = batch * max_segments if entries is None else entries
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
    real = (docs.q_len > 0).reshape(-1)
    # A document without queries adds nothing: its keys' gradients are the zero fill.
    place = jnp.where(real, jnp.cumsum(real, dtype=jnp.int32) - 1, entries)

    def compact(values, fill):
        # (jnp.full, not jnp.array: a kernel under custom_partitioning may hold no constants.)
        return jnp.full((entries,), fill, jnp.int32).at[place].set(
            values.reshape(-1).astype(jnp.int32), mode="drop")
    q_tokens = compact(rows * q_seq_len + docs.q_start, batch * q_seq_len)
    kv_tokens = compact(rows * kv_seq_len + docs.kv_start, batch * kv_seq_len)
    q_tokens = jnp.concatenate([q_tokens, jnp.full((1,), batch * q_seq_len, jnp.int32)])
    kv_tokens = jnp.concatenate([kv_tokens, jnp.full((1,), batch * kv_seq_len, jnp.int32)])
    width = -(-(entries + 1) // 4) * 4
    pad = lambda x: jnp.pad(x, (0, width - x.shape[0]), mode="edge")  # noqa: E731
    offsets = jnp.stack([pad(q_tokens * (q_heads * head_dim)),
                         pad(kv_tokens * (kv_heads * head_dim)),
                         pad(kv_tokens * (kv_heads * head_dim_v)),
                         pad(q_tokens * (q_heads * head_dim_v)),
                         pad(q_tokens * q_heads)]).astype(jnp.int32)
    return compact(docs.q_len, 0), compact(docs.kv_len, 0), offsets


def count_documents(docs: Documents):
    """int32 []: the documents with queries, over all rows (the entries a ragged call needs)."""
    return jnp.sum(docs.q_len > 0, dtype=jnp.int32)
