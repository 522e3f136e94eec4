"""Drop-in ``attention_fn`` for Flax: ``flax.linen.MultiHeadDotProductAttention`` and
``flax.nnx.MultiHeadAttention``.

    import jax_sdpa.flax
    layer = nnx.MultiHeadAttention(..., attention_fn=jax_sdpa.flax.dot_product_attention)

Linen passes only the keywords this function names, NNX passes all of them (and ``is_causal``).
Attention dropout in training runs as jax_sdpa's dropout: one independent mask per batch entry
and head (Flax's ``broadcast_dropout=True`` would share one mask across them). Whatever fused
attention cannot do (sowing attention weights, custom einsums) runs through Flax's own
attention (on an NVIDIA GPU with float16/bfloat16 inputs, with a warning naming why).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import linen

from jax_sdpa import masks
from jax_sdpa.api import attention as _attention
from jax_sdpa.call import planning
from jax_sdpa.common.warn import warn


def _fold_leading(array, batch_shape):
    """Mask/bias broadcastable to [batch..., heads, T, S] -> [prod(batch), heads, T, S], the
    batch axes folded as the queries' are (with one batch axis it is passed as is)."""
    if array is None or (len(batch_shape) == 1 and array.ndim <= 4):
        return array
    trailing = (1,) * max(0, 3 - array.ndim) + array.shape[-3:]
    array = jnp.broadcast_to(array, (*batch_shape, *trailing))
    return array.reshape((-1, *trailing))


def _flax_fallback_reason(module, qk_attn_weights_einsum, attn_weights_value_einsum,
                          einsum_dot_general):
    if module is not None:
        return "module= asks to sow the attention weights, which fused attention never forms"
    if any(f is not None for f in (qk_attn_weights_einsum, attn_weights_value_einsum,
                                   einsum_dot_general)):
        return "custom einsum functions need the explicit attention weights"
    return None


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                          precision=None, module=None, force_fp32_for_softmax=False,
                          einsum_dot_general=None, qk_attn_weights_einsum=None,
                          attn_weights_value_einsum=None, promote_dtype=None, is_causal=False,
                          logits_soft_cap=None, sinks=None, score_mod=None, alibi_slopes=None):
    """Flax's attention_fn contract: q ``[batch..., T, N, H]``, k/v ``[batch..., S, K, H]``,
    mask (True = attend; or a jax_sdpa.masks description, which Flax's modules pass through
    unchanged) and bias broadcastable to ``[batch..., N, T, S]``. Softmax is always
    float32 here, so ``force_fp32_for_softmax`` and ``precision`` need no action.

    Flax's modules never pass ``logits_soft_cap``, ``sinks``, ``score_mod`` or ``alibi_slopes``
    (jax_sdpa.dot_product_attention's meaning); bind them: ``functools.partial(
    jax_sdpa.flax.dot_product_attention, alibi_slopes=jax_sdpa.alibi_slopes(12))``. Learned
    sinks belong to a module of your own (README)."""
    del precision, force_fp32_for_softmax, promote_dtype
    reason = _flax_fallback_reason(module, qk_attn_weights_einsum, attn_weights_value_einsum,
                                   einsum_dot_general)
    ours = dict(logits_soft_cap=logits_soft_cap, sinks=sinks, score_mod=score_mod,
                alibi_slopes=alibi_slopes)
    if reason is not None and any(value is not None for value in ours.values()):
        given = ", ".join(name for name, value in ours.items() if value is not None)
        raise NotImplementedError(f"jax_sdpa.flax: {given} need jax_sdpa's attention, but "
                                  f"{reason}")
    if reason is not None:
        if planning.fallback_costs_speed(query.dtype):
            warn(f"jax_sdpa.flax: using Flax's attention because {reason}")
        if isinstance(mask, masks.Mask):  # Flax's attention takes arrays only
            q_seq, kv_seq, batch = query.shape[-3], key.shape[-3], math.prod(query.shape[:-3])
            boolean = mask.to_boolean(q_seq, kv_seq, batch)
            mask = jnp.broadcast_to(boolean, (batch, boolean.shape[1], q_seq, kv_seq)).reshape(
                (*query.shape[:-3], boolean.shape[1], q_seq, kv_seq))
        if is_causal:
            causal = linen.make_causal_mask(jnp.ones(query.shape[:-2]), dtype=jnp.bool_)
            mask = causal if mask is None else jnp.logical_and(mask, causal)
        return linen.dot_product_attention(
            query, key, value, bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
            dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
            dtype=dtype, module=module, qk_attn_weights_einsum=qk_attn_weights_einsum,
            attn_weights_value_einsum=attn_weights_value_einsum)
    common = jnp.result_type(query, key, value) if dtype is None else dtype
    query, key, value = (x.astype(common) for x in (query, key, value))
    batch_shape = query.shape[:-3]
    described = isinstance(mask, masks.Mask)  # a jax_sdpa.masks description goes as it is
    if mask is not None and not described:
        mask = jnp.asarray(mask).astype(jnp.bool_)  # Flax's masks may be float (nonzero = attend)
    dropping = dropout_rate > 0.0 and not deterministic
    return _attention.dot_product_attention(
        query, key, value, bias=_fold_leading(bias, batch_shape),
        mask=mask if described else _fold_leading(mask, batch_shape), is_causal=is_causal,
        dropout_rate=float(dropout_rate) if dropping else 0.0,
        dropout_rng=dropout_rng if dropping else None, **ours)
