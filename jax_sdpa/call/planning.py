"""Planning a call: whether cuDNN can run it (and its backward), asking each feature's limits
(jax_sdpa/limits/), and if so its CallSpec refined for cuDNN (an equivalent band, the operands'
layout, the implementation); if not, the one place that warns or raises, with the limit's
reason. dot_product_attention, paged_attention, ring attention and jax_sdpa.fp8 all decide
here, so they warn (or, with implementation="cudnn", raise) the same way.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_sdpa.call.spec import HALF_BACKWARD, CallSpec
from jax_sdpa.call.validation import AttentionCall
from jax_sdpa.common.warn import warn
from jax_sdpa.cudnn import command_buffers
from jax_sdpa.limits import dense, device, fp8, packed


def call_reason(call: AttentionCall) -> str | None:
    """None if cuDNN can run this (validated) call's forward, else why not. Ignores the
    device."""
    head_dim, head_dim_v = call.query.shape[-1], call.value.shape[-1]
    reason = dense.kernel_reason(call.query.dtype, (("head_dim", head_dim),
                                                    ("value head_dim", head_dim_v)))
    if reason is None and call.spec.fp8:
        reason = fp8.fp8_reason(head_dim, head_dim_v, call.query.shape[1], call.key.shape[1])
    return (reason or dense.score_mod_reason(call) or
            dense.soft_cap_reason(call.spec.logits_soft_cap or None) or
            dense.diagonal_band(call)[1])


def cudnn_reason(call: AttentionCall) -> str | None:
    """None if cuDNN can run the validated call, forward and backward, else why not. Ignores
    the device."""
    return call_reason(call) or backward_reason(call)


def use_cudnn(reason: str | None, implementation, dtype, subject: str = "this call") -> bool:
    """True if cuDNN runs it. Else the reference path: silently where nothing is lost (no GPU,
    or inputs cuDNN never takes, as jax.nn picks XLA silently), with a warning naming why
    where it is a speed cliff (implementation=None, float16/bfloat16 on an NVIDIA GPU), or
    NotImplementedError naming why (implementation="cudnn")."""
    if implementation == "xla":
        return False
    if reason is None:
        return True
    if implementation == "cudnn":
        raise NotImplementedError(f"implementation='cudnn' cannot run {subject}: {reason}")
    if fallback_costs_speed(dtype):
        warn(f"jax_sdpa: using the XLA reference path for {subject} because {reason}")
    return False


def fallback_costs_speed(dtype) -> bool:
    """Whether leaving cuDNN loses speed a user expects: an NVIDIA GPU is there and the inputs
    are float16/bfloat16 (elsewhere jax.nn, too, runs XLA silently)."""
    return device.device_reason() is None and jnp.dtype(dtype) in map(jnp.dtype,
                                                                       dense.CUDNN_DTYPES)


def _bias_layout(call: AttentionCall, dense_segments: bool) -> dict:
    """The bias operand's presence and broadcast axes: the user's bias plus a mask's (and dense
    segment ids', [B, 1, T, S]) as one additive bias."""
    shapes = [x.shape for x in (call.bias, call.mask) if x is not None]
    if dense_segments:
        shapes.append((call.query.shape[0], 1))
    if not shapes:
        return {}
    return dict(has_bias=True, bias_batch_full=any(s[0] > 1 for s in shapes),
                bias_heads_full=any(s[1] > 1 for s in shapes),
                bias_grad=call.bias is not None)


def backward_reason(call: AttentionCall) -> str | None:
    """None if cuDNN can run the call's backward (for FP8, on its FP8 or half-precision
    graphs), else why not."""
    spec = call.spec
    q_seq_len, kv_seq_len = call.query.shape[1], call.key.shape[1]
    head_dim, head_dim_v = call.query.shape[-1], call.value.shape[-1]
    reason = dense.backward_reason(q_seq_len, kv_seq_len, head_dim, head_dim_v,
                                   spec.logits_soft_cap or None, spec.bias_grad,
                                   spec.has_score_mod)
    if reason is None and spec.fp8 and half_backward_reason(call) is None:
        reason = fp8.fp8_backward_reason(q_seq_len, kv_seq_len, head_dim)
    return reason


def half_backward_reason(call: AttentionCall) -> str | None:
    """Why an FP8 call's backward takes cuDNN's half-precision graphs, or None (not FP8, its
    FP8 backward runs, or no cuDNN backward does)."""
    spec = call.spec
    q_seq_len, kv_seq_len = call.query.shape[1], call.key.shape[1]
    head_dim, head_dim_v = call.query.shape[-1], call.value.shape[-1]
    if not spec.fp8 or dense.backward_reason(q_seq_len, kv_seq_len, head_dim, head_dim_v,
                                             None, False, False) is not None:
        return None
    return fp8.half_backward_reason(call.query.shape[2], call.key.shape[2],
                                    fp8.fp8_backward_reason(q_seq_len, kv_seq_len, head_dim))


def plan(call: AttentionCall, implementation, deterministic: bool) -> CallSpec:
    """The call's spec as it runs: refined for cuDNN (implementation "cudnn"), or as validated
    for the reference path (after its warning, or NotImplementedError with
    implementation="cudnn")."""
    spec = call.spec
    if spec.fp8:
        reason = fp8.options_reason(dict(deterministic=bool(deterministic) or None))
        if reason:
            raise ValueError(reason)
    reason = device.device_reason() or call_reason(call)
    backward = None if reason else backward_reason(call)
    if backward is not None and spec.dropout > 0.0:
        # The reference backward recomputes the forward: it would not drop what cuDNN dropped.
        reason = f"{backward}, and with dropout the forward must run where the backward does"
    if backward is not None and spec.has_score_mod:
        # The kernels' reference backward sees the call's arrays, not its score_mod.
        reason = f"{backward}, and a score_mod's forward runs where its backward does"
    if not use_cudnn(reason, implementation, call.query.dtype):
        return spec
    band, _ = dense.diagonal_band(call)
    backward_kernel = None
    if backward is not None:
        if implementation == "cudnn":
            raise NotImplementedError(f"implementation='cudnn' cannot run this call's "
                                      f"backward: {backward}")
        warn(f"jax_sdpa: the backward of this call takes the XLA reference path because "
             f"{backward}")
        backward_kernel = "xla"
    elif half_backward_reason(call) is not None:
        backward_kernel = HALF_BACKWARD
    dense_segments = False
    if spec.segments:
        dense_reason = packed.ragged_reason(call) or _score_mod_packing_reason(call)
        if dense_reason is not None:
            warn(f"jax_sdpa: segment ids take the dense path because {dense_reason}")
            dense_segments = True
    ragged = bool(spec.segments) and not dense_segments
    return dataclasses.replace(
        spec, **band, **_score_mod_programs(call), deterministic=bool(deterministic),
        implementation="cudnn", backward_implementation=backward_kernel,
        segments=spec.segments if ragged else "",
        max_segments=spec.max_segments if ragged else 0,
        max_document_length=spec.max_document_length if ragged else (),
        command_buffer=command_buffers.command_buffers(),
        **_bias_layout(call, dense_segments))


def _score_mod_packing_reason(call: AttentionCall) -> str | None:
    if call.score_mod is not None:
        # cuDNN's ragged layout numbers a document's tokens from its own start
        return "score_mod sees the rows' positions, which the ragged layout renumbers"
    return None


def _score_mod_programs(call: AttentionCall) -> dict:
    """The CallSpec fields of the call's score modifier on cuDNN."""
    if call.score_mod is None:
        return {}
    program = call.score_mod_program
    return dict(score_mod=program.forward, score_mod_bprop=program.backward,
                score_mod_tables=program.table_count)

