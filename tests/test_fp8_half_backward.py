"""An FP8 call's backward on cuDNN's half-precision graphs (limits/fp8.half_backward_reason):
planned where cuDNN's FP8 backward is slower (GQA) or absent (short sequences), lowered to our
dense backward target beside the FP8 forward target, with no warning; off while
limits/fp8.HALF_BACKWARD_ON_CUDNN is (tests/test_gpu_fp8.py turns it on to verify it)."""

import warnings

import jax
import jax.numpy as jnp
import pytest

import jax_sdpa
from test_lowering import assert_decoded, backend_config


@pytest.fixture
def on_a_gpu(monkeypatch):
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)


@pytest.fixture
def half_backward(on_a_gpu, monkeypatch):
    monkeypatch.setattr(jax_sdpa.limits.fp8, "HALF_BACKWARD_ON_CUDNN", True)


def _lowered(seq, heads, kv_heads, head_dim=128):
    q = jnp.zeros((2, seq, heads, head_dim), jnp.bfloat16)
    k = jnp.zeros((2, seq, kv_heads, head_dim), jnp.bfloat16)
    loss = lambda q, k: jax_sdpa.dot_product_attention(  # noqa: E731
        q, k, k, is_causal=True, fp8=True, implementation="cudnn").astype(jnp.float32).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a chosen kernel, not a fallback: no warning
        return jax.jit(jax.grad(loss, (0, 1))).trace(q, k).lower(
            lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("seq, heads, kv_heads", [(128, 8, 2), (32, 4, 4)],
                         ids=["GQA", "short"])
def test_fp8_forward_with_the_half_backward(half_backward, seq, heads, kv_heads):
    text = _lowered(seq, heads, kv_heads)
    assert_decoded(text, "forward", "fp8")
    assert_decoded(text, "backward", "dense")


def test_without_gqa_the_fp8_backward_stays(half_backward):
    text = _lowered(128, 4, 4)
    assert_decoded(text, "forward", "fp8")
    assert_decoded(text, "backward", "fp8")


def test_on_since_verified_on_a_gpu(on_a_gpu):
    """limits/fp8.HALF_BACKWARD_ON_CUDNN: with GQA an FP8 call's backward is the dense one."""
    text = _lowered(128, 8, 2)
    assert_decoded(text, "backward", "dense")
