"""Proof that our kernels write every element they return: inside poison_outputs(), calls traced
run our FFI targets' poisoned twins (the devtools extension, ffi/devtools/poisoned_targets.h),
which fill every result (the outputs, and the cuDNN workspace XLA allocates) with all-ones bytes,
NaN in every float type, before the product's handler runs on the same call."""

from __future__ import annotations

import contextlib
import functools

import jax
import pytest

from jax_sdpa import fp8
from jax_sdpa.cudnn import dense, extension, paged, ragged
from jax_sdpa.cudnn import fp8 as fp8_target
from jax_sdpa.kernels import sharding as sharding_rules

# Where the cuDNN layer holds its targets (jax_sdpa/cudnn/targets.py's, by job and direction).
_TARGET_HOLDERS = ((dense, "FORWARD"), (dense, "BACKWARD"), (ragged, "FORWARD"),
                   (ragged, "BACKWARD"), (paged, "FORWARD"), (fp8_target, "FORWARD"),
                   (fp8_target, "BACKWARD"))


def _poisoned(target):
    """The target under its poisoned twin's name (its command-buffer twin: that name +
    "_cmdbuf")."""
    return target._replace(name=target.name + "_poisoned")


@functools.lru_cache(maxsize=None)
def _register_poisoned_twins() -> None:
    """Registers, once, each target's and command-buffer twin's poisoned twin under the names
    _poisoned gives them."""
    devtools = devtools_extension()
    extension.register_ffi_targets()  # the call state's type and the product's targets
    wrapped = devtools.poisoned_registrations(extension.extension().registrations())
    for holder, attribute in _TARGET_HOLDERS:
        target = getattr(holder, attribute)
        twin = _poisoned(target)
        for product, poisoned in ((target.name, twin.name),
                                  (target.command_buffer_name, twin.command_buffer_name)):
            jax.ffi.register_ffi_target(poisoned, wrapped[f"{product}_poisoned"],
                                        platform="CUDA")


def devtools_extension():
    """jax_sdpa._sdpa_devtools (built by scripts/setup_env.sh and scripts/gpu_check.sh, not by a
    plain `pip install .`), or the test is skipped naming that."""
    try:
        from jax_sdpa import _sdpa_devtools  # noqa: PLC0415 - built for tests only
    except ImportError as error:
        pytest.skip(f"needs the devtools build of the extension (jax_sdpa._sdpa_devtools; "
                    f"bash scripts/setup_env.sh builds it): {error}")
    return _sdpa_devtools


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
    _register_poisoned_twins()
    product = [(holder, attribute, getattr(holder, attribute))
               for holder, attribute in _TARGET_HOLDERS]
    _forget_traces()
    for holder, attribute, target in product:
        setattr(holder, attribute, _poisoned(target))
    try:
        yield
    finally:
        for holder, attribute, target in product:
            setattr(holder, attribute, target)
        _forget_traces()
