"""The kernels' forward and backward joined by jax.custom_vjp.

The forward's float32 lse (log-sum-exp per query row and head) is the residual the backward
consumes, so the backward never recomputes the softmax normaliser. With dropout, the forward and
backward get the same Philox seed, so the backward drops exactly what the forward dropped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jax_sdpa.kernels import sharding as sharding_rules
from jax_sdpa.kernels import sink_softmax
from jax_sdpa.call.spec import CallSpec

_DIFFERENTIABLE = ("query", "key", "value", "bias", "sinks", "score_mod_tables")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(config: CallSpec, inputs: dict):
    """inputs: the config's arrays by name (call_spec.INPUTS): query [B, T, N, H], key
    [B, S, K, H], value [B, S, K, Hv], bias [1|B, 1|N, T, S] in the query's dtype, lengths int32
    [B], segment ids int32 [B, T] / [B, S], dropout_seed uint32 [4] (Philox seed, then offset,
    as two int64), sinks float [N]. Returns (output [B, T, N, Hv], lse float32 [B, N, T])."""
    return sharding_rules.forward(config, inputs)


def _forward(config, inputs):
    # symbolic_zeros: each input comes with whether its gradient is asked for
    tables = inputs.get("score_mod_tables")
    if tables is not None and tables.perturbed:
        raise ValueError(
            "jax_sdpa: on cuDNN a score_mod's closed-over arrays (alibi_slopes included) get "
            "no gradient (it would take O(T*S) memory): wrap them in jax.lax.stop_gradient, "
            "or pass implementation='xla' to differentiate them on the reference path")
    inputs = {name: x.value for name, x in inputs.items()}
    output, lse = sharding_rules.forward(config, inputs)
    return (output, lse), (inputs, output, lse)


def _integer_zero(x):
    return np.zeros(x.shape, jax.dtypes.float0)


def _backward(config, residuals, cotangents):
    inputs, output, lse = residuals
    # The log-sum-exp is returned under stop_gradient, as jax.nn does: its cotangent is dropped.
    d_output, _ = cotangents
    if isinstance(d_output, SymbolicZero):
        d_output = jnp.zeros(d_output.aval.shape, d_output.aval.dtype)
    dq, dk, dv, dbias = sharding_rules.backward(config, inputs, output, lse, d_output)
    if config.has_bias and dbias is None:
        dbias = jnp.zeros_like(inputs["bias"])  # a mask's bias: nothing upstream needs it
    # A score modifier's tables: the forward refused a gradient for them.
    grads = dict(query=dq, key=dk, value=dv, bias=dbias, score_mod_tables=None)
    if config.has_sinks:  # exact from the sink attention's output and lse (sink_softmax.py)
        grads["sinks"] = sink_softmax.gradient(output, lse, d_output, inputs["sinks"])
    return ({name: grads[name] if name in _DIFFERENTIABLE else _integer_zero(x)
             for name, x in inputs.items()},)


attention.defvjp(_forward, _backward, symbolic_zeros=True)


def dropout_seed(rng):
    """uint32 [4] holding cuDNN's Philox seed (64 random bits from the key) and offset (0)."""
    return jnp.concatenate([jax.random.bits(rng, (2,), jnp.uint32), jnp.zeros((2,), jnp.uint32)])
