"""paged_attention on cuDNN's paged forward against the float32 reference path over the same
cache (decode and chunked prefill; GQA; windows; sinks; sequences shorter than T and empty ones;
page tables with garbage past each sequence's pages), outputs NaN-poisoned first; the lowered
program calls our forward target. Skipped without a GPU."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import calls_to, relative_error
from poisoning import poison_outputs

pytestmark = pytest.mark.gpu


def paged_problem(seed, kv_lengths, t, n, k, h, page_size, dtype, max_pages=None):
    """(q, key_cache, value_cache, page_table, kv_lengths): random pages in a shuffled pool,
    each sequence's table filled with garbage past its last page."""
    rng = np.random.default_rng(seed)
    b = len(kv_lengths)
    max_pages = max_pages or -(-max(kv_lengths) // page_size)
    pool = b * max_pages + 3
    table = rng.permutation(pool)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    for s, length in enumerate(kv_lengths):
        used = -(-length // page_size)
        table[s, used:] = rng.integers(-1000, 1000, size=max_pages - used)
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.float32).astype(dtype)
    key_cache = jax.random.normal(keys[1], (pool, page_size, k, h), jnp.float32).astype(dtype)
    value_cache = jax.random.normal(keys[2], (pool, page_size, k, h), jnp.float32).astype(dtype)
    return q, key_cache, value_cache, jnp.asarray(table), jnp.asarray(kv_lengths, jnp.int32)


def run(implementation, arrays, upcast=False, **kwargs):
    if upcast:
        arrays = [x.astype(jnp.float32) if x.dtype != jnp.int32 else x for x in arrays]
    with jax.default_matmul_precision("float32"):
        return jax.jit(lambda *a: jax_sdpa.paged_attention(
            *a, implementation=implementation, **kwargs))(*arrays)


CASES = {
    # name: (kv_lengths, T, N, K, page_size, kwargs)
    "decode": ([700, 64, 1, 333], 1, 8, 8, 64, {}),
    "decode_gqa": ([1024, 77, 513, 5, 64, 2000, 128, 900], 1, 32, 8, 64, {}),
    "decode_page16": ([100, 37], 1, 4, 1, 16, {}),
    "prefill": ([300, 128, 90, 517], 64, 8, 2, 64, {}),
    "prefill_short": ([40, 3, 0, 70], 8, 4, 2, 32, {}),  # fewer keys than T; an empty one
    "prefill_window": ([300, 200], 32, 8, 8, 64, dict(local_window_size=(50, 0))),
    "decode_window": ([300, 200, 9], 1, 8, 4, 64, dict(local_window_size=40)),
    "sinks": ([300, 5, 129], 4, 8, 2, 64, dict(sinks=jnp.linspace(-2.0, 3.0, 8))),
    "scale": ([129, 64], 2, 4, 4, 64, dict(scale=0.3)),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_cudnn_matches_reference(case, dtype):
    kv_lengths, t, n, k, page_size, kwargs = CASES[case]
    arrays = paged_problem(len(case), kv_lengths, t, n, k, 64, page_size, dtype)
    with poison_outputs():
        ours = run("cudnn", arrays, **kwargs)
    expected = run("xla", arrays, upcast=True, **kwargs)
    assert ours.dtype == dtype and ours.shape == expected.shape
    error = relative_error(ours, expected)
    assert error < 1e-2, f"{case}: relative error {error:.2e}"
    # Rows of queries before their sequence's first key are zeros, as on the reference path.
    positions = np.asarray(arrays[4])[:, None] - t + np.arange(t)[None, :]
    np.testing.assert_array_equal(np.asarray(ours, np.float32)[positions < 0], 0)


def test_paged_head_dim_128_and_value_head_dim():
    q, key_cache, _, table, lengths = paged_problem(3, [1500, 260], 3, 16, 4, 128, 64,
                                                    jnp.bfloat16)
    value_cache = jax.random.normal(jax.random.key(9), key_cache.shape[:3] + (64,),
                                    jnp.float32).astype(jnp.bfloat16)
    arrays = (q, key_cache, value_cache, table, lengths)
    ours = run("cudnn", arrays)
    assert ours.shape == (2, 3, 16, 64)
    assert relative_error(ours, run("xla", arrays, upcast=True)) < 1e-2


def test_paged_lowers_to_our_forward_and_soft_cap_takes_the_reference():
    arrays = paged_problem(0, [100, 50], 1, 4, 2, 64, 64, jnp.bfloat16)
    text = jax.jit(lambda *a: jax_sdpa.paged_attention(*a, implementation="cudnn")).lower(
        *arrays).as_text()
    assert "cudnn$fmha" not in text
    assert calls_to(text, "forward", "paged")
    with pytest.raises(NotImplementedError, match="logits_soft_cap"):
        jax_sdpa.paged_attention(*arrays, logits_soft_cap=30.0, implementation="cudnn")
    with pytest.warns(RuntimeWarning, match="logits_soft_cap"):
        out = jax_sdpa.paged_attention(*arrays, logits_soft_cap=30.0)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


def test_paged_decode_step_with_kv_update_under_jit():
    """One decode step as a server runs it: write the new token's K/V, then attend; the cache
    donated, under jit, against attention over the gathered keys."""
    # The new token stays inside each sequence's last page (255 -> 256, 63 -> 64, 300 -> 301).
    q, key_cache, value_cache, table, lengths = paged_problem(5, [255, 63, 300], 1, 8, 2, 64,
                                                              64, jnp.bfloat16, max_pages=6)
    new_k = jax.random.normal(jax.random.key(1), (3, 1, 2, 64)).astype(jnp.bfloat16)
    new_v = jax.random.normal(jax.random.key(2), (3, 1, 2, 64)).astype(jnp.bfloat16)

    def step(implementation, q, key_cache, value_cache):
        key_cache, value_cache = jax_sdpa.paged_kv_update(key_cache, value_cache, table,
                                                          lengths, new_k, new_v)
        return jax_sdpa.paged_attention(q, key_cache, value_cache, table, lengths + 1,
                                        implementation=implementation)
    ours = jax.jit(lambda q, kc, vc: step("cudnn", q, kc, vc), donate_argnums=(1, 2))(
        q, jnp.copy(key_cache), jnp.copy(value_cache))
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("float32"):
        expected = jax.jit(lambda q, kc, vc: step("xla", up(q), up(kc), up(vc)))(
            q, key_cache, value_cache)
    assert relative_error(ours, expected) < 1e-2
