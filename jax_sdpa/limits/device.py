"""The device and library every cuDNN call needs: an NVIDIA GPU of compute capability 8.0 or
newer, our extension loaded, cuDNN 9.0 or newer."""

from __future__ import annotations

import functools

import jax

from jax_sdpa.cudnn import extension

MIN_CUDNN_VERSION = 90000  # cuDNN 9.0: SDPA forward and backward through the frontend graphs
MIN_COMPUTE_CAPABILITY = (8, 0)  # Ampere: cuDNN's fused flash attention kernels


@functools.lru_cache(maxsize=None)
def capability():
    """(major, minor) of the default device, or None when JAX does not say."""
    value = getattr(jax.devices()[0], "compute_capability", None)
    if value is None:
        return None
    return tuple(int(part) for part in str(value).split(".")[:2])


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
    found = capability()
    if found is not None and found < MIN_COMPUTE_CAPABILITY:
        return (f"{device.device_kind} has compute capability {found[0]}.{found[1]}; "
                "cuDNN flash attention needs 8.0 (Ampere) or newer")
    load_error = extension.extension_load_error()
    if load_error is not None:
        return load_error
    version = extension.cudnn_version()
    if version < MIN_CUDNN_VERSION:
        return (f"the loaded cuDNN is {version}; jax_sdpa needs cuDNN >= 9.0 "
                "(pip install nvidia-cudnn-cu13)")
    return None


def gpu_capability():
    """(major, minor) of the default device where cuDNN can serve it, else None (the limits
    that depend on the GPU generation then do not apply: the reference path runs)."""
    return capability() if device_reason() is None else None


def gpu_cudnn_version():
    """The loaded cuDNN's version where cuDNN can serve the default device, else None."""
    return extension.cudnn_version() if device_reason() is None else None
