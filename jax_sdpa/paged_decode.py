"""Decode steps (one new token per sequence) laid out for cuDNN's paged forward.

cuDNN's SDPA forward gives each (sequence, head) its own tiles of query rows. A decode step has
one row per head, so as given it runs B x N tiles of one useful row each, and with GQA the g
query heads of a K/V head each read that head's keys and values again. Two rewrites, both exact
for one query per sequence without a window (every query head then sees the same keys):

- fold: the g query heads that share a K/V head become g query rows of that head, so one tile
  reads each K/V head once for all of them (the GQA packing flash-attn's decode kernels use);
- split: each sequence's pages are cut into S chunks that run as separate batch entries (their
  own slices of the page table, their own lengths), and the partial outputs are merged with
  their log-sum-exps (flash-decoding), so that a small batch still fills the GPU.

The layout is chosen from static shapes and the GPU's SM count (benchmarks/paged.py measures
it against the plain layout).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Enough tiles for two waves over the SMs before splitting stops paying; chunks shorter than
# this many keys cost more in merging than they win in parallelism.
WAVES = 2
MIN_CHUNK_KEYS = 512
FALLBACK_SM_COUNT = 132  # an H100 / H200, where the device does not say


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
    fold: bool = False  # query heads of one K/V head as rows of that head
    splits: int = 1     # chunks of pages per sequence, merged by log-sum-exp


PLAIN = DecodeLayout()


def sm_count():
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or FALLBACK_SM_COUNT)


def choose(batch, q_seq_len, q_heads, kv_heads, max_pages, page_size, windowed, sms=None):
    """The layout for one call: PLAIN unless it is a decode step (T = 1) without a window."""
    if q_seq_len != 1 or windowed:
        return PLAIN
    fold = q_heads > kv_heads
    tiles = batch * (kv_heads if fold else q_heads)
    wanted = -(-WAVES * (sms or sm_count()) // tiles)
    longest = max_pages // max(1, -(-MIN_CHUNK_KEYS // page_size))
    splits = max(1, min(wanted, longest))
    # Whole pages per chunk; no chunk made only of padding.
    chunk_pages = -(-max_pages // splits)
    return DecodeLayout(fold=fold, splits=-(-max_pages // chunk_pages))


def fold_heads(query, kv_heads):
    """[B, 1, N, H] -> [B, g, K, H]: query head k * g + j becomes row j of K/V head k."""
    batch, _, q_heads, head_dim = query.shape
    return query.reshape(batch, kv_heads, q_heads // kv_heads, head_dim).transpose(0, 2, 1, 3)


def unfold_heads(output, stats):
    """fold_heads undone on the results: output [B, g, K, Hv] -> [B, 1, N, Hv], stats
    [B, K, g] -> [B, N, 1]."""
    batch, group, kv_heads, value_dim = output.shape
    output = output.transpose(0, 2, 1, 3).reshape(batch, 1, kv_heads * group, value_dim)
    return output, stats.reshape(batch, kv_heads * group, 1)


def split_pages(query, page_table, kv_lengths, splits, page_size):
    """Chunk s of sequence b becomes batch entry b * splits + s: its slice of the page table
    (padded with page 0, which its length masks) and its keys' count. Returns (query,
    page_table, kv_lengths) for that batch."""
    batch, max_pages = page_table.shape
    chunk_pages = -(-max_pages // splits)
    table = jnp.pad(page_table, ((0, 0), (0, splits * chunk_pages - max_pages)))
    chunk_keys = chunk_pages * page_size
    starts = jnp.arange(splits, dtype=jnp.int32) * chunk_keys
    lengths = jnp.clip(kv_lengths[:, None] - starts[None, :], 0, chunk_keys)
    return (jnp.repeat(query, splits, axis=0), table.reshape(batch * splits, chunk_pages),
            lengths.reshape(batch * splits))


def merge_chunks(output, stats, chunk_lengths, splits):
    """The chunks' partial results combined: output [B * S, T, N, Hv] and stats [B * S, N, T]
    (each chunk's log-sum-exp) -> [B, T, N, Hv] and [B, N, T]. A chunk with no keys counts for
    nothing, whatever cuDNN left in it; a row with no key at all gets zeros and -inf."""
    chunks, q_seq_len, heads, value_dim = output.shape
    batch = chunks // splits
    seen = (chunk_lengths > 0).reshape(batch, splits, 1, 1)
    stats = jnp.where(seen, stats.reshape(batch, splits, heads, q_seq_len), -jnp.inf)
    total = jax.nn.logsumexp(stats, axis=1)  # [B, N, T]
    finite_total = jnp.where(jnp.isfinite(total), total, 0.0)
    weights = jnp.where(seen, jnp.exp(stats - finite_total[:, None]), 0.0)
    partial = output.reshape(batch, splits, q_seq_len, heads, value_dim).astype(jnp.float32)
    partial = jnp.where(seen[..., None], partial, 0.0)
    # Elementwise, in float32 (a dot here could run in TF32).
    merged = jnp.sum(weights.transpose(0, 1, 3, 2)[..., None] * partial, axis=1)
    return merged.astype(output.dtype), total
