"""A mask cut into pieces (jax_sdpa/pieces/plan.py) run on our dense kernels: each piece's rows,
keys and heads sliced out and run with its own band; the forward merges the pieces of the same
rows by log-sum-exp, the backward gives each piece the merged output and lse (so cuDNN returns
that piece's exact share of dq, dk, dv: dS = P (dP - rowsum(dO O)) with P from the merged
normaliser) and sums the shares. A piece may run widened (pieces/plan.run_as: over every row
or the whole square, reading q, k and v whole); its call's other rows are dropped.

Rows no piece covers are left at output 0 and lse -inf, for the caller's repair of rows that see
no key (jax_sdpa/call/inputs.py).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_sdpa.cudnn import dense
from jax_sdpa.limits import pieces as limits
from jax_sdpa.pieces import plan as pieces_plan
from jax_sdpa.reference import kernel as reference_kernel


_NO_WEIGHT = 1e30  # a padding row's lse: exp(score - lse) is 0 for every score


def merge(out, lse, block_out, block_lse):
    """Two partial results of the same query rows as one (out [B, t, N, Hv], lse [B, N, t],
    float32), weighted by their log-sum-exps; out None: the block alone."""
    if out is None:
        return block_out, block_lse
    merged = jnp.logaddexp(lse, block_lse)
    # Rows that no block has reached yet have lse -inf on both sides: keep them at 0.
    safe = jnp.where(jnp.isneginf(merged), 0.0, merged)
    weight = lambda x: jnp.exp(x - safe).transpose(0, 2, 1)[..., None]  # noqa: E731
    return out * weight(lse) + block_out * weight(block_lse), merged


def piece_spec(spec, piece):
    """The call's spec for one piece: its band, top-left (a bottom-right piece runs padded:
    pieces_plan.padding), no pieces."""
    return dataclasses.replace(spec, pieces=(), backward_pieces=(),
                               window_left=piece.window_left, window_right=piece.window_right,
                               bottom_right=False)


def _call_of(inputs, piece, backward):
    """(the piece as its call runs: pieces_plan.run_as; that call's q, k, v; the piece's own
    rows in its results; the keys and key/value heads it reads)."""
    query, key = inputs["query"], inputs["key"]
    run = pieces_plan.run_as(piece, backward, query.shape[1], key.shape[1], query.shape[2],
                             key.shape[2])
    rows, keys, heads, kv_heads = _where(run, query.shape[2], key.shape[2])
    sliced = _sliced(inputs, rows, keys, heads, kv_heads)
    sliced["query"] = _with_rows_before(query, rows, heads, pieces_plan.padding(run))
    first = pieces_plan.padding(run) + piece.q_start - run.q_start
    return run, sliced, slice(first, first + piece.q_stop - piece.q_start), (keys, kv_heads)


def _pad_rows(x, pad, axis=1, value=0.0):
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (pad, 0)
    return jnp.pad(x, widths, constant_values=value)


def _with_rows_before(x, rows, heads, pad):
    """x[:, rows, heads] (x [B, T, N, H]) with the `pad` rows before them: the call's own rows
    where it has them (a slice, or no copy at all where that is every row), zeros before row
    0. The padding rows' results are dropped, and in the backward their lse gives them no
    weight, so what they hold does not matter."""
    start = rows.start - pad
    taken = x[:, max(start, 0):rows.stop, heads]
    return _pad_rows(taken, max(-start, 0))


def _where(piece, q_heads, kv_heads):
    """(rows, keys, query heads, key/value heads) slices of a piece."""
    heads = slice(piece.head_start, piece.head_stop or q_heads)
    group = q_heads // kv_heads
    kv = slice(heads.start // group, -(-heads.stop // group))
    return (slice(piece.q_start, piece.q_stop), slice(piece.kv_start, piece.kv_stop), heads, kv)


def _sliced(inputs, rows, keys, heads, kv_heads):
    return dict(query=inputs["query"][:, rows, heads], key=inputs["key"][:, keys, kv_heads],
                value=inputs["value"][:, keys, kv_heads])


def forward(spec, inputs):
    """(output [B, T, N, Hv] in the inputs' dtype, lse float32 [B, N, T]) of spec.pieces."""
    query, value = inputs["query"], inputs["value"]
    batch, q_seq_len, q_heads, _ = query.shape
    # In the inputs' dtype, as cuDNN writes each piece: a merge is computed in float32 and
    # rounded once (a float32 buffer would be two more passes over the output).
    out = jnp.zeros((batch, q_seq_len, q_heads, value.shape[-1]), query.dtype)
    lse = jnp.full((batch, q_heads, q_seq_len), -jnp.inf, jnp.float32)
    covered = np.zeros((q_heads, q_seq_len), bool)  # rows an earlier piece wrote
    for piece in spec.pieces:
        rows, _, heads, _ = _where(piece, q_heads, value.shape[2])
        run, sliced, own, _ = _call_of(inputs, piece, False)
        piece_out, piece_lse = dense.forward(sliced, piece_spec(spec, run))
        piece_out, piece_lse = piece_out[:, own], piece_lse[..., own]  # the other rows go
        if covered[heads, rows].any():
            piece_out, piece_lse = merge(out[:, rows, heads], lse[:, heads, rows], piece_out,
                                         piece_lse)
        covered[heads, rows] = True
        out = _put(out, (0, rows.start, heads.start, 0), piece_out)
        lse = _put(lse, (0, heads.start, rows.start), piece_lse)
    return out, lse


def backward(spec, inputs, output, lse, d_output):
    """(dq, dk, dv) of spec.backward_pieces, given the whole call's output and lse: each
    piece's share, added in float32 where pieces share rows or keys and kept in the inputs'
    dtypes between pieces (as cuDNN writes each share)."""
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    q_heads, kv_heads_count = query.shape[2], key.shape[2]
    if len(spec.backward_pieces) == 1 and _whole(spec.backward_pieces[0], query, key):
        return tuple(dense.backward(inputs, output, lse, d_output,
                                    piece_spec(spec, spec.backward_pieces[0]))[:3])
    grads = [jnp.zeros(x.shape, x.dtype) for x in (query, key, value)]
    for piece in spec.backward_pieces:
        rows, keys, heads, kv_heads = _where(piece, q_heads, kv_heads_count)
        if limits.backward_reason(piece, query.shape[-1], value.shape[-1],
                                  spec.logits_soft_cap):  # a small piece (limits.plan_reason)
            sliced = _sliced(inputs, rows, keys, heads, kv_heads)
            shares = reference_kernel.backward_from_stats(
                spec.scale, spec.logits_soft_cap, sliced["query"], sliced["key"],
                sliced["value"], output[:, rows, heads], lse[:, heads, rows],
                d_output[:, rows, heads], _keep(piece))
        else:
            # Rows not the piece's own (padding rows, the rest of a widened piece) pass nothing
            # back: an lse no score reaches makes their weights exp(S - lse), and so their dS
            # and their share of dk and dv, 0.
            run, sliced, own, (keys, kv_heads) = _call_of(inputs, piece, True)
            run_rows, pad = slice(run.q_start, run.q_stop), pieces_plan.padding(run)
            run_lse = _pad_rows(lse[:, heads, run_rows], pad, axis=2, value=_NO_WEIGHT)
            index = lax.broadcasted_iota(jnp.int32, run_lse.shape, 2)
            given = (_with_rows_before(output, run_rows, heads, pad),
                     jnp.where((index >= own.start) & (index < own.stop), run_lse, _NO_WEIGHT),
                     _with_rows_before(d_output, run_rows, heads, pad))
            shares = dense.backward(sliced, *given, piece_spec(spec, run))[:3]
            shares = (shares[0][:, own], *shares[1:])
        for i, (where, share) in enumerate(zip(((rows, heads), (keys, kv_heads),
                                                 (keys, kv_heads)), shares)):
            grads[i] = _put(grads[i], (0, where[0].start, where[1].start, 0), share, add=True)
    return tuple(grads)


def _keep(piece):
    """bool [t, s]: the piece's band within its rectangle (from iotas: no constants)."""
    rows = jnp.arange(piece.q_stop - piece.q_start)[:, None]
    keys = jnp.arange(piece.kv_stop - piece.kv_start)[None, :]
    if piece.bottom_right:
        rows = rows + (piece.kv_stop - piece.kv_start) - (piece.q_stop - piece.q_start)
    keep = keys >= 0
    if piece.window_left >= 0:
        keep &= keys >= rows - piece.window_left
    if piece.window_right >= 0:
        keep &= keys <= rows + piece.window_right
    return keep


def _put(x, start, update, add=False):
    """x with `update` written (or added, in float32) at the static `start`, in x's dtype (no
    index arrays: kernels under custom_partitioning hold no constants)."""
    if add:
        limit = tuple(a + b for a, b in zip(start, update.shape))
        update = update.astype(jnp.float32) + lax.slice(x, start, limit).astype(jnp.float32)
    return lax.dynamic_update_slice(x, update.astype(x.dtype), start)


def _whole(piece, query, key) -> bool:
    """Whether the piece is the whole call as it stands (no slice, no padding rows)."""
    return (piece.q_start, piece.q_stop, piece.kv_start, piece.kv_stop, piece.head_stop,
            pieces_plan.padding(piece)) == (0, query.shape[1], 0, key.shape[1], 0, 0)
