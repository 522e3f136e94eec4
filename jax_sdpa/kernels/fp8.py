"""FP8 attention on cuDNN (the FP8 targets): the inputs quantized with
reference/fp8_scaling.py's scales, our FFI calls, and the FP8 results dequantized to the
inputs' dtypes. On Hopper cuDNN writes the output and the gradients in FP8 only, so dequantizing
them is ours.
The backward re-quantizes the forward's inputs and output (the same scales give the same
FP8 tensors), so the residuals stay those of every other call."""

from __future__ import annotations

import jax.numpy as jnp

from jax_sdpa.cudnn import fp8 as fp8_target
from jax_sdpa.reference import fp8 as fp8_reference
from jax_sdpa.reference import fp8_scaling as scaling

_SCALE_ROW = 4  # floats per scale: cuDNN wants each [1, 1, 1, 1] tensor 16-byte aligned


def scale_rows(factors):
    """float32 [..., len(factors), 4]: the FFI's scale rows (ffi/sdpa_graphs.h's Fp8Scale)."""
    stacked = jnp.stack([jnp.asarray(f, jnp.float32) for f in factors], axis=-1)
    return jnp.broadcast_to(stacked[..., None], (*stacked.shape, _SCALE_ROW))


def _quantized(inputs, scales):
    return dict(inputs, query=scaling.quantize(inputs["query"], scales.q, "e4m3"),
                key=scaling.quantize(inputs["key"], scales.k, "e4m3"),
                value=scaling.quantize(inputs["value"], scales.v, "e4m3"))


def _forward_factors(scales):
    """descale_q, descale_k, descale_v, descale_s, scale_s, scale_o."""
    ones = jnp.ones_like(scales.q)
    return [1 / scales.q, 1 / scales.k, 1 / scales.v, ones / scaling.P_SCALE,
            ones * scaling.P_SCALE, scales.o]


def forward(config, inputs):
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    scales = scaling.forward_scales(query, key, value)
    out8, lse, _ = fp8_target.forward(_quantized(inputs, scales), config,
                                      scale_rows(_forward_factors(scales)))
    return scaling.dequantize(out8, scales.o, query.dtype), lse


def backward(config, inputs, output, lse, d_output):
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    fmt = config.fp8
    forward_scales = scaling.forward_scales(query, key, value)
    rows = fp8_reference.query_rows(inputs, query.shape)
    if rows is not None:  # rows past the lengths have no gradient (and no say in the scales)
        d_output = jnp.where(rows, d_output, 0)
    back = scaling.backward_scales(query, key, value, d_output, config.scale, fmt)
    factors = _forward_factors(forward_scales) + [
        1 / forward_scales.o, 1 / back.d_o, 1 / back.d_s, back.dq, back.dk, back.dv, back.d_s]
    dq, dk, dv, _ = fp8_target.backward(
        _quantized(inputs, forward_scales), scaling.quantize(output, forward_scales.o, "e4m3"),
        lse, scaling.quantize(d_output, back.d_o, fmt), config, scale_rows(factors))
    return (scaling.dequantize(dq, back.dq, query.dtype),
            scaling.dequantize(dk, back.dk, key.dtype),
            scaling.dequantize(dv, back.dv, value.dtype), None)
