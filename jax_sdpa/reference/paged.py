"""The reference of a paged call (paged_attention): each sequence's pages gathered into rows,
then attention with the same semantics as cuDNN's paged forward."""

from __future__ import annotations

import jax.numpy as jnp

from jax_sdpa.reference.attention import attention_reference


def _gathered(cache, page_table):
    """[B, max_pages * page_size, K, H]: each sequence's pages in order. Entries past a
    sequence's last page may hold any value: clamped into the pool, their keys are masked."""
    pages = jnp.clip(page_table, 0, cache.shape[0] - 1)
    gathered = cache[pages]  # [B, max_pages, page_size, K, H]
    return gathered.reshape(gathered.shape[0], -1, *gathered.shape[3:])


def forward(config, inputs):
    """A paged call: each sequence's pages gathered, its band measured from its own lengths
    (query i at kv_lengths[b] - T + i; the config's bounds, inclusive)."""
    query, kv_lengths = inputs["query"], inputs["kv_lengths"]
    key = _gathered(inputs["key"], inputs["page_table"])
    value = _gathered(inputs["value"], inputs["page_table"])
    q_seq_len = query.shape[1]
    position = kv_lengths[:, None] - q_seq_len + jnp.arange(q_seq_len)[None, :]  # [B, T]
    keys = jnp.arange(key.shape[1])[None, None, :]
    seen = keys < kv_lengths[:, None, None]
    if config.window_right >= 0:
        seen &= keys <= position[..., None] + config.window_right
    if config.window_left >= 0:
        seen &= keys >= position[..., None] - config.window_left
    return attention_reference(query, key, value, None, seen[:, None], scale=config.scale,
                               logits_soft_cap=config.logits_soft_cap or None,
                               sinks=inputs.get("sinks"))
