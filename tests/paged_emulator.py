"""A pure-JAX stand-in for our paged FFI forward, for testing paged_attention's cuDNN path on
CPU: it reads the operands as cuDNN's paged graph does (pages through the table, the padding
mask from q_lengths and kv_lengths, the band measured bottom-right from each sequence's actual
lengths, cuDNN's exclusive left bound) and leaves NaN in rows that see no key, so a test fails
if the paged path (jax_sdpa/kernels/dispatch.py, api/paged.py) relies on what cuDNN writes
there. It fails loudly on a table entry outside the pool: cuDNN would read out of bounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def forward(query, key_cache, value_cache, q_lengths, kv_lengths, page_table, config):
    pages, page_size, kv_heads, _ = key_cache.shape
    batch, q_seq_len, q_heads, head_dim = query.shape
    outside = jnp.any((page_table < 0) | (page_table >= pages))
    key = key_cache[jnp.clip(page_table, 0, pages - 1)]  # [B, max_pages, page_size, K, H]
    value = value_cache[jnp.clip(page_table, 0, pages - 1)]
    key = key.reshape(batch, -1, kv_heads, head_dim).astype(jnp.float32)
    value = value.reshape(batch, -1, kv_heads, value.shape[-1]).astype(jnp.float32)
    groups = q_heads // kv_heads
    key, value = jnp.repeat(key, groups, axis=2), jnp.repeat(value, groups, axis=2)
    i = jnp.arange(q_seq_len)[None, :, None]
    j = jnp.arange(key.shape[1])[None, None, :]
    q_len, kv_len = q_lengths[:, None, None], kv_lengths[:, None, None]
    seen = (i < q_len) & (j < kv_len)
    shift = kv_len - q_len if config.bottom_right else 0
    if config.window_right >= 0:
        seen &= j <= i + shift + config.window_right
    if config.window_left >= 0:
        seen &= j >= i + shift - config.window_left
    scores = jnp.einsum("bqnh,bknh->bnqk", query.astype(jnp.float32), key,
                        precision=jax.lax.Precision.HIGHEST) * config.scale
    scores = jnp.where(seen[:, None], scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, N, T]; -inf where nothing is seen
    weights = jnp.exp(scores - lse[..., None])  # NaN where nothing is seen
    output = jnp.einsum("bnqk,bknh->bqnh", weights, value, precision=jax.lax.Precision.HIGHEST)
    output = jnp.where(outside, jnp.nan, output)
    return output.astype(query.dtype), lse
