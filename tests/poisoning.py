"""Proof that our kernels write every element they return: inside poison_outputs(), calls traced
run our FFI targets' poisoned twins (the devtools extension, ffi/devtools/poisoned_targets.h),
which fill every result (the outputs, and the cuDNN workspace XLA allocates) with all-ones bytes,
NaN in every float type, before the product's handler runs on the same call."""

from __future__ import annotations

import contextlib
import functools

import jax

from jax_sdpa import _extension


@functools.lru_cache(maxsize=None)
def _poisoned_names() -> dict:
    """Registers the poisoned twins once: {target name: its poisoned twin's name}."""
    from jax_sdpa import _sdpa_devtools  # noqa: PLC0415 - built for tests only

    _extension.register_ffi_targets()  # the call state's type and the product's targets
    registrations = _extension.extension().registrations()
    for name, stages in _sdpa_devtools.poisoned_registrations(registrations).items():
        jax.ffi.register_ffi_target(name, stages, platform="CUDA")
    return {name: f"{name}_poisoned" for name in registrations}


@contextlib.contextmanager
def poison_outputs():
    """Calls traced inside this block run the poisoned twins of our targets."""
    twins = _poisoned_names()
    product_names = _extension.target_names

    def poisoned_names():
        return {role: twins[name] for role, name in product_names().items()}
    _extension.target_names = poisoned_names
    try:
        yield
    finally:
        _extension.target_names = product_names
