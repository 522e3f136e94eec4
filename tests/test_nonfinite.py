"""NaN in the inputs propagates as IEEE arithmetic says, on both paths, and never crashes or
hangs: a NaN in one query row makes that row's output NaN (and its gradients), every other row
stays finite."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import random_qkv

IMPLEMENTATIONS = ["xla", pytest.param("cudnn", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_nan_query_row_stays_in_its_row(implementation):
    dtype = jnp.bfloat16 if implementation == "cudnn" else jnp.float32
    q, k, v, d_out = random_qkv(41, 2, 64, 64, 4, 2, 64, dtype)
    q = q.at[1, 5, 2].set(jnp.nan)
    fn = jax.jit(lambda q: jax_sdpa.dot_product_attention(q, k, v, is_causal=True,
                                                          implementation=implementation))
    out, vjp = jax.vjp(fn, q)
    (dq,) = vjp(d_out)
    out, dq = np.asarray(out, np.float32), np.asarray(dq, np.float32)
    assert np.isnan(out[1, 5, 2]).all() and np.isnan(dq[1, 5, 2]).all()
    others = np.ones(out.shape[:3], bool)
    others[1, 5, 2] = False
    assert np.isfinite(out[others]).all() and np.isfinite(dq[others]).all()
