"""The cuDNN path lowers to our own FFI custom calls (never JAX's __cudnn$fmha), under grad,
vmap and checkpoint. Lowering for CUDA needs no GPU, so this runs in CI."""

import re

import jax
import jax.numpy as jnp
import pytest

from jax_sdpa import _ffi
from jax_sdpa.cudnn_path import cudnn_attention


def test_extension_loads_and_reports_cudnn():
    module = _ffi.extension()
    assert set(module.registrations()) == {_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET}
    assert module.cudnn_header_version() >= 90000


def custom_calls(fn, *args):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "cudnn$fmha" not in text
    return set(re.findall(r"custom_call @([\w$]+)", text))


def loss(q, k, v):
    output, _ = cudnn_attention(q, k, v, 0.125, True)
    return output.astype(jnp.float32).sum()


@pytest.mark.parametrize("transform", ["plain", "grad", "vmap_grad", "checkpoint_grad"])
def test_lowers_to_our_targets(transform):
    q = jnp.zeros((2, 128, 8, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 96, 2, 64), jnp.bfloat16)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    fn, args = {
        "plain": (loss, (q, kv, kv)),
        "grad": (grad, (q, kv, kv)),
        "vmap_grad": (jax.vmap(grad), (q[None], kv[None], kv[None])),
        "checkpoint_grad": (jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)), (q, kv, kv)),
    }[transform]
    expected = {_ffi.FORWARD_TARGET} if transform == "plain" else {
        _ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET}
    assert expected <= custom_calls(fn, *args)
