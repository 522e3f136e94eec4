"""jax_sdpa.explain: the kernels a call's forward and backward would take, and why, from the
same planning that runs it (here with a GPU faked where the choice depends on one)."""

import jax
import jax.numpy as jnp
import pytest

import jax_sdpa

Q = jax.ShapeDtypeStruct((2, 128, 8, 128), jnp.bfloat16)
KV = jax.ShapeDtypeStruct((2, 128, 2, 128), jnp.bfloat16)


@pytest.fixture
def on_a_gpu(monkeypatch):
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)


@pytest.fixture
def without_a_gpu(monkeypatch):
    """The device check as a CPU-only machine answers it (also where a GPU is present)."""
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: (
        "the default JAX device is cpu (cpu), not an NVIDIA GPU: install jax[cuda13] (or "
        "jax[cuda12]) on a machine with an NVIDIA GPU"))


def test_without_a_gpu_it_names_the_reference_and_why(without_a_gpu):
    lines = jax_sdpa.explain(Q, KV, KV, is_causal=True).splitlines()
    assert lines[0].startswith("forward: the XLA reference path, because")
    assert "NVIDIA GPU" in lines[0]
    assert jax_sdpa.explain(Q, KV, KV, implementation="cudnn").startswith("refused: ")


def test_it_names_the_target_and_the_score_mod_program(on_a_gpu):
    text = jax_sdpa.explain(Q, KV, KV, is_causal=True, alibi_slopes=jax_sdpa.alibi_slopes(8))
    assert text.splitlines() == [
        "forward: cuDNN, our dense target, the score_mod as 5 pointwise nodes reading 1 "
        "per-head tables", "backward: cuDNN, our dense target"]
    ids = jnp.zeros((2, 128), jnp.int32)
    assert "packed target" in jax_sdpa.explain(Q, KV, KV, query_segment_ids=ids)


def test_fallbacks_carry_the_limit_and_the_warning(on_a_gpu):
    text = jax_sdpa.explain(Q, KV, KV, score_mod=lambda s, b, h, i, j: jnp.maximum(s, 0.0))
    assert "forward: the XLA reference path, because score_mod compares float32" in text
    assert "\nnote: jax_sdpa: using the XLA reference path" in text
    one = jax.ShapeDtypeStruct((1, 1, 2, 64), jnp.bfloat16)
    backward = jax_sdpa.explain(one, one, one).splitlines()[1]
    assert backward.startswith("backward: the XLA reference path, because")


def test_fp8_names_the_half_precision_backward_where_chosen(on_a_gpu, monkeypatch):
    monkeypatch.setattr(jax_sdpa.limits.fp8, "HALF_BACKWARD_ON_CUDNN", True)
    lines = jax_sdpa.explain(Q, KV, KV, is_causal=True, fp8=True).splitlines()
    assert lines[0] == "forward: cuDNN, our FP8 target"
    assert lines[1].startswith("backward: cuDNN in bfloat16, our dense target, from the FP8 "
                               "forward's output and statistics, because")
    assert "GQA" in lines[1]
    assert jax_sdpa.explain(Q, Q, Q, fp8=True).splitlines()[1] == "backward: cuDNN, our FP8 target"


def test_arrays_plan_as_under_jit():
    q = jnp.ones((1, 16, 2, 64), jnp.float16)
    assert jax_sdpa.explain(q, q, q, return_residual=True).startswith("forward: ")
    with pytest.raises(TypeError):
        jax_sdpa.explain(q, q, q, no_such_option=1)
