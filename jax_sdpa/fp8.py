"""jax_sdpa.fp8.dot_product_attention: FP8 attention for frameworks that keep their own scales,
in the convention of JAX's cuDNN FP8 path (jax._src.cudnn.fused_attention_stablehlo,
use_fp8=True), so code written for it moves over by changing one import.

Query, key and value come in float8_e4m3fn, already quantized; fp8_params holds the float32
scale factors (descale_* undo a tensor's scale, scale_* quantize one) and the amax_*
placeholders. The forward returns (output in float8_e4m3fn quantized with scale_o, amax_s,
amax_o); its vjp gives dQ, dK, dV in float8_e4m3fn (quantized with scale_dQ/dK/dV) and hands
the backward's amaxes back as the cotangents of amax_dQ, amax_dK, amax_dV and amax_dP (the
other parameters get zeros). cuDNN runs it where it can (Hopper and newer; the backward takes
head_dim 128 on Hopper), the same arithmetic in pure JAX elsewhere (jax_sdpa/reference/fp8.py).
Beyond JAX's: causal and padding masks by sequence lengths (mask_type PADDING, PADDING_CAUSAL).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_sdpa.call.spec import CallSpec
from jax_sdpa.common.warn import warn
from jax_sdpa.cudnn import fp8 as fp8_target
from jax_sdpa.kernels import fp8 as fp8_kernels
from jax_sdpa.fp8_delayed import DelayedScaling  # noqa: F401  (public: jax_sdpa.fp8.DelayedScaling)
from jax_sdpa.kernels import sharding
from jax_sdpa.limits import device
from jax_sdpa.limits import fp8 as fp8_limits
from jax_sdpa.reference import fp8 as fp8_reference
from jax_sdpa.reference import fp8_scaling as scaling

# JAX's fp8_params keys: the forward reads the first six scale factors, the backward thirteen
# (in ffi/sdpa_graphs.h's Fp8Scale order); the amaxes are placeholders for the backward's.
FORWARD_FACTORS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
BACKWARD_FACTORS = FORWARD_FACTORS + ("descale_o", "descale_dO", "descale_dP", "scale_dQ",
                                      "scale_dK", "scale_dV", "scale_dP")
AMAXES = ("amax_dQ", "amax_dK", "amax_dV", "amax_dP")
FP8_PARAMS = AMAXES + BACKWARD_FACTORS
_MASK_TYPES = {"NO_MASK": (False, False), "CAUSAL": (True, False), "PADDING": (False, True),
               "PADDING_CAUSAL": (True, True)}
_E4M3 = jnp.float8_e4m3fn
# JAX's qkv_layout names: whether the heads axis comes before the sequence axis
_LAYOUTS = {"BTNH": False, "BSNH": False, "BNTH": True, "BNSH": True}


def dot_product_attention(query, key, value, bias=None, mask=None, q_seqlen=None,
                          kv_seqlen=None, q_offsets=None, kv_offsets=None, fp8_params=None,
                          score_mod_args=(), *, scale=1.0, mask_type="NO_MASK", seed=42,
                          dropout_rate=0.0, qkv_layout="BTNH", sliding_window_length=None,
                          score_mod=None, use_fp8=True, return_residual=False):
    """FP8 attention of query [B, T, N, H], key [B, S, K, H], value [B, S, K, H] (all
    float8_e4m3fn, BTNH; with qkv_layout="BNTH", [B, N, T, H] and so on): (output
    float8_e4m3fn in the inputs' layout, amax_s, amax_o float32 [1, 1, 1, 1]). mask_type:
    JAX's MaskType or its name; q_seqlen and kv_seqlen int32 [B] with the PADDING types. Bias,
    mask, packed offsets, dropout, sliding windows, score_mod (JAX 0.12's argument, with
    score_mod_args) and the residual are not taken in FP8 (ValueError). seed is unused (no
    dropout)."""
    del seed
    causal, padding = _checked_mask_type(mask_type)
    _refuse(bias=bias, mask=mask, q_offsets=q_offsets, kv_offsets=kv_offsets,
            sliding_window_length=sliding_window_length, score_mod=score_mod,
            score_mod_args=tuple(score_mod_args) or None)
    if dropout_rate:
        raise ValueError(f"dropout_rate must be 0 in FP8, got {dropout_rate}")
    if return_residual:
        raise ValueError("return_residual is not taken in FP8 (JAX's FP8 path has none either)")
    if not use_fp8:
        raise ValueError("jax_sdpa.fp8.dot_product_attention is the use_fp8=True path; use "
                         "jax_sdpa.dot_product_attention otherwise")
    if qkv_layout not in _LAYOUTS:
        raise ValueError(f"qkv_layout must be one of {sorted(_LAYOUTS)}, got {qkv_layout!r}")
    heads_first = _LAYOUTS[qkv_layout]
    if heads_first:  # the kernels' layout is BTNH: transposed copies in, the output back
        query, key, value = (jnp.swapaxes(x, 1, 2) for x in (query, key, value))
    _check_operands(query, key, value)
    params = _checked_params(fp8_params)
    lengths = _checked_lengths(padding, q_seqlen, kv_seqlen, query.shape[0])
    config = CallSpec(scale=float(scale), window_right=0 if causal else -1,
                          has_lengths=padding, fp8="e4m3",
                          implementation=_implementation(query, value))
    out8, amax_s, amax_o = _attention(config, query, key, value, lengths, params)
    return (jnp.swapaxes(out8, 1, 2) if heads_first else out8), amax_s, amax_o


def _checked_mask_type(mask_type):
    name = getattr(mask_type, "name", mask_type)
    if not isinstance(name, str) or name.upper() not in _MASK_TYPES:
        raise ValueError(f"mask_type must be one of {sorted(_MASK_TYPES)} in FP8, got "
                         f"{mask_type!r}")
    return _MASK_TYPES[name.upper()]


def _refuse(**options):
    given = [name for name, value in options.items() if value is not None]
    if given:
        raise ValueError(f"FP8 attention takes no {', '.join(given)}")


def _check_operands(query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "dtype", None) != _E4M3 or getattr(x, "ndim", 0) != 4:
            raise ValueError(f"{name} must be a float8_e4m3fn [B, T|S, heads, head_dim] array, "
                             f"got {getattr(x, 'dtype', type(x))} of shape "
                             f"{getattr(x, 'shape', None)}")
    if key.shape != value.shape or key.shape[0] != query.shape[0] or \
            key.shape[3] != query.shape[3] or query.shape[2] % key.shape[2]:
        raise ValueError(f"query {query.shape}, key {key.shape} and value {value.shape} do not "
                         "form one attention problem (value's shape must be key's; query heads "
                         "a multiple of key heads)")


def _checked_params(fp8_params):
    if not isinstance(fp8_params, dict):
        raise ValueError(f"fp8_params must be a dict of {len(FP8_PARAMS)} float32 scalars, got "
                         f"{type(fp8_params).__name__}")
    missing = [name for name in FP8_PARAMS if name not in fp8_params]
    if missing:
        raise ValueError(f"fp8_params is missing {', '.join(missing)}")
    params = {}
    for name in FP8_PARAMS:
        value = jnp.asarray(fp8_params[name])
        if value.size != 1:
            raise ValueError(f"fp8_params[{name!r}] must hold one value, got shape "
                             f"{value.shape}")
        params[name] = value
    return params


def _checked_lengths(padding, q_seqlen, kv_seqlen, batch):
    if not padding:
        _refuse(q_seqlen=q_seqlen, kv_seqlen=kv_seqlen)
        return None
    if q_seqlen is None or kv_seqlen is None:
        raise ValueError("a PADDING mask_type needs q_seqlen and kv_seqlen")
    lengths = []
    for name, x in (("q_seqlen", q_seqlen), ("kv_seqlen", kv_seqlen)):
        x = jnp.asarray(x)
        if x.shape != (batch,) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer [{batch}] array, got {x.dtype} "
                             f"{x.shape}")
        lengths.append(x.astype(jnp.int32))
    return tuple(lengths)


def _implementation(query, value):
    """"cudnn" where cuDNN's FP8 graphs run this call, both directions; else "xla", with a
    warning where an NVIDIA GPU is there (the XLA path is a speed cliff)."""
    head_dim = query.shape[-1]
    if device.device_reason() is not None:
        return "xla"
    reason = (fp8_limits.fp8_reason(head_dim, value.shape[-1], query.shape[1], value.shape[1]) or
              fp8_limits.fp8_backward_reason(query.shape[1], value.shape[1], head_dim))
    if reason is None:
        return "cudnn"
    warn(f"jax_sdpa.fp8: using the XLA reference path because {reason}")
    return "xla"


def _factors(params, names):
    return fp8_kernels.scale_rows([params[n].reshape(()) for n in names])


def _inputs(query, key, value, lengths):
    inputs = dict(query=query, key=key, value=value)
    if lengths is not None:
        inputs["q_lengths"], inputs["kv_lengths"] = lengths
    return inputs


def _dequantized(x, descale):
    return x.astype(jnp.float32) * descale.astype(jnp.float32)


def _quantized(x, scale):
    return scaling.quantize(x, scale.astype(jnp.float32), "e4m3")


def _forward_kernel(config, inputs, factors):
    """(out8, lse, amaxes float32 [2, 4]: amax_s, amax_o) of one shard; factors: the scale
    rows of FORWARD_FACTORS."""
    if config.implementation == "cudnn":
        return fp8_target.forward(inputs, config, factors)
    f = dict(zip(FORWARD_FACTORS, factors[..., 0]))
    q, k, v = (_dequantized(inputs[x], f[n]) for x, n in
               (("query", "descale_q"), ("key", "descale_k"), ("value", "descale_v")))
    out, lse, amax_s = fp8_reference.forward_core(config, inputs, q, k, v, f["scale_s"])
    return (_quantized(out, f["scale_o"]), lse,
            fp8_kernels.scale_rows([amax_s, scaling.amax(out)]))


def _backward_kernel(config, inputs, out8, lse, d_out, factors):
    """(dq, dk, dv in e4m3, amaxes float32 [4, 4]: AMAXES' order) of one shard; factors: the
    scale rows of BACKWARD_FACTORS."""
    if config.implementation == "cudnn":
        return fp8_target.backward(inputs, out8, lse, d_out, config, factors)
    f = dict(zip(BACKWARD_FACTORS, factors[..., 0]))
    q, k, v = (_dequantized(inputs[x], f[n]) for x, n in
               (("query", "descale_q"), ("key", "descale_k"), ("value", "descale_v")))
    o, d_o = _dequantized(out8, f["descale_o"]), _dequantized(d_out, f["descale_dO"])
    grads = fp8_reference.backward_core(config, inputs, q, k, v, o, lse, d_o, f["scale_dP"],
                                        "e4m3", f["scale_s"])
    dq, dk, dv = (_quantized(g, f[n]) for g, n in
                  zip(grads[:3], ("scale_dQ", "scale_dK", "scale_dV")))
    return dq, dk, dv, fp8_kernels.scale_rows([scaling.amax(g) for g in grads[:3]] + [grads[3]])


def _names(config):
    return ["query", "key", "value"] + (["q_lengths", "kv_lengths"] if config.has_lengths
                                        else [])


@functools.lru_cache(maxsize=None)
def _forward_call(config, groups):
    """The forward with the kernels' sharding rule (batch/heads; amaxes reduced over shards)."""
    names = _names(config)

    def kernel_fn(*arrays):
        return _forward_kernel(config, dict(zip(names, arrays[:-1])), arrays[-1])
    return sharding.partitioned(kernel_fn, config, groups, names + ["fp8_factors"],
                                      ["output", "lse", "amaxes"])


@functools.lru_cache(maxsize=None)
def _backward_call(config, groups):
    names = _names(config)

    def kernel_fn(*arrays):
        inputs = dict(zip(names, arrays[:len(names)]))
        return _backward_kernel(config, inputs, *arrays[len(names):])
    return sharding.partitioned(
        kernel_fn, config, groups, names + ["output", "lse", "d_output", "fp8_factors"],
        ["dq", "dk", "dv", "amaxes"])


def _groups(query, key):
    return query.shape[2] // key.shape[2]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config, query, key, value, lengths, params):
    return _forward(config, query, key, value, lengths, params)[0]


def _forward(config, query, key, value, lengths, params):
    inputs = _inputs(query, key, value, lengths)
    call = _forward_call(config, _groups(query, key))
    out8, lse, amaxes = call(*(inputs[n] for n in _names(config)),
                             _factors(params, FORWARD_FACTORS))
    result = (out8, scaling.scalar(amaxes[0, 0]), scaling.scalar(amaxes[1, 0]))
    return result, (query, key, value, lengths, params, out8, lse)


def _backward(config, residuals, cotangents):
    query, key, value, lengths, params, out8, lse = residuals
    d_out = cotangents[0].astype(_E4M3)
    inputs = _inputs(query, key, value, lengths)
    call = _backward_call(config, _groups(query, key))
    dq, dk, dv, amaxes = call(*(inputs[n] for n in _names(config)), out8, lse, d_out,
                              _factors(params, BACKWARD_FACTORS))
    amax = dict(zip(AMAXES, amaxes[:, 0]))
    d_params = {name: jnp.zeros_like(x) for name, x in params.items()}
    for name in AMAXES:
        d_params[name] = scaling.scalar(amax[name]).reshape(params[name].shape).astype(
            params[name].dtype)
    return dq, dk, dv, None, d_params


_attention.defvjp(_forward, _backward)


def quantize(x, fmt="e4m3"):
    """(x [B, T, N, H] in the format with per-tensor current scaling, its descale factor
    float32 [1, 1, 1, 1]): the scaling fp8=True applies, for callers building fp8_params."""
    scale = scaling.current_scale(x, fmt)
    return scaling.quantize(x, scale, fmt), scaling.scalar(1 / scale)
