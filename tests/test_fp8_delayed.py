"""jax_sdpa.fp8.DelayedScaling: amax histories that give jax_sdpa.fp8.dot_product_attention's
fp8_params, as TransformerEngine's delayed scaling keeps them; a few steps of the loop a
framework runs, against float32 (the FP8 reference path here; the same call runs cuDNN's FP8
graphs on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdpa import fp8
from conftest import random_qkv, relative_error


def test_history_rolls_and_scales_from_its_largest_amax():
    recipe = fp8.DelayedScaling(length=3, margin=1.0)
    history = recipe.init()
    assert float(recipe.scale(history, "q")) == 1.0  # nothing measured yet
    for amax in (2.0, 8.0, 1.0, 0.5):
        history = recipe.update(history, {"q": amax})
    np.testing.assert_array_equal(history["q"], [0.5, 1.0, 8.0])  # the 2.0 dropped out
    assert float(recipe.scale(history, "q")) == pytest.approx(448.0 / (8.0 * 2.0))
    assert float(history["k"].max()) == 0.0
    with pytest.raises(ValueError, match="unknown tensors"):
        recipe.update(history, {"query": 1.0})
    with pytest.raises(ValueError, match="length"):
        fp8.DelayedScaling(length=0)


def _step(recipe, history, q, k, v, d_out):
    """One training step's attention in the framework convention: quantize with the delayed
    scales, run, dequantize, and the history one step on."""
    (q8, aq), (k8, ak), (v8, av), (do8, ado) = (
        recipe.quantize(history, name, x) for name, x in
        (("q", q), ("k", k), ("v", v), ("dO", d_out)))
    params = recipe.fp8_params(history)
    (out8, amax_s, amax_o), vjp = jax.vjp(
        lambda q8, k8, v8, params: fp8.dot_product_attention(q8, k8, v8, fp8_params=params,
                                                             scale=0.125, mask_type="CAUSAL"),
        q8, k8, v8, params)
    dq8, dk8, dv8, d_params = vjp((do8, jnp.zeros_like(amax_s), jnp.zeros_like(amax_o)))
    out = out8.astype(jnp.float32) / params["scale_o"].reshape(())
    grads = [g.astype(jnp.float32) / params[f"scale_{n}"].reshape(())
             for g, n in zip((dq8, dk8, dv8), ("dQ", "dK", "dV"))]
    amaxes = dict(q=aq, k=ak, v=av, dO=ado, s=amax_s, o=amax_o,
                  **{n: d_params[f"amax_{n}"] for n in ("dQ", "dK", "dV", "dP")})
    return out, grads, recipe.update(history, amaxes)


def test_a_few_steps_reach_fp8s_error_and_record_the_amaxes():
    q, k, v, d_out = random_qkv(12, 2, 128, 128, 4, 2, 64, jnp.bfloat16)
    up = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    exact, exact_vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=0.125, is_causal=True), *up[:3])
    exact_grads = exact_vjp(up[3])
    recipe = fp8.DelayedScaling(length=4)
    history = recipe.init()
    errors = []
    for _ in range(3):
        out, grads, history = _step(recipe, history, q, k, v, d_out)
        errors.append([relative_error(out, exact)] +
                      [relative_error(g, e) for g, e in zip(grads, exact_grads)])
    # the third step's scales come from measured amaxes: FP8's error, as current scaling's
    assert errors[-1][0] < 0.08, errors
    assert all(e < 0.1 for e in errors[-1][1:]), errors
    assert float(history["o"][0]) == pytest.approx(float(jnp.max(jnp.abs(exact))), rel=0.1)
    assert float(history["dQ"][0]) == pytest.approx(
        float(jnp.max(jnp.abs(exact_grads[0]))), rel=0.15)
    assert float(history["q"][0]) == float(jnp.max(jnp.abs(up[0])))
