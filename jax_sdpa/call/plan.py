"""Planning a call: whether cuDNN can run it (and its backward), and if so its CallSpec refined
for cuDNN (an equivalent band, the operands' layout, the implementation); if not, why, in one
sentence a user can act on. dot_product_attention and jax_sdpa.ring both decide here, so both
warn (or, with implementation="cudnn", raise) the same way.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_sdpa.cudnn import extension as _extension
from jax_sdpa.cudnn import command_buffers
from jax_sdpa.common.warn import warn
from jax_sdpa.call.spec import CallSpec
from jax_sdpa.call.validation import AttentionCall

MIN_CUDNN_VERSION = 90000  # cuDNN 9.0: SDPA forward and backward through the frontend graphs
MIN_COMPUTE_CAPABILITY = (8, 0)  # Ampere: cuDNN's fused flash attention kernels
MIN_RAGGED_COMPUTE_CAPABILITY = (9, 0)  # cuDNN's ragged (packed) layout: Hopper and newer
MIN_SOFT_CAP_CUDNN_VERSION = 90400  # cuDNN 9.4: score modifiers (soft-capping) in SDPA graphs
MIN_SOFT_CAP_BACKWARD_CAPABILITY = (9, 0)  # their backward: Hopper and newer
MAX_HEAD_DIM = 256
# cuDNN 9.9: a document mask from segment ids inside the score modifier (the checked packed
# call's exact fallback, jax_sdpa/packed_fallback.py)
MIN_SEGMENT_MASK_CUDNN_VERSION = 90900
MIN_PAGED_CUDNN_VERSION = 90500  # cuDNN 9.5: page tables for K/V in the SDPA forward
PAGED_WIDE_HEADS_CUDNN_VERSION = 91000  # head dims past 128 with paged K/V: cuDNN 9.10
DECODE_WINDOW_CUDNN_VERSION = 91000  # a band on a single query row (s_q = 1): cuDNN 9.10
CUDNN_DTYPES = (jnp.float16, jnp.bfloat16)
MIN_FP8_CUDNN_VERSION = 90100  # cuDNN's FP8 SDPA graphs, forward and backward
BROKEN_FP8_CUDNN_VERSION = 91000  # the frontend refuses FP8 SDPA on exactly cuDNN 9.10.0
MIN_FP8_COMPUTE_CAPABILITY = (9, 0)  # Hopper: FP8 tensor cores
MIN_FP8_BACKWARD_SEQ_LEN = 64
_INT32_LIMIT = 2 ** 31  # ragged offsets are int32 element counts


@functools.lru_cache(maxsize=None)
def _device_capability():
    """(major, minor) of the default device, or None when JAX does not say."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if capability is None:
        return None
    return tuple(int(part) for part in str(capability).split(".")[:2])


@functools.lru_cache(maxsize=None)
def device_reason() -> str | None:
    """None if the default backend is an NVIDIA GPU that cuDNN SDPA can serve, else why not."""
    try:
        devices = jax.devices()
    except RuntimeError as error:
        return f"no JAX devices ({error})"
    device = devices[0]
    if device.platform != "gpu" or "NVIDIA" not in device.device_kind.upper():
        return (f"the default JAX device is {device.platform} ({device.device_kind}), not an "
                "NVIDIA GPU: install jax[cuda13] (or jax[cuda12]) on a machine with an NVIDIA GPU")
    capability = _device_capability()
    if capability is not None and capability < MIN_COMPUTE_CAPABILITY:
        return (f"{device.device_kind} has compute capability {capability[0]}.{capability[1]}; "
                "cuDNN flash attention needs 8.0 (Ampere) or newer")
    load_error = _extension.extension_load_error()
    if load_error is not None:
        return load_error
    version = _extension.cudnn_version()
    if version < MIN_CUDNN_VERSION:
        return (f"the loaded cuDNN is {version}; jax_sdpa needs cuDNN >= 9.0 "
                "(pip install nvidia-cudnn-cu13)")
    return None


def kernel_reason(dtype, head_dims) -> str | None:
    """None if cuDNN's kernels take this dtype and these (name, head_dim) pairs, else why not."""
    if dtype not in CUDNN_DTYPES:
        return f"dtype {dtype} is not float16 or bfloat16"
    for name, head_dim in head_dims:
        if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
            return f"{name} {head_dim} is not a multiple of 8 between 8 and {MAX_HEAD_DIM}"
    return None


def soft_cap_reason(logits_soft_cap) -> str | None:
    """None if cuDNN's forward can soft-cap the scores (or there is no cap), else why not."""
    if logits_soft_cap is None or device_reason() is not None:
        return None
    if _extension.cudnn_version() < MIN_SOFT_CAP_CUDNN_VERSION:
        return (f"logits_soft_cap needs cuDNN >= 9.4 (the loaded cuDNN is "
                f"{_extension.cudnn_version()})")
    return None


def paged_reason(dtype, head_dim, head_dim_v, logits_soft_cap, decoding_window) -> str | None:
    """None if cuDNN's paged forward can run this paged_attention call on this device, else
    why not. decoding_window: one query per sequence with a window (a band on a single query
    row, which cuDNN before 9.10 refuses)."""
    reason = device_reason() or kernel_reason(dtype, (("head_dim", head_dim),
                                                      ("value head_dim", head_dim_v)))
    if reason:
        return reason
    version = _extension.cudnn_version()
    if version < MIN_PAGED_CUDNN_VERSION:
        return f"cuDNN's paged K/V needs cuDNN >= 9.5 (the loaded cuDNN is {version})"
    if max(head_dim, head_dim_v) > 128 and version < PAGED_WIDE_HEADS_CUDNN_VERSION:
        return (f"cuDNN's paged K/V takes head dims up to 128 before cuDNN 9.10 (got {head_dim} "
                f"and {head_dim_v}; the loaded cuDNN is {version})")
    if decoding_window and version < DECODE_WINDOW_CUDNN_VERSION:
        return (f"a local_window_size with one query per sequence needs cuDNN >= 9.10 (the "
                f"loaded cuDNN is {version})")
    if logits_soft_cap is not None:
        return "logits_soft_cap is not built into jax_sdpa's paged cuDNN graph yet"
    return None


def backward_reason(q_seq_len, kv_seq_len, head_dim, head_dim_v, logits_soft_cap=None,
                    bias_grad=False) -> str | None:
    """None if cuDNN's backward takes these sizes on this device, else why not (the limits the
    cuDNN frontend checks when it builds the backward graph, and what we measured wrong)."""
    if q_seq_len == 1 and kv_seq_len == 1:
        return "cuDNN's backward does not support one query and one key (T = S = 1)"
    if logits_soft_cap is not None and bias_grad:
        # Measured on an H200 with cuDNN 9.19: dq, dk, dv right, dbias not.
        return ("cuDNN's bias gradient under logits_soft_cap (a score modifier) was wrong on "
                "cuDNN 9.19")
    capability = _device_capability() if device_reason() is None else None
    if (logits_soft_cap is not None and capability is not None and
            capability < MIN_SOFT_CAP_BACKWARD_CAPABILITY):
        return (f"cuDNN's backward with logits_soft_cap needs compute capability 9.0 or newer "
                f"(got {capability[0]}.{capability[1]})")
    if capability is None or capability[0] == 9:
        return None
    if capability[0] == 10 and (head_dim, head_dim_v) == (192, 128):
        return None
    if max(head_dim, head_dim_v) > 128:
        return (f"cuDNN's backward takes head dims up to 128 on compute capability "
                f"{capability[0]}.{capability[1]} (got {head_dim} and {head_dim_v})")
    return None


def diagonal_band(call: AttentionCall) -> tuple[dict | None, str | None]:
    """(the band cuDNN runs for this call, as CallSpec fields, None) or (None, why cuDNN cannot
    run it).

    A bottom-right band is shifted onto the top-left diagonal where the shifted bounds stay
    valid (this also works with a bias and dropout, which cuDNN's own bottom-right alignment
    refuses); otherwise cuDNN's bottom-right alignment is used where it applies."""
    spec = call.spec
    left, right = spec.window_left, spec.window_right
    if not spec.banded:
        return dict(window_left=-1, window_right=-1, bottom_right=False), None
    q_seq_len = call.query.shape[1]
    kv_seq_len = call.key.shape[1]
    offset = call.diagonal_offset
    shifted_left = left - offset if left >= 0 else -1
    shifted_right = right + offset if right >= 0 else -1
    if (left < 0 or shifted_left >= 0) and (right < 0 or shifted_right >= 0):
        band = dict(window_left=shifted_left, window_right=shifted_right, bottom_right=False)
    elif (call.bias is None and call.mask is None and spec.dropout == 0.0 and
          not spec.has_lengths and not spec.segments and q_seq_len <= kv_seq_len):
        band = dict(window_left=left, window_right=right, bottom_right=True)
    else:
        return None, ("causal_alignment='bottom_right' with these sequence lengths "
                      f"(T={q_seq_len}, S={kv_seq_len}) and window needs a band cuDNN does not "
                      "offer together with a bias, mask, dropout, segment ids or sequence "
                      "lengths")
    if band["window_left"] >= 0 and q_seq_len > kv_seq_len and not spec.has_lengths and not (
            spec.segments and ragged_reason(call) is None):
        return None, (f"cuDNN's sliding window needs T <= S without sequence lengths (T="
                      f"{q_seq_len}, S={kv_seq_len})")
    return band, None


def ragged_reason(call: AttentionCall) -> str | None:
    """None if the call's segment ids can run on cuDNN's ragged (packed) layout, else why they
    take the dense path (a [B, 1, T, S] bias)."""
    if call.bias is not None or call.mask is not None:
        return "segment ids with a bias or mask need a dense [B, N, T, S] bias"
    if call.spec.logits_soft_cap:
        return ("segment ids with logits_soft_cap need a dense [B, 1, T, S] bias (cuDNN's "
                "ragged layout relies on its built-in padding mask, which a score modifier "
                "turns off)")
    if call.spec.bottom_right:
        return ("segment ids with causal_alignment='bottom_right' and T != S need a dense "
                "[B, 1, T, S] bias")
    capability = _device_capability() if device_reason() is None else None
    if capability is not None and capability < MIN_RAGGED_COMPUTE_CAPABILITY:
        return ("cuDNN's ragged layout for segment ids needs compute capability 9.0 (Hopper) "
                "or newer; using a dense [B, 1, T, S] bias")
    version = _extension.cudnn_version() if device_reason() is None else None
    if (not call.spec.max_document_length and version is not None and
            version < MIN_SEGMENT_MASK_CUDNN_VERSION):
        return (f"segment ids without max_document_length need cuDNN >= 9.9 for their exact "
                f"fallback (the loaded cuDNN is {version}); using a dense [B, 1, T, S] bias")
    batch, q_seq_len, q_heads, head_dim = call.query.shape
    _, kv_seq_len, kv_heads, _ = call.key.shape
    head_dim_v = call.value.shape[-1]
    largest = max(batch * q_seq_len * q_heads * max(head_dim, head_dim_v),
                  batch * kv_seq_len * kv_heads * max(head_dim, head_dim_v))
    if largest >= _INT32_LIMIT:
        return (f"a tensor of {largest} elements is past the int32 offsets of cuDNN's ragged "
                "layout; using a dense [B, 1, T, S] bias")
    return None


def fp8_reason(head_dim, head_dim_v, q_seq_len, kv_seq_len) -> str | None:
    """None if cuDNN's FP8 forward runs these sizes on this device, else why not."""
    if head_dim != head_dim_v or head_dim % 16 or head_dim > MAX_HEAD_DIM:
        return (f"cuDNN's FP8 attention takes equal query and value head dims, multiples of 16 "
                f"up to {MAX_HEAD_DIM} (got {head_dim} and {head_dim_v})")
    if q_seq_len == 1:
        # Measured on an H200 with cuDNN 9.19: "No valid engine configs" for S = 1 to 1024.
        return f"cuDNN's FP8 forward has no engine for a single query (T = 1, S = {kv_seq_len})"
    if device_reason() is not None:
        return None
    capability = _device_capability()
    if capability is not None and capability < MIN_FP8_COMPUTE_CAPABILITY:
        return (f"cuDNN's FP8 attention needs compute capability 9.0 (Hopper) or newer (got "
                f"{capability[0]}.{capability[1]})")
    version = _extension.cudnn_version()
    if version < MIN_FP8_CUDNN_VERSION or version == BROKEN_FP8_CUDNN_VERSION:
        return (f"cuDNN's FP8 attention needs cuDNN >= 9.1, not 9.10.0 (the loaded cuDNN is "
                f"{version})")
    return None


def fp8_backward_reason(q_seq_len, kv_seq_len, head_dim) -> str | None:
    """None if cuDNN's FP8 backward takes these sizes on this device, else why not."""
    if min(q_seq_len, kv_seq_len) < MIN_FP8_BACKWARD_SEQ_LEN:
        # Measured on an H200 with cuDNN 9.19: T = S = 7 gave dq 70% off (the frontend's own
        # FP8 tests list short sequences as known mismatches).
        return (f"cuDNN's FP8 backward was wrong below {MIN_FP8_BACKWARD_SEQ_LEN} queries or "
                f"keys on cuDNN 9.19 (T={q_seq_len}, S={kv_seq_len})")
    capability = _device_capability() if device_reason() is None else None
    if capability is not None and capability[0] == 9 and head_dim != 128:
        return f"cuDNN's FP8 backward takes head_dim 128 only on Hopper (got {head_dim})"
    if capability is not None and capability[0] >= 10 and head_dim > 128:
        return (f"cuDNN's FP8 backward takes head dims up to 128 on compute capability "
                f"{capability[0]}.{capability[1]} (got {head_dim})")
    return None


def call_reason(call: AttentionCall) -> str | None:
    """None if cuDNN can run this (validated) call's forward, else why not. Ignores the
    device."""
    reason = kernel_reason(call.query.dtype, (("head_dim", call.query.shape[-1]),
                                              ("value head_dim", call.value.shape[-1])))
    if reason is None and call.spec.fp8:
        reason = fp8_reason(call.query.shape[-1], call.value.shape[-1], call.query.shape[1],
                            call.key.shape[1])
    return (reason or soft_cap_reason(call.spec.logits_soft_cap or None) or
            diagonal_band(call)[1])


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
    return device_reason() is None and jnp.dtype(dtype) in map(jnp.dtype, CUDNN_DTYPES)


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


def plan(call: AttentionCall, implementation, deterministic: bool) -> CallSpec:
    """The call's spec as it runs: refined for cuDNN (implementation "cudnn"), or as validated
    for the reference path (after its warning, or NotImplementedError with
    implementation="cudnn")."""
    spec = call.spec
    if spec.fp8 and deterministic:
        raise ValueError("deterministic=True is not offered with fp8=True (cuDNN's FP8 backward "
                         "has no deterministic algorithm on Hopper)")
    q_seq_len, kv_seq_len = call.query.shape[1], call.key.shape[1]
    head_dim, head_dim_v = call.query.shape[-1], call.value.shape[-1]
    reason = device_reason() or call_reason(call)
    backward = None if reason else backward_reason(q_seq_len, kv_seq_len, head_dim, head_dim_v,
                                                   spec.logits_soft_cap or None, spec.bias_grad)
    if reason is None and backward is None and spec.fp8:
        backward = fp8_backward_reason(q_seq_len, kv_seq_len, head_dim)
    if backward is not None and spec.dropout > 0.0:
        # The reference backward recomputes the forward: it would not drop what cuDNN dropped.
        reason = f"{backward}, and with dropout the forward must run where the backward does"
    if not use_cudnn(reason, implementation, call.query.dtype):
        return spec
    band, _ = diagonal_band(call)
    backward_kernel = None
    if backward is not None:
        if implementation == "cudnn":
            raise NotImplementedError(f"implementation='cudnn' cannot run this call's "
                                      f"backward: {backward}")
        warn(f"jax_sdpa: the backward of this call takes the XLA reference path because "
             f"{backward}")
        backward_kernel = "xla"
    dense_segments = False
    if spec.segments:
        dense_reason = ragged_reason(call)
        if dense_reason is not None:
            warn(f"jax_sdpa: segment ids take the dense path because {dense_reason}")
            dense_segments = True
    ragged = bool(spec.segments) and not dense_segments
    return dataclasses.replace(
        spec, **band, deterministic=bool(deterministic), implementation="cudnn",
        backward_implementation=backward_kernel, segments=spec.segments if ragged else "",
        max_segments=spec.max_segments if ragged else 0,
        max_document_length=spec.max_document_length if ragged else (),
        command_buffer=command_buffers.command_buffers(),
        **_bias_layout(call, dense_segments))
