"""Which calls the cuDNN path can run, and if not, why: one sentence a user can act on."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_sdpa import _ffi
from jax_sdpa.cudnn_path import diagonal_band
from jax_sdpa.validation import AttentionCall

MIN_CUDNN_VERSION = 90000  # cuDNN 9.0: SDPA forward and backward through the frontend graphs
MIN_COMPUTE_CAPABILITY = (8, 0)  # Ampere: cuDNN's fused flash attention kernels
MAX_HEAD_DIM = 256
CUDNN_DTYPES = (jnp.float16, jnp.bfloat16)


@functools.lru_cache(maxsize=None)
def device_reason() -> str | None:
    """None if the default backend is an NVIDIA GPU that cuDNN SDPA can serve, else why not."""
    try:
        devices = jax.devices()
    except RuntimeError as error:
        return f"no JAX devices ({error})"
    device = devices[0]
    if device.platform != "gpu" or "NVIDIA" not in device.device_kind.upper():
        return (f"the default JAX device is {device.platform} ({device.device_kind}), not an NVIDIA "
                "GPU: install jax[cuda13] (or jax[cuda12]) on a machine with an NVIDIA GPU")
    capability = getattr(device, "compute_capability", None)
    if capability is not None:
        major, minor = (int(part) for part in str(capability).split(".")[:2])
        if (major, minor) < MIN_COMPUTE_CAPABILITY:
            return (f"{device.device_kind} has compute capability {capability}; cuDNN flash "
                    "attention needs 8.0 (Ampere) or newer")
    load_error = _ffi.extension_load_error()
    if load_error is not None:
        return load_error + ": reinstall jax_sdpa with pip install '.[cuda13]'"
    version = _ffi.cudnn_version()
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


def call_reason(call: AttentionCall) -> str | None:
    """None if cuDNN can run this (validated) call, else why not. Ignores the device."""
    reason = kernel_reason(call.query.dtype, (("head_dim", call.query.shape[-1]),
                                              ("value head_dim", call.value.shape[-1])))
    return reason or diagonal_band(call)[1]


def unsupported_reason(call: AttentionCall) -> str | None:
    return device_reason() or call_reason(call)
