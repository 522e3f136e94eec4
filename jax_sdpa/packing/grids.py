"""The ragged grids a checked packed call chooses among on the device.

cuDNN's ragged kernels cover every batch entry up to the longest a document may be: empty
entries and tiles past a document's end still cost a launch slot each (64 entries per row
against 8 cost 8% at 8 documents of 1024). A checked call picks, on the device, the cheapest
grid its documents fit: entries (a fraction of every slot, documents compacted to the front)
times a length bound (a fraction of the row); the handler builds each grid's graph when first
used.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_sdpa.packing import documents

_LENGTH_FRACTIONS = (8, 4, 2, 1)
SHORTEST_BOUND = 256
_ENTRY_FRACTIONS = (8, 1)  # of batch * max_segments, at least `batch`


def ragged_grids(batch, max_segments, q_seq_len, kv_seq_len):
    """[(entries, (queries, keys))], cheapest grid first; the last covers every case: the grids
    a checked packed call of these sizes chooses among (benchmarks/plans.py reads them)."""
    bounds = []
    for fraction in _LENGTH_FRACTIONS:
        bound = (-(-q_seq_len // fraction), -(-kv_seq_len // fraction))
        if (fraction == 1 or min(bound) >= SHORTEST_BOUND) and bound not in bounds:
            bounds.append(bound)
    entries = sorted({max(batch, batch * max_segments // f) for f in _ENTRY_FRACTIONS})
    grids = [(n, bound) for n in entries for bound in bounds]
    return sorted(grids, key=lambda grid: (grid[0] * grid[1][0], grid[0]))


def chosen_grid(docs, grids):
    """(int32 [3]: the first grid every document fits, as (entries, queries, keys); bool: the
    table cannot express the ids, and the exact fallback runs instead)."""
    # The table from Python's numbers as traced scalars: custom_partitioning allows no array
    # constant in what it traces.
    table = jnp.stack([jnp.stack([jnp.full((), number, jnp.int32) for number in (n, q, kv)])
                       for n, (q, kv) in grids])
    fits = ((documents.count_documents(docs) <= table[:, 0]) &
            (jnp.max(docs.q_len) <= table[:, 1]) & (jnp.max(docs.kv_len) <= table[:, 2]))
    return table[jnp.argmax(fits)], ~docs.ok
