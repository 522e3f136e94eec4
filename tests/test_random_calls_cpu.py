"""Random dense calls on the cuDNN path (emulated on CPU: tests/ragged_emulator.py) against the
reference path: the planning, the masks folded into a bias, the band's refinement, the lengths,
the rows that see no key and the sinks must give the reference's function, values and
gradients, whatever the combination. (tests/test_packing.py does the same for packed rows.)"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import random_qkv, relative_error
from test_packing import emulated_cudnn  # noqa: F401

N, H = 4, 16


def random_call(rng):
    """(shape arguments of random_qkv, keyword arguments) of one random dense call."""
    batch, t, s = int(rng.choice([1, 2])), int(rng.choice([1, 5, 16])), int(rng.choice([1, 7, 16]))
    kv_heads = int(rng.choice([1, 2, 4]))
    kwargs = dict(is_causal=bool(rng.random() < 0.5))
    if rng.random() < 0.3:
        kwargs["causal_alignment"] = "bottom_right"
    if rng.random() < 0.4:
        kwargs["local_window_size"] = (int(rng.integers(0, 6)), int(rng.integers(0, 3)))
    if rng.random() < 0.3:
        shape = (int(rng.choice([1, batch])), int(rng.choice([1, N])), t, s)
        kwargs["bias"] = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    if rng.random() < 0.3:
        kwargs["mask"] = jnp.asarray(rng.random((batch, 1, t, s)) > 0.3)
    if rng.random() < 0.5:
        kwargs["query_seq_lengths"] = jnp.asarray(rng.integers(0, t + 1, batch), jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.asarray(rng.integers(0, s + 1, batch), jnp.int32)
    if rng.random() < 0.3:
        kwargs["sinks"] = jnp.asarray(rng.normal(size=N), jnp.float32)
    if rng.random() < 0.3:
        kwargs["logits_soft_cap"] = float(rng.choice([2.0, 30.0]))
    return (batch, t, s, N, kv_heads, H, jnp.bfloat16), kwargs


@pytest.mark.parametrize("seed", range(12))
def test_random_dense_calls_match_the_reference(seed, emulated_cudnn):
    rng = np.random.default_rng(500 + seed)
    shape, kwargs = random_call(rng)
    q, k, v, d_out = random_qkv(seed, *shape)

    def make(implementation, cast):
        return jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
            cast(q), cast(k), cast(v), implementation=implementation, **kwargs))
    # The default implementation: cuDNN where it runs the call, else (a warning) the reference,
    # or cuDNN's forward with the reference's backward.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out, vjp = jax.vjp(make(None, lambda x: x), q, k, v)
        ours = (out, *vjp(d_out))
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    out_ref, vjp_ref = jax.vjp(make("xla", up), q, k, v)
    ref = (out_ref, *vjp_ref(up(d_out)))
    for name, a, b in zip(("output", "dq", "dk", "dv"), ours, ref):
        assert relative_error(a, b) < 2e-2, f"{name}: {relative_error(a, b):.2e} {kwargs}"


def test_most_random_calls_run_on_the_cudnn_path(emulated_cudnn):
    """Most of the random calls above are ones cuDNN takes whole (the others take the
    reference for all or part): otherwise they would check the reference against itself."""
    refused = 0
    for seed in range(12):
        shape, kwargs = random_call(np.random.default_rng(500 + seed))
        q, k, v, _ = random_qkv(seed, *shape)
        try:
            jax.eval_shape(lambda q, k, v: jax_sdpa.dot_product_attention(
                q, k, v, implementation="cudnn", **kwargs), q, k, v)
        except NotImplementedError:
            refused += 1
    assert refused <= 6, refused
