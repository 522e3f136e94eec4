"""The paged target (jax_sdpa_paged_forward): cuDNN's forward over a paged K/V cache, the page
table read in place, forward only."""

from __future__ import annotations

from jax_sdpa.cudnn import call
from jax_sdpa.cudnn.targets import BY_NAME

FORWARD = BY_NAME["jax_sdpa_paged_forward"]


def forward(query, key_pages, value_pages, q_lengths, kv_lengths, page_table, spec):
    """(output [B, T, N, Hv], lse float32 [B, N, T]).

    key_pages [P, page_size, K, H], value_pages [P, page_size, K, Hv]: the page pools;
    page_table int32 [B, max_pages]; q_lengths and kv_lengths int32 [B] (cuDNN's padding
    mask: the band is measured from each sequence's actual lengths)."""
    operands = dict(query=query, key=key_pages, value=value_pages, q_lengths=q_lengths,
                    kv_lengths=kv_lengths, page_table=page_table)
    # The handler takes one problem: under vmap, one call per element.
    return call.ffi_call(FORWARD, spec, operands, {},
                         (call.output_type(query, value_pages), call.stats_type(query)),
                         vmap_method="sequential")
