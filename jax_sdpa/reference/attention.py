"""The pure-JAX attention path: the same semantics as the cuDNN path, for every argument.

It runs on any backend (CPU, TPU, GPU), serves every call cuDNN cannot take, and is the
float32 oracle of the GPU tests. Its masking follows jax.nn.dot_product_attention: masked
scores are filled with a large negative number (not -inf), so a row that a mask hides entirely
averages all values uniformly; the rows of query positions past `query_seq_lengths`, and every
row of a batch entry whose `key_value_seq_lengths` is 0, are zeroed (as cuDNN does; jax.nn's XLA
path would average there too).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["attention_reference"]


def repeat_heads(x, heads):
    """[B, S, K, H] -> [B, S, heads, H]: each key/value head repeated for its group of query
    heads (GQA/MQA; the reference paths' one expansion)."""
    return jnp.repeat(x, heads // x.shape[2], axis=2) if x.shape[2] != heads else x


def fold_heads(x, kv_heads):
    """[B, S, N, H] per query head -> [B, S, K, H] per key/value head (each group summed):
    repeat_heads' transpose, for gradients."""
    batch, seq, heads, dim = x.shape
    return x.reshape(batch, seq, kv_heads, heads // kv_heads, dim).sum(3)


def large_negative() -> float:
    # As jax.nn: finite, so that a fully masked row gives a uniform softmax instead of NaN.
    return -0.7 * float(np.finfo(np.float32).max)


def mask_to_bias(mask, dtype):
    """Boolean mask (True = attend) -> additive bias: 0 where attended, a large negative number
    elsewhere, with room left to add a user's bias without overflowing the dtype."""
    return jnp.where(mask, 0.0, -0.5 * float(jnp.finfo(dtype).max)).astype(dtype)


def combined_mask(q_seq_len, kv_seq_len, *, mask=None, is_causal=False,
                  query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                  diagonal_offset=0, query_segment_ids=None, kv_segment_ids=None):
    """Boolean mask broadcastable to [B, N, T, S] (True = attend), or None when nothing masks.

    Query i sits on the diagonal at key i + diagonal_offset (0: top-left, S - T: bottom-right);
    causal and the window are measured from there. Segment ids ([B, T] / [B, S]; the keys'
    default to the queries'): a query sees only keys with its id. This is the one place the
    structured masks become a dense one."""
    parts = []
    if mask is not None:
        parts.append(mask)
    if query_segment_ids is not None:
        kv_ids = query_segment_ids if kv_segment_ids is None else kv_segment_ids
        parts.append(query_segment_ids[:, None, :, None] == kv_ids[:, None, None, :])
    q_pos = jnp.arange(q_seq_len)[:, None] + diagonal_offset
    k_pos = jnp.arange(kv_seq_len)[None, :]
    if is_causal:
        parts.append((q_pos >= k_pos)[None, None])
    if local_window_size is not None:
        left, right = local_window_size
        parts.append(((q_pos <= k_pos + left) & (q_pos >= k_pos - right))[None, None])
    if query_seq_lengths is not None:
        valid = jnp.arange(q_seq_len)[None, :] < query_seq_lengths[:, None]
        parts.append(valid[:, None, :, None])
    if key_value_seq_lengths is not None:
        valid = jnp.arange(kv_seq_len)[None, :] < key_value_seq_lengths[:, None]
        parts.append(valid[:, None, None, :])
    if not parts:
        return None
    result = parts[0]
    for part in parts[1:]:
        result = jnp.logical_and(result, part)
    return result


def dropout_keep_mask(rng, rate, shape):
    """The reference path's dropout draw: True where a weight is kept (probability 1 - rate)."""
    return jax.random.bernoulli(rng, 1.0 - rate, shape)


def modified_scores(score_mod, scores):
    """score_mod(score, batch, head, q_index, kv_index) over scaled scores [B, N, T, S]: the
    indices int32, broadcastable to the scores (query head, row positions), the result
    broadcast back to the scores' shape and dtype."""
    def index(axis):
        size = scores.shape[axis]
        return jnp.arange(size, dtype=jnp.int32).reshape(
            [size if a == axis else 1 for a in range(4)])
    modified = jnp.asarray(score_mod(scores, index(0), index(1), index(2), index(3)))
    try:
        fits = jnp.broadcast_shapes(modified.shape, scores.shape) == scores.shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"score_mod must return the score's shape {scores.shape} (an "
                         f"elementwise function), got {modified.shape}")
    return jnp.broadcast_to(modified, scores.shape).astype(scores.dtype)


def alibi_slopes(num_heads: int):
    """The standard ALiBi slopes, float32 [num_heads]: 2^(-8 i / n) for i = 1..n when n is a
    power of two; otherwise those of the largest power of two m below n, then every other one
    of 2m's (Press et al.; as BLOOM and flash-attn's tests take them)."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")

    def powers_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]
    closest = 1 << (num_heads.bit_length() - 1)
    slopes = powers_of_two(closest)
    if closest < num_heads:
        slopes += powers_of_two(2 * closest)[0::2][:num_heads - closest]
    return jnp.asarray(np.array(slopes, np.float32))


def alibi(slopes, q_seq_len, kv_seq_len):
    """ALiBi as a score modifier: score - slope * |i + S - T - j| (flash-attn's convention: query
    i sits at key i + S - T), the slopes float [N] per query head or [B, N]."""
    slopes = jnp.asarray(slopes)

    def score_mod(score, batch, head, q_index, kv_index):
        slope = slopes[batch, head] if slopes.ndim == 2 else slopes[head]
        distance = jnp.abs(q_index + (kv_seq_len - q_seq_len) - kv_index)
        return score - slope.astype(score.dtype) * distance.astype(score.dtype)
    return score_mod


def attention_reference(query, key, value, bias=None, mask=None, *, scale, is_causal=False,
                        query_seq_lengths=None, key_value_seq_lengths=None,
                        local_window_size=None, diagonal_offset=0, dropout_rate=0.0,
                        dropout_rng=None, dropout_keep=None, query_segment_ids=None,
                        kv_segment_ids=None, logits_soft_cap=None, sinks=None,
                        score_mod=None):
    """Attention on [B, T, N, H] queries and [B, S, K, Hv] keys/values (N a multiple of K).

    Scores and softmax are float32 for float16/bfloat16/float32 inputs. Dropout
    (dropout_rate > 0) keeps each weight with probability 1 - rate and scales kept weights by
    1 / (1 - rate); the keep mask is drawn from dropout_rng, or given as dropout_keep ([B, N,
    T, S], e.g. cuDNN's own mask in a test). logits_soft_cap: scaled scores become cap *
    tanh(scores / cap), before the bias and masks. score_mod(score, batch, head, q_index,
    kv_index): an elementwise function of the scaled (and soft-capped) float32 scores and their
    int32 indices (query head, row positions), applied before the bias and masks (modified_scores).
    sinks: float [N], one logit per query head
    that joins each row's softmax denominator (a row that sees no key then gives zeros).
    Returns (output [B, T, N, Hv] in the query's dtype, lse [B, N, T] float32, float64 for
    float64 inputs): lse is the log-sum-exp of each row of masked scores (and the sink),
    before dropout.
    """
    batch, q_seq_len, q_heads, head_dim = query.shape
    kv_seq_len = key.shape[1]
    # Scores, softmax and both products in float32 (float64 for float64 inputs, as jax.nn).
    compute = jnp.float64 if jnp.dtype(query.dtype) == jnp.float64 else jnp.float32
    precision = jax.lax.Precision.HIGHEST
    # Each query head against its key/value head, as four-axis products: XLA's CPU dot of a
    # five-axis grouped form rounds worse (1.6x jax.nn's error on scores, float32).
    key, value = repeat_heads(key, q_heads), repeat_heads(value, q_heads)
    logits = jnp.einsum("btnh,bsnh->bnts", query, key, precision=precision,
                        preferred_element_type=compute) * jnp.asarray(scale, compute)
    if logits_soft_cap is not None:
        cap = jnp.asarray(logits_soft_cap, compute)
        logits = cap * jnp.tanh(logits / cap)
    if score_mod is not None:
        # -inf from a score_mod masks as a mask does (a row it empties follows their rule)
        logits = modified_scores(score_mod, logits)
        logits = jnp.where(logits == -jnp.inf, jnp.asarray(large_negative(), compute), logits)
    if bias is not None:
        logits = logits + bias.astype(compute)
    keep = combined_mask(q_seq_len, kv_seq_len, mask=mask, is_causal=is_causal,
                         query_seq_lengths=query_seq_lengths,
                         key_value_seq_lengths=key_value_seq_lengths,
                         local_window_size=local_window_size, diagonal_offset=diagonal_offset,
                         query_segment_ids=query_segment_ids, kv_segment_ids=kv_segment_ids)
    if keep is not None:
        logits = jnp.where(keep, logits, jnp.asarray(large_negative(), compute))
    lse = jax.nn.logsumexp(logits, axis=-1)
    if sinks is None:
        # softmax, not exp(logits - lse): for a fully masked row lse rounds to the fill value.
        probs = jax.nn.softmax(logits, axis=-1)
    else:
        lse = jnp.logaddexp(lse, sinks.astype(compute)[None, :, None])
        probs = jnp.exp(logits - lse[..., None])
    if dropout_rate > 0.0:
        if dropout_keep is None:
            dropout_keep = dropout_keep_mask(dropout_rng, dropout_rate, probs.shape)
        probs = jnp.where(dropout_keep.astype(bool), probs / (1.0 - dropout_rate),
                          jnp.zeros((), probs.dtype))
    probs = probs.astype(value.dtype)  # the weights in the values' dtype, as jax.nn's
    # In the values' dtype, as jax.nn (accumulated in float32; XLA's CPU backend has no dot of
    # transposed bfloat16 operands with a float32 result).
    out = jnp.einsum("bnts,bsnh->btnh", probs, value, precision=precision)
    zero = jnp.zeros((), out.dtype)
    if query_seq_lengths is not None:
        valid = jnp.arange(q_seq_len)[None, :] < query_seq_lengths[:, None]
        out = jnp.where(valid[:, :, None, None], out, zero)
    if key_value_seq_lengths is not None:
        out = jnp.where((key_value_seq_lengths > 0)[:, None, None, None], out, zero)
    return out.astype(query.dtype), lse


def spec_options(spec, q_seq_len, kv_seq_len, first_row=0) -> dict:
    """attention_reference's keywords that a CallSpec's static description gives, for rows
    first_row.. of T queries against S keys: the one reading of a spec as the semantics."""
    return dict(scale=spec.scale, local_window_size=spec.window(),
                diagonal_offset=spec.diagonal_offset(q_seq_len, kv_seq_len) + first_row,
                dropout_rate=spec.dropout, logits_soft_cap=spec.logits_soft_cap or None)


def described_attention(call):
    """attention_reference of a validated call (jax_sdpa.call.validation.AttentionCall): its
    operands, read as its description (a CallSpec) says."""
    return attention_reference(
        call.query, call.key, call.value, call.bias, call.mask,
        query_seq_lengths=call.query_seq_lengths,
        key_value_seq_lengths=call.key_value_seq_lengths, dropout_rng=call.dropout_rng,
        query_segment_ids=call.query_segment_ids, kv_segment_ids=call.kv_segment_ids,
        sinks=call.sinks, score_mod=call.score_mod,
        **spec_options(call.spec, call.query.shape[1], call.key.shape[1]))
