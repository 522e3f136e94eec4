"""The keys each query row keeps, as sorted, disjoint, non-touching [lo, hi] ranges (inclusive)
per head and row: read from a description's structure in O(T) per range (causal, windows,
prefix_lm, global tokens, their unions and intersections), or from the concrete array of a
block table or a boolean mask, never from a [T, S] array the description does not hold.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jax_sdpa import masks

_EMPTY = np.iinfo(np.int64).max // 4  # an empty slot's lo (sorts last; hi is -1)
MAX_ARRAY_ELEMENTS = 1 << 28  # a boolean mask read at trace time, at most


class Intervals(NamedTuple):
    """lo, hi int64 [H, T, k]: row t of head h keeps keys lo..hi of each of its k slots (H is 1
    where every head keeps the same); an empty slot has lo > hi."""

    lo: np.ndarray
    hi: np.ndarray

    @property
    def heads(self) -> int:
        return self.lo.shape[0]


def of_mask(mask, q_seq_len: int, kv_seq_len: int) -> Intervals | None:
    """The description's kept keys, or None where they depend on traced values (documents,
    arrays that are not concrete, a batch that differs by row, too large an array)."""
    rows = np.arange(q_seq_len, dtype=np.int64)[None, :]
    zeros = np.zeros_like(rows)
    if isinstance(mask, masks.Causal):
        return _single(zeros, rows, kv_seq_len)
    if isinstance(mask, masks.SlidingWindow):
        left, right = (np.asarray(b, np.int64).reshape(-1, 1) for b in (mask.left, mask.right))
        return _single(rows - left, rows + right, kv_seq_len)
    if isinstance(mask, masks.PrefixLM):
        return _single(zeros, np.maximum(mask.prefix_length - 1, rows), kv_seq_len)
    if isinstance(mask, masks.GlobalTokens):
        return _single(zeros, np.where(rows < mask.n, kv_seq_len - 1, mask.n - 1), kv_seq_len)
    if isinstance(mask, (masks.Union, masks.Intersection)):
        a, b = (of_mask(m, q_seq_len, kv_seq_len) for m in (mask.a, mask.b))
        if a is None or b is None:
            return None
        return union(a, b) if isinstance(mask, masks.Union) else intersection(a, b)
    if isinstance(mask, masks.BlockTable):
        return _of_block_table(mask, q_seq_len, kv_seq_len)
    if isinstance(mask, masks.FromBoolean):
        return _of_boolean(mask.mask, q_seq_len, kv_seq_len)
    return None


def _single(lo, hi, kv_seq_len) -> Intervals:
    """One range per row, clipped to the keys (lo, hi broadcastable to [H, T])."""
    lo, hi = np.broadcast_arrays(np.maximum(lo, 0), np.minimum(hi, kv_seq_len - 1))
    empty = lo > hi
    return Intervals(np.where(empty, _EMPTY, lo)[..., None], np.where(empty, -1, hi)[..., None])


def _heads_alike(a: Intervals, b: Intervals):
    heads = max(a.heads, b.heads)
    grow = lambda x: np.broadcast_to(x, (heads, *x.shape[1:]))  # noqa: E731
    return (grow(a.lo), grow(a.hi)), (grow(b.lo), grow(b.hi))


def union(a: Intervals, b: Intervals) -> Intervals:
    (a_lo, a_hi), (b_lo, b_hi) = _heads_alike(a, b)
    return normalized(np.concatenate([a_lo, b_lo], -1), np.concatenate([a_hi, b_hi], -1))


def intersection(a: Intervals, b: Intervals) -> Intervals:
    """Every pair's overlap: disjoint, since each side's ranges are."""
    (a_lo, a_hi), (b_lo, b_hi) = _heads_alike(a, b)
    shape = (*a_lo.shape[:2], a_lo.shape[2] * b_lo.shape[2])
    lo = np.maximum(a_lo[..., :, None], b_lo[..., None, :]).reshape(shape)
    hi = np.minimum(a_hi[..., :, None], b_hi[..., None, :]).reshape(shape)
    return normalized(lo, hi)


def normalized(lo, hi) -> Intervals:
    """Ranges sorted by lo, those that overlap or touch joined, slots empty in every row
    dropped (at least one kept)."""
    empty = lo > hi
    lo, hi = np.where(empty, _EMPTY, lo), np.where(empty, -1, hi)
    order = np.argsort(lo, axis=-1, kind="stable")
    lo, hi = np.take_along_axis(lo, order, -1), np.take_along_axis(hi, order, -1)
    out_lo, out_hi = np.full_like(lo, _EMPTY), np.full_like(hi, -1)
    count = np.zeros(lo.shape[:-1], np.int64)
    current_lo, current_hi = lo[..., 0].copy(), hi[..., 0].copy()
    for slot in range(1, lo.shape[-1]):
        slot_lo, slot_hi = lo[..., slot], hi[..., slot]
        valid = slot_lo <= slot_hi
        joins = valid & (slot_lo <= current_hi + 1)
        current_hi = np.where(joins, np.maximum(current_hi, slot_hi), current_hi)
        starts = np.nonzero(valid & ~joins)
        out_lo[(*starts, count[starts])] = current_lo[starts]
        out_hi[(*starts, count[starts])] = current_hi[starts]
        count[starts] += 1
        current_lo[starts], current_hi[starts] = slot_lo[starts], slot_hi[starts]
    last = np.nonzero(current_lo <= current_hi)
    out_lo[(*last, count[last])] = current_lo[last]
    out_hi[(*last, count[last])] = current_hi[last]
    count[last] += 1
    slots = max(int(count.max(initial=0)), 1)
    return Intervals(out_lo[..., :slots], out_hi[..., :slots])


def _concrete(array):
    """array as NumPy, or None where it is traced."""
    try:
        return np.asarray(array)
    except Exception:  # noqa: BLE001 - a tracer (jax's concretization error)
        return None


def _heads_of(array):
    """A [B|1, N|1, ...] array (rank 4, leading ones added) as [N|1, ...], or None where it
    differs by batch row."""
    array = array.reshape((1,) * (4 - array.ndim) + array.shape)
    if array.shape[0] > 1 and not (array == array[:1]).all():
        return None
    return array[0]


def _runs(keep) -> Intervals:
    """The runs of True along the last axis of bool [H, T, S]."""
    edges = np.diff(np.pad(keep, ((0, 0), (0, 0), (1, 1))).astype(np.int8), axis=-1)
    heads, rows = np.nonzero(edges == 1)[:2]
    starts = np.nonzero(edges == 1)[2]
    stops = np.nonzero(edges == -1)[2]
    slot = np.zeros(len(starts), np.int64)
    if len(starts):  # each run's place among its row's
        row_id = heads * keep.shape[1] + rows
        first = np.r_[True, row_id[1:] != row_id[:-1]]
        run_index = np.arange(len(starts))
        slot = run_index - np.maximum.accumulate(np.where(first, run_index, 0))
    slots = max(int(slot.max(initial=-1)) + 1, 1)
    lo = np.full((*keep.shape[:2], slots), _EMPTY, np.int64)
    hi = np.full((*keep.shape[:2], slots), -1, np.int64)
    lo[heads, rows, slot], hi[heads, rows, slot] = starts, stops - 1
    return Intervals(lo, hi)


def _of_boolean(mask, q_seq_len, kv_seq_len) -> Intervals | None:
    array = _concrete(mask)
    if array is None or array.size > MAX_ARRAY_ELEMENTS:
        return None
    keep = _heads_of(array.astype(bool))
    if keep is None:
        return None
    return _runs(np.broadcast_to(keep, (keep.shape[0], q_seq_len, kv_seq_len)))


def _of_block_table(mask, q_seq_len, kv_seq_len) -> Intervals | None:
    table = _concrete(mask.table)
    if table is None:
        return None
    table = _heads_of(table.astype(bool))
    shape = (-(-q_seq_len // mask.tile_q), -(-kv_seq_len // mask.tile_k))
    if table is None or table.shape[-2:] != shape:
        return None  # (the boolean form names a wrong shape)
    tiles = _runs(table)  # [H, tile rows, k] in tiles
    empty = tiles.lo > tiles.hi
    lo = np.where(empty, _EMPTY, tiles.lo * mask.tile_k)
    hi = np.where(empty, -1, np.minimum((tiles.hi + 1) * mask.tile_k, kv_seq_len) - 1)
    rows = np.arange(q_seq_len) // mask.tile_q
    return normalized(lo[:, rows], hi[:, rows])
