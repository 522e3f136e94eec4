"""The kernel layer: one forward and one backward per implementation ("cudnn": our FFI calls;
"xla": the reference behind the same calling convention), chosen by the CallSpec.

    forward(config, inputs)  -> (output [B, T, N, Hv], lse float32 [B, N, T])
    backward(config, inputs, output, lse, d_output) -> (dq, dk, dv, dbias or None)

inputs: the config's arrays by name (call_spec.INPUTS). This is what the sharding rules run
per device. Packed segment ids on cuDNN live here too: the document table is built on the
device, and cuDNN's ragged layout runs (on the grid the documents fit, chosen on the device)
where the table can express the ids, else the exact fallback (packed_fallback.py: one dense
cuDNN call masking the ids inside its kernel; no [T, S] array anywhere); or, when the caller
states the documents' bound, one ragged grid and no check.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_sdpa.cudnn import call as _ffi
from jax_sdpa.kernels import fp8 as fp8_kernels
from jax_sdpa.packing import fallback as packed_fallback
from jax_sdpa.packing import documents as packing
from jax_sdpa.reference import kernel as reference_kernel
from jax_sdpa.kernels import sinks as sink_softmax
from jax_sdpa.reference.attention import fill_empty_rows, large_negative, mean_value, mean_value_gradient


def forward(config, inputs):
    if config.implementation == "xla":
        return reference_kernel.forward(config, inputs)
    if config.paged:
        return _paged_forward(config, inputs)
    plain = _without_sinks(inputs)
    if config.fp8:
        return fp8_kernels.forward(config, plain)
    if config.segments:
        output, lse = _packed_forward(config, plain)
    else:
        output, lse = _ffi.sdpa_forward(plain, config)
    if config.logits_soft_cap and config.has_lengths:
        output, lse = _clear_rows_seeing_nothing(output, lse)
    if config.has_sinks:
        output, lse = sink_softmax.apply(output, lse, inputs["sinks"])
    return output, lse


def backward(config, inputs, output, lse, d_output):
    """With sinks, output and lse are the sink attention's (jax_sdpa/sink_softmax.py): given those,
    cuDNN's backward is the sink attention's; a reference backward recomputes with the sinks."""
    if config.implementation == "xla":
        return reference_kernel.backward(config, inputs, output, lse, d_output)
    if config.backward_kernel == "xla":  # a cuDNN forward whose backward cuDNN cannot run
        # (planning sends calls with dropout wholly to the reference: a recomputed forward
        # would not drop what cuDNN dropped)
        forward_fn = (reference_kernel.blockwise_forward if config.segments else
                      reference_kernel.forward)
        return reference_kernel.backward(config, inputs, output, lse, d_output, forward_fn)
    if config.fp8:
        return fp8_kernels.backward(config, inputs, output, lse, d_output)
    if config.segments:
        if config.has_sinks and _may_see_nothing(config):
            # Rows that see no key are the sink's whole (zeros), not the values' mean the
            # packed backward would grade: nothing flows back through them.
            kept = sink_softmax.rows_kept(lse, inputs["sinks"])
            d_output = jnp.where(kept[..., None], d_output, 0)
        return _packed_backward(config, inputs, output, lse, d_output)
    return tuple(_ffi.sdpa_backward(_without_sinks(inputs), output, lse, d_output, config))


def _paged_forward(config, inputs):
    """cuDNN's paged forward (paged_attention: forward only, one problem per call)."""
    query, key_cache = inputs["query"], inputs["key"]
    # Entries past a sequence's last page may hold anything: cuDNN must not follow them out
    # of the pool (the reference clamps the same way).
    page_table = jnp.clip(inputs["page_table"], 0, key_cache.shape[0] - 1)
    output, lse = _ffi.sdpa_paged_forward(query, key_cache, inputs["value"], inputs["q_lengths"],
                                          inputs["kv_lengths"], page_table, config)
    # Rows before a sequence's first key (kv_lengths[b] < T) see nothing: what cuDNN leaves
    # there is not the answer, and their lse must be the empty row's for the sinks.
    seen = reference_kernel.paged_rows_seeing_keys(query.shape[1], inputs["kv_lengths"])
    lse = jnp.where(seen[:, None, :], lse, large_negative())
    if config.has_sinks:
        output, lse = sink_softmax.apply(output, lse, inputs["sinks"])
    return output, lse


def _clear_rows_seeing_nothing(output, lse):
    """With soft-capping, cuDNN's padding is a mask inside the score modifier, not its own
    padding mode: rows whose every score is masked (past a query length, or a key length of 0)
    come back non-finite. They become zeros with the reference's large negative lse, which
    also keeps the backward's exp(scores - lse) at 0 there."""
    return fill_empty_rows(output, lse, ~jnp.isfinite(lse), 0)


def _without_sinks(inputs):
    return {name: x for name, x in inputs.items() if name != "sinks"}


def _documents(config, inputs):
    # Behind a barrier: ids known at compile time (a constant the caller closed over) would
    # otherwise have XLA evaluate the whole table on the host while it compiles, seconds per call.
    ids_and_lengths = jax.lax.optimization_barrier(
        {name: inputs.get(name) for name in ("q_segment_ids", "kv_segment_ids", "q_lengths",
                                             "kv_lengths")})
    return packing.documents(
        ids_and_lengths["q_segment_ids"], ids_and_lengths["kv_segment_ids"],
        max_segments=config.max_segments, q_lengths=ids_and_lengths["q_lengths"],
        kv_lengths=ids_and_lengths["kv_lengths"], aligned=config.banded)


def _ragged_operands(inputs, docs, entries):
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    return packing.ragged_operands(docs, query.shape[2], key.shape[2], query.shape[3],
                                   value.shape[3], key.shape[1], entries)


def _may_see_nothing(config) -> bool:
    """Whether a query of a packed call can see no key: its id missing among the keys, or key
    lengths cutting its document's keys. A row always sees its own position otherwise, and
    with the keys' lengths the queries' own, that key is inside them."""
    return config.segments == "cross" or (config.has_lengths and not config.same_lengths)


def _rows_to_average(config, inputs, docs):
    """bool [B, T]: rows that see no key but must average all values, as the reference (and
    jax.nn) do: within their query length, in a batch entry with at least one key."""
    rows = packing.rows_seeing_nothing(docs, config.window_left, config.window_right,
                                       inputs.get("q_lengths"))
    if inputs.get("kv_lengths") is not None:
        rows &= (inputs["kv_lengths"] > 0)[:, None]
    return rows


# The ragged kernels' grid covers every cuDNN batch entry up to the longest a document may be:
# empty entries and tiles past a document's end still cost a launch slot each (M = 64 entries
# per row against 8 cost 8% at 8 documents of 1024). Calls pick, on the device, the cheapest
# grid their documents fit: entries (a fraction of every slot, documents compacted to the front)
# times a length bound (a fraction of the row). One graph each, built when first used.
_LENGTH_FRACTIONS = (8, 4, 2, 1)
_SHORTEST_BOUND = 256
_ENTRY_FRACTIONS = (8, 1)  # of batch * max_segments, at least `batch`


def ragged_grids(batch, max_segments, q_seq_len, kv_seq_len):
    """[(entries, (queries, keys))], cheapest grid first; the last covers every case: the grids
    a checked packed call of these sizes chooses among (benchmarks/plans.py reads them)."""
    bounds = []
    for fraction in _LENGTH_FRACTIONS:
        bound = (-(-q_seq_len // fraction), -(-kv_seq_len // fraction))
        if (fraction == 1 or min(bound) >= _SHORTEST_BOUND) and bound not in bounds:
            bounds.append(bound)
    entries = sorted({max(batch, batch * max_segments // f) for f in _ENTRY_FRACTIONS})
    grids = [(n, bound) for n in entries for bound in bounds]
    return sorted(grids, key=lambda grid: (grid[0] * grid[1][0], grid[0]))


def _chosen_grid(docs, grids):
    """(int32 [3]: the first grid every document fits, as (entries, queries, keys); bool: the
    table cannot express the ids, and the exact fallback runs instead)."""
    # The table from Python's numbers as traced scalars: custom_partitioning allows no array
    # constant in what it traces.
    table = jnp.stack([jnp.stack([jnp.full((), number, jnp.int32) for number in (n, q, kv)])
                       for n, (q, kv) in grids])
    fits = ((packing.count_documents(docs) <= table[:, 0]) &
            (jnp.max(docs.q_len) <= table[:, 1]) & (jnp.max(docs.kv_len) <= table[:, 2]))
    return table[jnp.argmax(fits)], ~docs.ok


def _uniform_rows(config, inputs, docs, rows_kept):
    """bool [B, T] or None: the rows a ragged call leaves to be made the values' mean (rows that
    see no key; none but those of rows_kept, bool [B] or None: poisoned, or not the ragged
    layout's), None where no row can see nothing."""
    if not _may_see_nothing(config):
        return None
    uniform = _rows_to_average(config, inputs, docs)
    return uniform if rows_kept is None else uniform & ~rows_kept[:, None]


def _average_empty_rows(config, inputs, docs, output, lse, rows_kept=None):
    """A ragged call's rows that see no key, made the reference's (the values' mean); lse
    [B, N, T]."""
    uniform = _uniform_rows(config, inputs, docs, rows_kept)
    if uniform is None:
        return output, lse
    average = mean_value(inputs["query"].shape[2], inputs["value"])[:, None]
    return fill_empty_rows(output, lse, uniform[:, None, :], average)


def _average_rows_gradient(config, inputs, docs, d_output, rows_kept=None):
    """(d_output without the rows _average_empty_rows fills, those rows' dV or None)."""
    uniform = _uniform_rows(config, inputs, docs, rows_kept)
    if uniform is None:
        return d_output, None
    uniform = uniform[:, :, None, None]
    return (jnp.where(uniform, 0, d_output),
            mean_value_gradient(inputs["query"].shape[2], inputs["value"],
                                jnp.where(uniform, d_output, 0)))


def _add_value_gradient(dv, extra):
    return dv if extra is None else (dv.astype(jnp.float32) + extra).astype(dv.dtype)


# A caller who states the documents' bound (max_document_length) gets one ragged grid and no
# check: a checked call's cond predicate and grid are copied to the host, which waits for the
# GPU's queue to drain, and the GPU idles while the call launches.
def _stated_grid(inputs, config):
    return inputs["query"].shape[0] * config.max_segments, config.max_document_length


def _stated_documents(config, docs):
    """(docs with lengths cut to the stated bound, bool [B]: rows that break the statement:
    ids the table cannot express, or a document longer than the bound)."""
    bound_q, bound_kv = config.max_document_length
    broken = (~docs.row_ok | jnp.any(docs.q_len > bound_q, axis=1) |
              jnp.any(docs.kv_len > bound_kv, axis=1))
    return docs._replace(q_len=jnp.minimum(docs.q_len, bound_q),
                         kv_len=jnp.minimum(docs.kv_len, bound_kv)), broken


# A checked call (no statement) runs one ragged call on the grid its documents fit, chosen on
# the device (_chosen_grid) and read by its handler, which builds each grid's graph when it
# first runs: XLA compiles one custom call, not one per grid, and the workspace is sized once,
# from the graph its operands describe, the largest grid's. The operands are the document
# table's for the most entries: a grid of fewer entries reads their first rows (documents are
# compacted to the front). Where the table cannot express the ids, the exact fallback runs
# instead: for rows that are wholly their documents (self-attention without lengths) it is one
# dense cuDNN call the ragged call's handler runs itself on a grid of 0 documents (the ids go
# with it), so the call waits for the GPU once, for the grid; otherwise a lax.cond chooses,
# its predicate a second wait (a stated bound, none).
class _CheckedGrids:
    def __init__(self, config, inputs, docs):
        query, key = inputs["query"], inputs["key"]
        grids = ragged_grids(query.shape[0], config.max_segments, query.shape[1], key.shape[1])
        self.grid, self.fallback = _chosen_grid(docs, grids)
        self.operands = _ragged_operands(inputs, docs, max(entries for entries, _ in grids))
        self.config = config
        # packed_fallback's rows that see no key or lie past the lengths: none here.
        self.in_handler = config.segments == "self" and not config.has_lengths
        if self.in_handler:
            self.grid = self.grid.at[0].set(jnp.where(self.fallback, 0, self.grid[0]))

    def _ragged(self, call, *args):
        # The handler waits for the grid's numbers, which nothing recorded may do.
        config = dataclasses.replace(self.config, command_buffer=False)
        return call(*args, config, self.operands, grid=self.grid, fallback_ids=self.in_handler)

    def forward(self, inputs):
        """(output, token-major lse) of the documents' grid, or of the fallback."""
        if self.in_handler:
            return self._ragged(_ffi.sdpa_forward, inputs)

        def exact(inputs):
            output, lse = packed_fallback.forward(self.config, inputs)
            return output, jnp.swapaxes(lse, 1, 2)
        return jax.lax.cond(self.fallback, exact,
                            lambda inputs: self._ragged(_ffi.sdpa_forward, inputs), inputs)

    def backward(self, inputs, output, lse, d_output, cleared):
        """(dq, dk, dv) of the documents' grid (given the token-major lse and d_output cleared
        of the filled rows), or of the fallback (given them as they came)."""
        lse_tokens = jnp.swapaxes(lse, 1, 2)

        def ragged(inputs):
            return self._ragged(_ffi.sdpa_backward, inputs, output, lse_tokens, cleared)[:3]
        if self.in_handler:
            return ragged(inputs)

        def exact(inputs):
            return packed_fallback.backward(self.config, inputs, output, lse, d_output)[:3]
        return jax.lax.cond(self.fallback, exact, ragged, inputs)


def _fallback_rows(docs):
    """bool [B]: every row when the checked call runs its fallback, else none."""
    return jnp.broadcast_to(~docs.ok, docs.row_ok.shape)


def _packed_forward(config, inputs):
    docs = _documents(config, inputs)
    if config.max_document_length:
        # A row that broke the statement comes back NaN at its first token (the handler
        # writes it: XLA cannot update a slice of a custom call's result in place).
        docs, broken = _stated_documents(config, docs)
        entries, bound = _stated_grid(inputs, config)
        output, lse = _ffi.sdpa_forward(inputs, config, _ragged_operands(inputs, docs, entries),
                                        max_document_length=bound, poison_rows=broken)
        output, lse = _average_empty_rows(config, inputs, docs, output, jnp.swapaxes(lse, 1, 2),
                                          rows_kept=broken)
        return output, jnp.where(broken[:, None, None], jnp.nan, lse)
    output, lse = _CheckedGrids(config, inputs, docs).forward(inputs)
    # The fallback fills its own rows: the table describes none of them.
    return _average_empty_rows(config, inputs, docs, output, jnp.swapaxes(lse, 1, 2),
                               rows_kept=_fallback_rows(docs))


def _packed_backward(config, inputs, output, lse, d_output):
    docs = _documents(config, inputs)
    if config.max_document_length:
        docs, broken = _stated_documents(config, docs)
        entries, bound = _stated_grid(inputs, config)
        cleared, extra = _average_rows_gradient(config, inputs, docs, d_output)
        dq, dk, dv, _ = _ffi.sdpa_backward(
            inputs, output, jnp.swapaxes(lse, 1, 2), cleared, config,
            _ragged_operands(inputs, docs, entries), max_document_length=bound,
            poison_rows=broken)
        return dq, dk, _add_value_gradient(dv, extra), None
    cleared, extra = _average_rows_gradient(config, inputs, docs, d_output,
                                            rows_kept=_fallback_rows(docs))
    dq, dk, dv = _CheckedGrids(config, inputs, docs).backward(inputs, output, lse, d_output,
                                                              cleared)
    return dq, dk, _add_value_gradient(dv, extra), None
