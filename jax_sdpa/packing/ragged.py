"""Packed segment ids on cuDNN: the document table built on the device (documents.py), and
cuDNN's ragged layout run on the grid the documents fit, chosen on the device (grids.py), where
the table can express the ids, else the exact fallback (fallback.py: one dense cuDNN call
masking the ids inside its kernel; no [T, S] array anywhere); or, when the caller states the
documents' bound, one ragged grid and no check.

    forward(spec, inputs) -> (output [B, T, N, Hv], lse float32 [B, N, T])
    backward(spec, inputs, output, lse, d_output) -> (dq, dk, dv)

inputs: the spec's arrays by name (call_spec.INPUTS), no sinks (the kernel layer applies them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_sdpa.cudnn import ragged as ragged_target
from jax_sdpa.packing import documents, fallback, grids
from jax_sdpa.reference import empty_rows


def _documents(spec, inputs):
    # Behind a barrier: ids known at compile time (a constant the caller closed over) would
    # otherwise have XLA evaluate the whole table on the host while it compiles, seconds per call.
    ids_and_lengths = jax.lax.optimization_barrier(
        {name: inputs.get(name) for name in ("q_segment_ids", "kv_segment_ids", "q_lengths",
                                             "kv_lengths")})
    return documents.documents(
        ids_and_lengths["q_segment_ids"], ids_and_lengths["kv_segment_ids"],
        max_segments=spec.max_segments, q_lengths=ids_and_lengths["q_lengths"],
        kv_lengths=ids_and_lengths["kv_lengths"], aligned=spec.banded)


def _ragged_operands(inputs, docs, entries):
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    return documents.ragged_operands(docs, query.shape[2], key.shape[2], query.shape[3],
                                     value.shape[3], key.shape[1], entries)


def _uniform_rows(spec, inputs, docs, rows_kept):
    """bool [B, T] or None: the rows a ragged call leaves to be made the values' mean (rows that
    see no key, within their query length, in a batch entry with keys; none but those of
    rows_kept, bool [B] or None: poisoned, or not the ragged layout's), None where no row can
    see nothing."""
    if not empty_rows.packed_rows_may_see_nothing(spec):
        return None
    rows = empty_rows.packed_rows(docs, spec.window_left, spec.window_right,
                                  inputs.get("q_lengths"))
    if inputs.get("kv_lengths") is not None:
        rows &= (inputs["kv_lengths"] > 0)[:, None]
    return rows if rows_kept is None else rows & ~rows_kept[:, None]


# A caller who states the documents' bound (max_document_length) gets one ragged grid and no
# check: a checked call's cond predicate and grid are copied to the host, which waits for the
# GPU's queue to drain, and the GPU idles while the call launches.
def _stated_grid(inputs, spec):
    return inputs["query"].shape[0] * spec.max_segments, spec.max_document_length


def _stated_documents(spec, docs):
    """(docs with lengths cut to the stated bound, bool [B]: rows that break the statement:
    ids the table cannot express, or a document longer than the bound)."""
    bound_q, bound_kv = spec.max_document_length
    broken = (~docs.row_ok | jnp.any(docs.q_len > bound_q, axis=1) |
              jnp.any(docs.kv_len > bound_kv, axis=1))
    return docs._replace(q_len=jnp.minimum(docs.q_len, bound_q),
                         kv_len=jnp.minimum(docs.kv_len, bound_kv)), broken


# A checked call (no statement) runs one ragged call on the grid its documents fit, chosen on
# the device (grids.chosen_grid) and read by its handler, which builds each grid's graph when it
# first runs: XLA compiles one custom call, not one per grid, and the workspace is sized once,
# from the graph its operands describe, the largest grid's. The operands are the document
# table's for the most entries: a grid of fewer entries reads their first rows (documents are
# compacted to the front). Where the table cannot express the ids, the exact fallback runs
# instead: for rows that are wholly their documents (self-attention without lengths) it is one
# dense cuDNN call the ragged call's handler runs itself on a grid of 0 documents (the ids go
# with it), so the call waits for the GPU once, for the grid; otherwise a lax.cond chooses,
# its predicate a second wait (a stated bound, none).
class _CheckedGrids:
    def __init__(self, spec, inputs, docs):
        query, key = inputs["query"], inputs["key"]
        every = grids.ragged_grids(query.shape[0], spec.max_segments, query.shape[1],
                                   key.shape[1])
        self.grid, self.fallback = grids.chosen_grid(docs, every)
        self.operands = _ragged_operands(inputs, docs, max(entries for entries, _ in every))
        # The handler waits for the grid's numbers, which nothing recorded may do.
        self.spec = dataclasses.replace(spec, command_buffer=False)
        self.fallback_spec = spec
        # The fallback's rows that see no key or lie past the lengths: none here.
        self.in_handler = spec.segments == "self" and not spec.has_lengths
        if self.in_handler:
            self.grid = self.grid.at[0].set(jnp.where(self.fallback, 0, self.grid[0]))

    def forward(self, inputs):
        """(output, token-major lse) of the documents' grid, or of the fallback."""
        def ragged(inputs):
            return ragged_target.forward(inputs, self.spec, self.operands, grid=self.grid,
                                         fallback_ids=self.in_handler)
        if self.in_handler:
            return ragged(inputs)

        def exact(inputs):
            output, lse = fallback.forward(self.fallback_spec, inputs)
            return output, jnp.swapaxes(lse, 1, 2)
        return jax.lax.cond(self.fallback, exact, ragged, inputs)

    def backward(self, inputs, output, lse, d_output, cleared):
        """(dq, dk, dv) of the documents' grid (given the token-major lse and d_output cleared
        of the filled rows), or of the fallback (given them as they came)."""
        lse_tokens = jnp.swapaxes(lse, 1, 2)

        def ragged(inputs):
            return ragged_target.backward(inputs, output, lse_tokens, cleared, self.spec,
                                          self.operands, grid=self.grid,
                                          fallback_ids=self.in_handler)
        if self.in_handler:
            return ragged(inputs)

        def exact(inputs):
            return fallback.backward(self.fallback_spec, inputs, output, lse, d_output)
        return jax.lax.cond(self.fallback, exact, ragged, inputs)


def _fallback_rows(docs):
    """bool [B]: every row when the checked call runs its fallback, else none."""
    return jnp.broadcast_to(~docs.ok, docs.row_ok.shape)


def forward(spec, inputs):
    docs = _documents(spec, inputs)
    if spec.max_document_length:
        # A row that broke the statement comes back NaN at its first token (the handler
        # writes it: XLA cannot update a slice of a custom call's result in place).
        docs, broken = _stated_documents(spec, docs)
        entries, bound = _stated_grid(inputs, spec)
        output, lse = ragged_target.forward(inputs, spec, _ragged_operands(inputs, docs, entries),
                                            max_document_length=bound, poison_rows=broken)
        output, lse = empty_rows.average_rows(
            output, jnp.swapaxes(lse, 1, 2), _uniform_rows(spec, inputs, docs, broken),
            inputs["value"])
        return output, jnp.where(broken[:, None, None], jnp.nan, lse)
    output, lse = _CheckedGrids(spec, inputs, docs).forward(inputs)
    # The fallback fills its own rows: the table describes none of them.
    return empty_rows.average_rows(
        output, jnp.swapaxes(lse, 1, 2), _uniform_rows(spec, inputs, docs, _fallback_rows(docs)),
        inputs["value"])


def backward(spec, inputs, output, lse, d_output):
    docs = _documents(spec, inputs)
    if spec.max_document_length:
        docs, broken = _stated_documents(spec, docs)
        entries, bound = _stated_grid(inputs, spec)
        cleared, extra = empty_rows.averaged_rows_gradient(
            d_output, _uniform_rows(spec, inputs, docs, None), inputs["value"])
        dq, dk, dv = ragged_target.backward(
            inputs, output, jnp.swapaxes(lse, 1, 2), cleared, spec,
            _ragged_operands(inputs, docs, entries), max_document_length=bound,
            poison_rows=broken)
        return dq, dk, empty_rows.add_value_gradient(dv, extra)
    cleared, extra = empty_rows.averaged_rows_gradient(
        d_output, _uniform_rows(spec, inputs, docs, _fallback_rows(docs)), inputs["value"])
    dq, dk, dv = _CheckedGrids(spec, inputs, docs).backward(inputs, output, lse, d_output,
                                                            cleared)
    return dq, dk, empty_rows.add_value_gradient(dv, extra)
