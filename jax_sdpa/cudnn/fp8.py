"""The FP8 targets (jax_sdpa_fp8_forward / _backward): cuDNN's FP8 graphs on e4m3 inputs with
float32 scale rows (ffi/graph/fp8_scales.h's order), amaxes out; the causal mask and sequence
lengths only (jax_sdpa/limits/fp8.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sdpa.cudnn import call
from jax_sdpa.cudnn.targets import BY_NAME

FORWARD = BY_NAME["jax_sdpa_fp8_forward"]
BACKWARD = BY_NAME["jax_sdpa_fp8_backward"]
# ffi/graph/sdpa_config.h's ElementType of the backward's format.
_ELEMENT_TYPES = {"e4m3": 2, "e5m2": 3}
# Amax rows per call (ffi/graph/fp8_scales.h): 2 forward, 4 backward.
_AMAXES = {"forward": 2, "backward": 4}


def _amaxes_type(direction, scales):
    """float32 [..., rows, 4] per vmapped slice, as its scales."""
    return jax.ShapeDtypeStruct((*scales.shape[:-2], _AMAXES[direction], scales.shape[-1]),
                                jnp.float32)


def _operands_and_attributes(inputs, spec, scales):
    operands = dict(query=inputs["query"], key=inputs["key"], value=inputs["value"],
                    scales=scales, q_lengths=inputs.get("q_lengths"),
                    kv_lengths=inputs.get("kv_lengths"))
    fill = spec.zero_fill()
    if fill == "all":
        raise ValueError(f"an FP8 call has no zero-filled outputs: {spec}")
    if fill == "tails":
        operands["tails"] = call.tails(inputs)
    return operands, dict(padding=spec.has_lengths, zero_tails=fill == "tails")


def forward(inputs, spec, scales):
    """(output in e4m3 [batch..., T, N, Hv], lse float32 [batch..., N, T], amaxes float32
    [..., 2, 4]: amax_s, amax_o). inputs: e4m3 query, key, value (and the lengths the spec
    has); scales: the forward's scale rows."""
    operands, attributes = _operands_and_attributes(inputs, spec, scales)
    query = inputs["query"]
    return tuple(call.ffi_call(FORWARD, spec, operands, attributes,
                               (call.output_type(query, inputs["value"]),
                                call.stats_type(query), _amaxes_type("forward", scales))))


def backward(inputs, output, lse, d_output, spec, scales):
    """(dq, dk, dv in the spec's gradient format, amaxes float32 [..., 4, 4]: dQ, dK, dV, dP).
    output: the forward's e4m3 output; d_output in the gradient format."""
    operands, attributes = _operands_and_attributes(inputs, spec, scales)
    operands.update(output=output, stats=lse, d_output=d_output)
    attributes["gradient_type"] = _ELEMENT_TYPES[spec.fp8]
    result_types = [jax.ShapeDtypeStruct(inputs[name].shape, d_output.dtype)
                    for name in ("query", "key", "value")]
    return tuple(call.ffi_call(BACKWARD, spec, operands, attributes,
                               (*result_types, _amaxes_type("backward", scales))))
