"""dot_product_attention: jax.nn.dot_product_attention's signature, cuDNN's fused kernels."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jax_sdpa import masks
from jax_sdpa.call import inputs as fused_path
from jax_sdpa.call import planning
from jax_sdpa.reference import empty_rows
from jax_sdpa.reference.attention import described_attention
from jax_sdpa.call.spec import checked_window
from jax_sdpa.call.validation import AttentionCall, checked_residual_dtype, validate
from jax_sdpa.common.warn import warn
from jax_sdpa.limits import device
from jax_sdpa.limits import pieces as limits_pieces
from jax_sdpa.pieces import plan as pieces_plan


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual=False,
                          deterministic=False, causal_alignment="top_left", dropout_rate=0.0,
                          dropout_rng=None, query_segment_ids=None, kv_segment_ids=None,
                          max_segments=None, logits_soft_cap=None, sinks=None,
                          max_document_length=None, residual_dtype=None, fp8=False,
                          score_mod=None, alibi_slopes=None):
    """Scaled dot-product attention, ``softmax(scale * Q K^T + bias) V``, per head.

    Args:
      query: ``[batch..., T, N, H]`` (or ``[T, N, H]``), float16/bfloat16 for cuDNN.
      key: ``[batch..., S, K, H]``; ``N`` must be a multiple of ``K`` (GQA / MQA).
      value: ``[batch..., S, K, Hv]``; ``Hv`` may differ from ``H`` (the output has ``Hv``).
      bias: optional float array broadcastable to ``[B, N, T, S]``, added to the scores.
      mask: optional boolean array broadcastable to ``[B, N, T, S]``; True = attend. Or a
        ``jax_sdpa.masks`` description (causal, sliding_window, documents, prefix_lm,
        global_tokens, block_table, from_boolean, combined with ``|`` and ``&``): those
        cuDNN's own masks express run as those masks, the others as their boolean form.
      scale: score scale; defaults to ``1 / sqrt(H)``.
      is_causal: causal mask, aligned top-left (query i sees keys 0..i), as jax.nn.
      query_seq_lengths, key_value_seq_lengths: optional int32 ``[B]`` valid lengths; query rows
        past their length are zeroed.
      local_window_size: ``w`` or ``(left, right)``: query i sees keys ``i-left .. i+right``
        (measured from the diagonal that causal_alignment places).
      implementation: ``None`` (cuDNN when it can run the call, else the XLA reference path,
        with a warning naming why only where that is a speed cliff: float16/bfloat16 inputs on
        an NVIDIA GPU), ``"cudnn"`` (cuDNN or an error naming why), ``"xla"``.
      return_residual: also return the log-sum-exp of each score row, ``[batch..., T, N]`` in
        the inputs' dtype, as jax.nn; under stop_gradient (its cotangent is ignored). A row
        that sees no key (masked, past a length) holds jax.nn's large negative fill.
      deterministic: cuDNN's deterministic backward (bitwise reproducible; slower). Not in
        jax.nn. The reference path is deterministic anyway.
      causal_alignment: ``"top_left"`` (jax.nn: query i sits at key i) or ``"bottom_right"``
        (query i sits at key ``i + S - T``: the last query sees every key, as in decoding and
        chunked prefill). Applies to is_causal and local_window_size. Not in jax.nn.
      dropout_rate, dropout_rng: attention dropout: each weight is dropped with probability
        dropout_rate and the kept ones scaled by ``1 / (1 - dropout_rate)``; the mask comes from
        the PRNG key dropout_rng (one key: the same key drops the same weights, and the
        backward drops what the forward dropped). Not in jax.nn.
      query_segment_ids, kv_segment_ids: int32 ``[B, T]`` / ``[B, S]`` ids for packed sequences:
        a query attends only to keys with its id (kv_segment_ids defaults to the query's when
        ``T == S``). Combines with every other mask; is_causal and the window stay measured in
        row positions (for documents packed at the same positions among queries and keys,
        that is causal within each document, from its first token). Not in jax.nn. On cuDNN
        (Hopper or newer) each document runs as its own entry of cuDNN's ragged layout, at the
        cost of its own tokens: no [T, S] array is formed. That needs each document to be one
        contiguous run of tokens (any ids, any order, padding its own document), at most
        max_segments per row, and with causal/window and separate kv_segment_ids, a document's
        keys starting where its queries do; the call checks this on the device and computes
        any other rows exactly, query block by query block (slower, still O(T) memory).
      max_segments: the most documents per row the ragged layout takes (static; default 64).
        Each slot costs a little even when empty; rows holding more take the exact fallback.
      max_document_length: None, or an int (or ``(queries, keys)``): the caller states that
        every row's documents are contiguous runs of at most this many tokens, at most
        max_segments per row (and, with causal/window and kv_segment_ids, keys starting where
        their queries do) — what a packing data loader knows. cuDNN's ragged layout then runs
        one plan of B × max_segments documents of up to this many tokens, with no check on the
        device and no exact fallback (the check costs host round trips): state max_segments
        as tightly too, since every slot of the plan costs. A row that
        breaks the statement is never silently wrong: its first query token's output and its
        residual rows come back NaN (and the gradients' first token rows). Static. The
        reference path is exact either way.
      logits_soft_cap: a positive float or None: the scaled scores ``scale * Q K^T`` become
        ``cap * tanh(scores / cap)`` (Gemma 2, tokamax's convention), after scaling and before
        the bias, masks and softmax. Not in jax.nn.
      sinks: None or a float array ``[N]`` (float32 or the inputs' dtype): one learnable logit
        per query head (attention sinks, gpt-oss style) that joins every softmax row's
        denominator and contributes no value: weights become ``exp(s_ij) / (exp(sinks[n]) +
        sum_j exp(s_ij))``. Differentiable. A row that sees no key gives zeros (the sink takes
        all the weight), and the returned residual includes the sink. Not in jax.nn.
      residual_dtype: None (the inputs' dtype, as jax.nn) or a float dtype for the residual,
        e.g. ``jnp.float32`` for the kernels' own float32 log-sum-exp (to merge partial
        attentions, say). Not in jax.nn.

      fp8: FP8 attention (Hopper and newer): Q, K and V are quantized to float8_e4m3fn with
        per-tensor current scaling (scales from their amaxes, on the device), cuDNN's FP8
        kernels run, and the output comes back in the inputs' dtype; the backward quantizes
        the output cotangent, the score gradient and the gradients to float8_e5m2, with scales
        from bounds they cannot exceed (jax_sdpa/reference/fp8_scaling.py). Takes is_causal
        (top-left), sequence lengths and GQA/MQA, nothing else. The XLA path computes the same
        roundings. Not in jax.nn.

      score_mod: None or a function ``score_mod(score, batch, head, q_index, kv_index) ->
        score`` of the scaled (and soft-capped) float32 scores ``scale * Q K^T`` and their int32
        indices (query head; row positions), applied elementwise before the bias and masks, as
        FlexAttention's. It may close over arrays (a per-head table; gradients flow to them on
        the reference path, and on cuDNN they must be wrapped in ``jax.lax.stop_gradient``).
        On cuDNN inside its fused kernels where its nodes express the function
        (docs/score_mod.md), else on the reference path (with a warning on a GPU). Not in
        jax.nn.
      alibi_slopes: None or float32 ``[N]`` or ``[B, N]``: ALiBi, ``score - slope * |i + S - T
        - j|`` (flash-attn's convention), after score_mod; ``jax_sdpa.alibi_slopes(N)`` gives
        the standard slopes. On cuDNN as a score modifier (``[B, N]`` only at B = 1). Not in
        jax.nn.

    Returns:
      The attention output, shaped like ``query``; with ``return_residual``, ``(output, lse)``.
    """
    residual_dtype = checked_residual_dtype(residual_dtype, query)
    call, spec = planned(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                         query_seq_lengths=query_seq_lengths,
                         key_value_seq_lengths=key_value_seq_lengths,
                         local_window_size=local_window_size, implementation=implementation,
                         deterministic=deterministic, causal_alignment=causal_alignment,
                         dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                         query_segment_ids=query_segment_ids, kv_segment_ids=kv_segment_ids,
                         max_segments=max_segments, logits_soft_cap=logits_soft_cap,
                         sinks=sinks, max_document_length=max_document_length, fp8=fp8,
                         score_mod=score_mod, alibi_slopes=alibi_slopes)
    if spec.implementation == "cudnn" or spec.fp8:  # FP8's arithmetic lives in the kernels
        output, lse = fused_path.run(call, spec)
    else:
        output, lse = described_attention(call)
    output = output.reshape(call.output_shape)
    if not return_residual:
        return output
    return output, _residual(call, lse, residual_dtype)


def planned(query, key, value, bias, mask, *, implementation, deterministic, is_causal,
            local_window_size, query_segment_ids, kv_segment_ids, causal_alignment, **options):
    """(the validated call, its planned CallSpec): what dot_product_attention runs, warning or
    raising where planning does (jax_sdpa.explain reports the same)."""
    keywords = dict(is_causal=is_causal, local_window_size=local_window_size,
                    query_segment_ids=query_segment_ids, kv_segment_ids=kv_segment_ids)

    def validated(mask, keywords, score_mod):
        return validate(query, key, value, bias, mask, implementation=implementation,
                        causal_alignment=causal_alignment, **keywords,
                        **dict(options, score_mod=score_mod))
    call = cut = None
    if isinstance(mask, masks.Mask):
        cut, call = _pieces(mask, query, key, implementation, keywords, causal_alignment,
                            options, validated)
        if cut is None:
            mask, keywords, options["score_mod"], call = _described_mask(
                mask, query, key, implementation, options, keywords, causal_alignment,
                validated)
    call = call or validated(mask, keywords, options.get("score_mod"))
    spec = planning.plan(call, implementation, deterministic=bool(deterministic))
    if cut is not None:
        spec = dataclasses.replace(spec, pieces=cut.forward, backward_pieces=cut.backward)
    return call, spec


def _pieces(mask, query, key, implementation, keywords, causal_alignment, options, validated):
    """(the description's pieces, the call validated without its mask) where it runs as
    pieces on cuDNN (jax_sdpa/pieces/: tiles skipped, forward and backward), else (None,
    None). The call's own causal flag and window join the description (top-left)."""
    if implementation == "xla" or device.device_reason() is not None:
        return None, None  # the reference path runs every description exactly
    if keywords["query_segment_ids"] is not None or (
            causal_alignment != "top_left" and (keywords["is_causal"] or
                                                keywords["local_window_size"] is not None)):
        return None, None
    if keywords["is_causal"]:
        mask = mask & masks.causal()
    if keywords["local_window_size"] is not None:
        mask = mask & masks.sliding_window(*checked_window(keywords["local_window_size"]))
    if mask.heads() not in (None, query.shape[-2]):
        return None, None  # (the described route names the mismatch)
    call = validated(None, dict(keywords, is_causal=False, local_window_size=None),
                     options.get("score_mod"))
    if limits_pieces.call_reason(call) or planning.cudnn_reason(call):
        return None, None
    cut = pieces_plan.plan(mask, query.shape[-3], key.shape[-3], query.shape[-2],
                           key.shape[-2])
    if isinstance(cut, str) or limits_pieces.plan_reason(cut, call):
        return None, None
    return cut, call


def _described_mask(mask, query, key, implementation, options, keywords, causal_alignment,
                    validated):
    """A jax_sdpa.masks description as (boolean mask or None, the keywords, the score_mod, the
    validated call where checking the route made it, else None): cuDNN's own masks (merged
    into the keywords) where they say it; else, where the mask is a test of positions and
    cuDNN runs it as one (or no GPU runs anything: both forms are exact on the reference
    path), a score_mod after the user's that gives hidden keys -inf, tested inside cuDNN's
    kernel; else its boolean form, with a warning where that costs speed (an NVIDIA GPU,
    half-precision inputs)."""
    heads = mask.heads()
    if heads is not None and heads != query.shape[-2]:
        raise ValueError(f"mask is written for {heads} query heads; the query has "
                         f"{query.shape[-2]}")
    score_mod = options.get("score_mod")
    native = masks.native_keywords(mask, keywords, causal_alignment)
    if native is not None:
        return None, native, score_mod, None
    how = masks.explain(mask)
    as_score_mod = None if options.get("fp8") else masks.as_score_mod(mask, score_mod)
    if as_score_mod is not None:
        call = validated(None, keywords, as_score_mod)
        if device.device_reason() is not None:  # no translation for a path that needs none
            return None, keywords, as_score_mod, call
        reason = planning.cudnn_reason(call)
        # A boolean stand-in: whether the boolean form would run, without forming it.
        if reason is None or planning.cudnn_reason(
                validated(jnp.ones((1, 1, 1, 1), bool), keywords, score_mod)) is not None:
            return None, keywords, as_score_mod, call
        how = f"as a score_mod {reason}"
    if implementation != "xla" and planning.fallback_costs_speed(query.dtype):
        warn(f"jax_sdpa: the mask {type(mask).__name__} runs as a boolean [B, N, T, S] mask "
             f"(dense cost): {how}")
    batch = math.prod(query.shape[:-3])
    boolean = mask.to_boolean(query.shape[-3], key.shape[-3], batch)
    return boolean, keywords, score_mod, None


def _residual(call: AttentionCall, lse, dtype):
    """lse [B, N, T] -> jax.nn's residual [batch..., T, N] in `dtype`, without a gradient. Rows
    past a query length, and every row of a batch entry without keys, see no key: they hold
    the fill of such rows (the sink's logit with sinks), whichever path computed them."""
    lse = jax.lax.stop_gradient(lse).swapaxes(-1, -2)  # [B, T, N]
    q_lengths, kv_lengths = call.query_seq_lengths, call.key_value_seq_lengths
    if q_lengths is not None or kv_lengths is not None:
        batch, q_seq_len = call.query.shape[:2]
        padded = empty_rows.padded_rows(batch, q_seq_len, q_lengths, kv_lengths)
        lse = jnp.where(padded[:, :, None], empty_rows.residual_fill(call.sinks, lse.dtype), lse)
    return lse.reshape(call.output_shape[:-1]).astype(dtype)
