"""Proof that our kernels write every element they return: inside poison_outputs(), calls traced
run our FFI targets' poisoned twins (the devtools extension, ffi/devtools/poisoned_targets.h),
which fill every result (the outputs, and the cuDNN workspace XLA allocates) with all-ones bytes,
NaN in every float type, before the product's handler runs on the same call."""

from __future__ import annotations

import contextlib
import functools

import jax

from jax_sdpa import fp8
from jax_sdpa.cudnn import extension as _extension
from jax_sdpa.kernels import sharding as sharding_rules


@functools.lru_cache(maxsize=None)
def _poisoned_names() -> dict:
    """Registers the poisoned twins once: {target name: its poisoned twin's name}."""
    from jax_sdpa import _sdpa_devtools  # noqa: PLC0415 - built for tests only

    _extension.register_ffi_targets()  # the call state's type and the product's targets
    registrations = _extension.extension().registrations()
    for name, stages in _sdpa_devtools.poisoned_registrations(registrations).items():
        jax.ffi.register_ffi_target(name, stages, platform="CUDA")
    return {name: f"{name}_poisoned" for name in registrations}


def _forget_traces():
    """A target's name is read when a call is traced, and JAX reuses a trace of the same
    callable on the same shapes (the kernels' partitioned callables are cached per config): drop
    both, so that a call traced on either side of the block's edge is traced afresh."""
    for cached in (sharding_rules._forward_call, sharding_rules._backward_call,
                   fp8._forward_call, fp8._backward_call):
        cached.cache_clear()
    jax.clear_caches()


@contextlib.contextmanager
def poison_outputs():
    """Calls traced inside this block run the poisoned twins of our targets."""
    twins = _poisoned_names()
    product_names = _extension.target_names

    def poisoned_names():
        return {role: twins[name] for role, name in product_names().items()}
    _forget_traces()
    _extension.target_names = poisoned_names
    try:
        yield
    finally:
        _extension.target_names = product_names
        _forget_traces()
