"""A description's kept keys (pieces/intervals.py) cut into Pieces: for each slot of each row
range where a range's ends move with the rows at slope 0 or 1, one rectangle our dense target
runs with a band of its own:

    ends fixed           dense                     keys lo..hi
    hi moves             causal from the corner    bottom-right (top-left where square)
    both move            a band ending on the      bottom-right, left bound hi - lo
                         diagonal
    lo moves             keys from the diagonal    top-left, left bound 0
                         on

Rows a piece covers see a key of it; pieces of the same rows are merged by log-sum-exp; rows no
piece covers see no key. The forward may instead run a native band whole (one call) where
cuDNN's forward skips its tiles and its backward does not (a window bounded on both sides).
Of the cuts (as the ranges stand, or cut at the diagonal) and the native band, each direction
takes the one that costs least, a piece's cost being its work and the slices its call copies
(run_as: a piece may run widened to read q, k and v whole).
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import NamedTuple

import numpy as np

from jax_sdpa import masks
from jax_sdpa.call.spec import Piece
from jax_sdpa.pieces import intervals

MAX_PIECES = 16  # per direction: each piece is a kernel call and copies of its rows
# What choosing between cuts charges a piece beyond its work, as a share of the dense call's
# work (its call and merge): of two cuts within this of each other, the fewer pieces.
PIECE_COST = 0.01
# The scores one head's row of q (or of k and v) copied into a piece's slice costs, as memory
# traffic against tensor-core work: a bf16 row of H is 4H bytes read and written, a score
# 4H FLOPs forward, and an H100 does ~200 bf16 FLOPs per byte of HBM (990 TFLOP/s, 3.35 TB/s).
# benchmarks.masks agrees at 8k: a description whose pieces copy ~6 tensors ran ~0.14 ms (~15%
# of the dense forward) past the tiles it keeps.
COPY_SCORES = 200


class Plan(NamedTuple):
    forward: tuple
    backward: tuple
    # each direction's pieces as they run, their work and their copies (share), as a share of
    # the dense call's work
    forward_share: float
    backward_share: float


def skips_tiles(piece: Piece, backward: bool) -> bool:
    """Whether cuDNN's kernels compute only the tiles a piece's band keeps, as the pieces run
    (jax_sdpa/kernels/pieces.py runs a bottom-right piece top-left on a square, its padding
    rows first). As cuDNN 9.19 measures (`python -m benchmarks.bands`): a band ending on the
    top-left diagonal of a square (causal, with or without a left bound) and a left bound
    alone skip tiles both ways; bands with a right bound off that diagonal (bottom-right ones
    of S > T included) skip them only forward."""
    if piece.window_left < 0 and piece.window_right < 0:
        return False  # dense: nothing to skip
    if piece.window_right == 0 or (piece.window_left >= 0 and piece.window_right < 0):
        return True
    return not backward


def kept(piece: Piece) -> int:
    """The scores a piece keeps per query head (its band within its rectangle)."""
    rows = np.arange(piece.q_stop - piece.q_start)[:, None]
    keys = piece.kv_stop - piece.kv_start
    diagonal = rows + (keys - (piece.q_stop - piece.q_start) if piece.bottom_right else 0)
    low = 0 if piece.window_left < 0 else np.maximum(diagonal - piece.window_left, 0)
    high = keys - 1 if piece.window_right < 0 else np.minimum(diagonal + piece.window_right,
                                                              keys - 1)
    return int(np.maximum(high - low + 1, 0).sum())


def work(piece: Piece, backward: bool, q_heads: int) -> int:
    """The scores a piece's kernel computes, over its query heads (a bottom-right piece's
    padding rows included)."""
    heads = q_heads if piece.head_stop == 0 else piece.head_stop - piece.head_start
    if skips_tiles(piece, backward):
        if piece.bottom_right:  # run top-left on a square, padding rows first
            keys = piece.kv_stop - piece.kv_start
            piece = piece._replace(q_start=0, q_stop=keys, kv_start=0, kv_stop=keys,
                                   bottom_right=False)
        return kept(piece) * heads
    return (piece.q_stop - piece.q_start) * (piece.kv_stop - piece.kv_start) * heads


def copied(piece: Piece, q_seq_len, kv_seq_len, q_heads, kv_heads) -> int:
    """Score-equivalents (COPY_SCORES per head's row) of the slices a piece's call copies: its
    rows of q (padding rows included) unless they are all of q, its keys of k and v unless
    they are all of them."""
    group = q_heads // kv_heads
    heads = q_heads if piece.head_stop == 0 else piece.head_stop - piece.head_start
    all_heads = heads == q_heads
    rows = piece.q_stop - piece.q_start + padding(piece)
    keys = piece.kv_stop - piece.kv_start
    row_copy = 0 if all_heads and rows == q_seq_len else rows * heads
    key_copy = 0 if all_heads and keys == kv_seq_len else 2 * keys * -(-heads // group)
    return COPY_SCORES * (row_copy + key_copy)


def padding(piece: Piece) -> int:
    """Rows put before a bottom-right piece's queries so that it runs top-left on a square
    (jax_sdpa/kernels/pieces.py): cuDNN 9.19's backward skips tiles for a band ending on the
    top-left diagonal of T = S alone (benchmarks.bands on an H100: a bottom-right causal band
    of S - T = S/4 took more than the dense rectangle, the same band square and top-left its
    share)."""
    return ((piece.kv_stop - piece.kv_start) - (piece.q_stop - piece.q_start)
            if piece.bottom_right else 0)


def widened(piece: Piece, q_seq_len: int, kv_seq_len: int) -> Piece | None:
    """The piece over every query row (a dense piece), or over the whole square (a band on
    the diagonal key = row), where its own rows keep the same keys there; None where it does
    not widen. Its call then reads q (and k, v) whole instead of copies of slices; the other
    rows' results are dropped, and in the backward their lse gives them no weight."""
    rows = piece.q_stop - piece.q_start
    if piece.window_left < 0 and piece.window_right < 0:  # dense: every row the same keys
        return piece._replace(q_start=0, q_stop=q_seq_len) if rows < q_seq_len else None
    if q_seq_len != kv_seq_len or (piece.kv_stop - piece.kv_start == kv_seq_len and
                                   rows == q_seq_len):
        return None
    diagonal = (piece.kv_stop - piece.q_stop if piece.bottom_right else
                piece.kv_start - piece.q_start)  # the band's diagonal: key = row + diagonal
    if diagonal:
        return None
    whole = piece._replace(q_start=0, q_stop=q_seq_len, kv_start=0, kv_stop=kv_seq_len,
                           bottom_right=False)
    if piece.window_right == 0 and piece.kv_stop >= piece.q_stop:
        # keys max(kv_start, row - left) .. row: the same from key 0 where the first row's
        # lowest key is at or past kv_start
        same = piece.kv_start == 0 or (piece.window_left >= 0 and
                                        piece.q_start - piece.window_left >= piece.kv_start)
        return whole if same else None
    if piece.window_left == 0 and piece.window_right < 0 and piece.kv_stop == kv_seq_len:
        return whole  # keys row .. the last
    return None


def run_as(piece: Piece, backward: bool, q_seq_len, kv_seq_len, q_heads, kv_heads) -> Piece:
    """The piece as its call runs: widened where that costs less than the copies it saves."""
    wide = widened(piece, q_seq_len, kv_seq_len)
    if wide is None:
        return piece
    sizes = (q_seq_len, kv_seq_len, q_heads, kv_heads)
    return min((piece, wide), key=lambda p: cost(p, backward, *sizes))


def cost(piece: Piece, backward: bool, q_seq_len, kv_seq_len, q_heads, kv_heads) -> int:
    """A piece's call in scores: its work and its copies."""
    return work(piece, backward, q_heads) + copied(piece, q_seq_len, kv_seq_len, q_heads,
                                                   kv_heads)


PLAN_CACHE_SIZE = 64  # plans kept, the most recently used
_plans: collections.OrderedDict = collections.OrderedDict()
_plans_lock = threading.Lock()


def plan(mask, q_seq_len: int, kv_seq_len: int, q_heads: int, kv_heads: int) -> Plan | str:
    """planned(...), cached by the description's values (masks.value_key: the same values in
    another description find its plan, an array changed in place plans anew) and the sizes;
    the cache holds keys and plans, never a description's arrays."""
    value = masks.value_key(mask)
    if value is None:
        return planned(mask, q_seq_len, kv_seq_len, q_heads, kv_heads)
    key = (value, q_seq_len, kv_seq_len, q_heads, kv_heads)
    with _plans_lock:
        if key in _plans:
            _plans.move_to_end(key)
            return _plans[key]
    found = planned(mask, q_seq_len, kv_seq_len, q_heads, kv_heads)
    with _plans_lock:
        _plans[key] = found
        while len(_plans) > PLAN_CACHE_SIZE:
            _plans.popitem(last=False)
    return found


def planned(mask, q_seq_len: int, kv_seq_len: int, q_heads: int, kv_heads: int) -> Plan | str:
    """The description's pieces at these sizes, or why it does not run as pieces."""
    kept_keys = intervals.of_mask(mask, q_seq_len, kv_seq_len)
    if kept_keys is None:
        return ("its keys depend on arrays known only when the call runs (documents, or a "
                "traced or batch-dependent mask)")
    pieces = cut(kept_keys, q_heads, kv_heads)
    if pieces is None:
        return f"it cuts into more than {MAX_PIECES} pieces"
    if not pieces:
        return "it keeps no key"  # (every row is the mean of the values: the other routes)
    candidates = [tuple(pieces)]
    split = cut(at_diagonal(kept_keys), q_heads, kv_heads)
    if split is not None and split != pieces:
        candidates.append(tuple(split))
    band = _native_band(mask, q_seq_len, kv_seq_len)
    if band is not None:  # one call of the band, where its tiles are skipped
        candidates.append((band,))
    shares = functools.partial(share, q_seq_len=q_seq_len, kv_seq_len=kv_seq_len,
                               q_heads=q_heads, kv_heads=kv_heads)
    forward, backward = (min(candidates, key=lambda c, b=b: shares(c, b) + PIECE_COST * len(c))
                         for b in (False, True))
    if band is not None and forward == backward == (band,):
        return "cuDNN's own band skips its tiles both ways"
    return Plan(forward, backward, shares(forward, False), shares(backward, True))


def at_diagonal(kept_keys: intervals.Intervals) -> intervals.Intervals:
    """The same kept keys with each slot's range cut where it passes the diagonal (key = row)
    into the keys up to it and the keys after it: a band that ends right of the diagonal skips
    no tile backward, its two halves, each on the diagonal, do (skips_tiles)."""
    rows = np.arange(kept_keys.lo.shape[1])[None, :, None]
    return intervals.Intervals(
        np.concatenate([kept_keys.lo, np.maximum(kept_keys.lo, rows + 1)], -1),
        np.concatenate([np.minimum(kept_keys.hi, rows), kept_keys.hi], -1))


def share(pieces, backward: bool, q_seq_len, kv_seq_len, q_heads, kv_heads) -> float:
    """The cost of pieces as they run (run_as: their work and their copies) as a share of the
    dense call's work."""
    sizes = (q_seq_len, kv_seq_len, q_heads, kv_heads)
    return sum(cost(run_as(p, backward, *sizes), backward, *sizes)
               for p in pieces) / (q_seq_len * kv_seq_len * q_heads)


def _native_band(mask, q_seq_len, kv_seq_len) -> Piece | None:
    """The whole call as one piece with cuDNN's band, where the description is one."""
    native = mask.native()
    if native is None or set(native) - {"is_causal", "local_window_size"}:
        return None
    left, right = native.get("local_window_size", (-1, -1))
    if native.get("is_causal"):
        right = 0 if right < 0 else min(right, 0)
    if left >= 0 and q_seq_len > kv_seq_len:
        return None  # cuDNN's left bound needs T <= S (limits/dense.diagonal_band)
    return Piece(0, q_seq_len, 0, kv_seq_len, window_left=left, window_right=right)


def cut(kept_keys: intervals.Intervals, q_heads: int, kv_heads: int) -> list[Piece] | None:
    """The pieces of every head group's slots, or None past MAX_PIECES."""
    pieces = []
    for head_start, head_stop in _head_groups(kept_keys, q_heads, kv_heads):
        lo, hi = kept_keys.lo[head_start], kept_keys.hi[head_start]
        heads = (0, 0) if kept_keys.heads == 1 else (head_start, head_stop)
        for slot in range(lo.shape[-1]):
            for run, width in _clipped_bands(_runs(lo[:, slot], hi[:, slot])):
                pieces.append(_piece(*run, *heads, width=width))
                if len(pieces) > MAX_PIECES:
                    return None
    return pieces


def _clipped_bands(runs):
    """The runs, with each causal-from-the-corner run (lo fixed, hi on a diagonal) and the band
    after it on the same diagonal joined where the band's left bound, clipped at the first
    run's keys, gives both (a causal window's first rows): one piece (cuDNN's band clips its
    left bound at the rectangle's first key), so that windows per head, and their unions,
    take half the pieces."""
    joined = []  # (run, the band's left bound where it is clipped, else None)
    for run in runs:
        if joined and joined[-1][1] is None and _joins(joined[-1][0], run):
            first, _, lo, hi, _, _ = joined[-1][0]
            joined[-1] = ((first, run[1], lo, hi, 1, 1), run[3] - run[2])
        else:
            joined.append((run, None))
    return joined


def _joins(before, run) -> bool:
    first, stop, lo, hi, slope_lo, slope_hi = before
    start, _, band_lo, band_hi, band_slope_lo, band_slope_hi = run
    if (slope_lo, slope_hi, band_slope_lo, band_slope_hi) != (0, 1, 1, 1) or start != stop:
        return False
    width = band_hi - band_lo  # the band's left bound
    last_hi = hi + stop - 1 - first
    return band_hi == last_hi + 1 and lo <= band_lo <= lo + 1 and last_hi - width <= lo


def _head_groups(kept_keys, q_heads, kv_heads):
    """[start, stop) of consecutive query heads keeping the same keys, each within one group of
    heads sharing a key/value head or made of whole groups (so a piece slices K and V too)."""
    if kept_keys.heads == 1:
        return [(0, q_heads)]
    group = q_heads // kv_heads
    same = [np.array_equal(kept_keys.lo[h], kept_keys.lo[h - 1]) and
            np.array_equal(kept_keys.hi[h], kept_keys.hi[h - 1]) for h in range(1, q_heads)]
    starts = [0] + [h for h in range(1, q_heads) if not same[h - 1]] + [q_heads]
    groups = []
    for start, stop in zip(starts, starts[1:]):
        if start // group != (stop - 1) // group and (start % group or stop % group):
            cuts = sorted({start, stop, *range(-(-start // group) * group, stop, group)})
            groups += list(zip(cuts, cuts[1:]))
        else:
            groups.append((start, stop))
    return groups


def _runs(lo, hi):
    """(first row, stop row, lo, hi, lo's slope, hi's slope) of each maximal run of rows with a
    range in this slot whose ends move by 0 or 1 per row, slopes fixed over the run."""
    valid = lo <= hi
    step_lo, step_hi = np.diff(lo), np.diff(hi)
    steps_ok = valid[:-1] & valid[1:] & (step_lo >= 0) & (step_lo <= 1) & (step_hi >= 0) & (
        step_hi <= 1)
    row, rows = 0, len(lo)
    while row < rows:
        if not valid[row]:
            following = np.flatnonzero(valid[row:])
            if not len(following):
                return
            row += int(following[0])
        first = row
        slope_lo = slope_hi = 0
        if row + 1 < rows and steps_ok[row]:
            slope_lo, slope_hi = int(step_lo[row]), int(step_hi[row])
            same = steps_ok[row:] & (step_lo[row:] == slope_lo) & (step_hi[row:] == slope_hi)
            broken = np.flatnonzero(~same)
            row += int(broken[0]) if len(broken) else len(same)
        yield first, row + 1, int(lo[first]), int(hi[first]), slope_lo, slope_hi
        row += 1


def _piece(first, stop, lo, hi, slope_lo, slope_hi, head_start, head_stop,
           width=None) -> Piece:
    rows = stop - first
    last_hi = hi + slope_hi * (rows - 1)
    heads = dict(head_start=head_start, head_stop=head_stop)
    if slope_hi == 0:  # dense, or keys from the diagonal on
        band = dict(window_left=0) if slope_lo else {}
        return Piece(first, stop, lo, hi + 1, **band, **heads)
    keys = last_hi + 1 - lo
    band = dict(window_right=0, bottom_right=keys != rows)
    if slope_lo:
        band["window_left"] = hi - lo if width is None else width
    return Piece(first, stop, lo, last_hi + 1, **band, **heads)


def on_heads(pieces, start: int, stop: int, q_heads: int) -> tuple:
    """The pieces of query heads [start, stop) of q_heads, numbered from `start` (one device's
    heads under head sharding): each piece that holds any of them, cut to them."""
    found = []
    for piece in pieces:
        first, last = max(piece.head_start, start), min(piece.head_stop or q_heads, stop)
        if first >= last:
            continue
        heads = (0, 0) if (first, last) == (start, stop) else (first - start, last - start)
        found.append(piece._replace(head_start=heads[0], head_stop=heads[1]))
    return tuple(found)


def uncovered_rows(pieces, q_seq_len: int, q_heads: int) -> np.ndarray:
    """bool [1, N, T]: the rows no piece covers (they see no key)."""
    covered = np.zeros((1, q_heads, q_seq_len), bool)
    for piece in pieces:
        heads = slice(piece.head_start, piece.head_stop or q_heads)
        covered[:, heads, piece.q_start:piece.q_stop] = True
    return ~covered


def describe(plan_: Plan) -> str:
    """The pieces in words, for jax_sdpa.explain."""
    def words(pieces, share):
        calls = "one call" if len(pieces) == 1 else f"{len(pieces)} calls"
        return f"{calls}, {share:.0%} of the dense work"
    return (f"the mask cut into pieces: forward {words(plan_.forward, plan_.forward_share)}; "
            f"backward {words(plan_.backward, plan_.backward_share)}")
