"""The public API against jax.nn.dot_product_attention(implementation='xla'): outputs and
gradients, under jit, vmap, checkpoint, for every option. Runs on any backend (CI: CPU)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import assert_same_function, random_qkv, relative_error

SHAPES = [  # (B, T, S, N, K, H)
    (2, 16, 16, 4, 4, 32),  # MHA
    (2, 16, 24, 4, 2, 32),  # GQA, T != S
    (1, 33, 17, 6, 1, 16),  # MQA, odd lengths
]


def ours(*args, **kwargs):
    return jax_sdpa.dot_product_attention(*args, implementation="xla", **kwargs)


def theirs(*args, **kwargs):
    return jax.nn.dot_product_attention(*args, implementation="xla", **kwargs)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_jax_nn(shape, is_causal):
    b, t, s, n, kh, h = shape
    q, k, v, d_out = random_qkv(0, b, t, s, n, kh, h, jnp.float32)
    assert_same_function(lambda *a: ours(*a, is_causal=is_causal, scale=0.3),
                         lambda *a: theirs(*a, is_causal=is_causal, scale=0.3), (q, k, v), d_out)


def test_eager_calls_match_jax_nn():
    """Called op by op, outside jit (the other tests here compare jitted functions)."""
    q, k, v, d_out = random_qkv(9, 2, 16, 24, 4, 2, 32, jnp.float32)
    lengths = jnp.array([16, 5], jnp.int32)
    kwargs = dict(is_causal=True, key_value_seq_lengths=lengths)
    with jax.default_matmul_precision("float32"):
        out, vjp = jax.vjp(lambda *a: ours(*a, **kwargs), q, k, v)
        out_ref, vjp_ref = jax.vjp(lambda *a: theirs(*a, **kwargs), q, k, v)
        pairs = [(out, out_ref), *zip(vjp(d_out), vjp_ref(d_out))]
    for a, b in pairs:
        assert relative_error(a, b) < 1e-5


@pytest.mark.parametrize("option", ["bias", "mask", "lengths", "window", "window_causal",
                                    "bias_causal", "mask_lengths", "mask_empty_rows"])
def test_options_match_jax_nn(option):
    b, t, s, n, kh, h = 2, 12, 12, 4, 2, 16
    q, k, v, d_out = random_qkv(1, b, t, s, n, kh, h, jnp.float32)
    rng = np.random.default_rng(0)
    kwargs = {}
    if "bias" in option:
        kwargs["bias"] = jnp.asarray(rng.normal(size=(1, n, t, s)), jnp.float32)
    if "mask" in option:
        kwargs["mask"] = jnp.asarray(rng.random((b, 1, t, s)) > 0.3)
    if option == "mask_empty_rows":  # rows that attend to nothing: a uniform softmax, as jax.nn
        kwargs["mask"] = kwargs["mask"].at[:, :, 3:5, :].set(False)
    if "lengths" in option:
        kwargs["query_seq_lengths"] = jnp.array([12, 7], jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.array([9, 12], jnp.int32)
    if "window" in option:
        kwargs["local_window_size"] = (3, 2)
    if "causal" in option:
        kwargs["is_causal"] = True
    assert_same_function(lambda *a: ours(*a, **kwargs), lambda *a: theirs(*a, **kwargs),
                         (q, k, v), d_out)


def test_jit_vmap_checkpoint():
    q, k, v, d_out = random_qkv(2, 2, 8, 8, 4, 2, 16, jnp.float32)
    stack = lambda x: jnp.stack([x, 2 * x, -x])  # noqa: E731
    fn = jax.jit(jax.vmap(jax.checkpoint(lambda *a: ours(*a, is_causal=True))))
    ref = jax.vmap(lambda *a: theirs(*a, is_causal=True))
    assert_same_function(fn, ref, (stack(q), stack(k), stack(v)), stack(d_out))


def test_rank3_and_rank5_inputs():
    q, k, v, _ = random_qkv(3, 2, 8, 8, 4, 4, 16, jnp.float32)
    with jax.default_matmul_precision("float32"):
        out3 = ours(q[0], k[0], v[0])
        expected3 = theirs(q[0], k[0], v[0])
        q5, k5, v5 = (jnp.stack([x, x[::-1]]) for x in (q, k, v))
        out5 = ours(q5, k5, v5, is_causal=True)
        expected = jax.vmap(lambda a, b, c: theirs(a, b, c, is_causal=True))(q5, k5, v5)
    assert out3.shape == q[0].shape
    np.testing.assert_allclose(out3, expected3, rtol=1e-5, atol=1e-6)
    assert out5.shape == q5.shape
    np.testing.assert_allclose(out5, expected, rtol=1e-5, atol=1e-6)


def test_return_residual_matches_jax_nn():
    q, k, v, _ = random_qkv(4, 2, 10, 14, 4, 2, 16, jnp.float32)
    with jax.default_matmul_precision("float32"):
        out, lse = ours(q, k, v, is_causal=True, return_residual=True)
        out_ref, lse_ref = theirs(q, k, v, is_causal=True, return_residual=True)
    assert lse.shape == lse_ref.shape == (2, 10, 4) and lse.dtype == jnp.float32
    np.testing.assert_allclose(out, out_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)


def test_low_precision_reference_is_close_to_float32():
    q, k, v, _ = random_qkv(5, 2, 16, 16, 4, 4, 32, jnp.bfloat16)
    out = ours(q, k, v, is_causal=True)
    assert out.dtype == jnp.bfloat16
    expected = ours(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True)
    assert relative_error(out, expected) < 1e-2


def test_cudnn_without_gpu_is_a_clear_error():
    if jax_sdpa.limits.device.device_reason() is None:
        pytest.skip("a GPU is present")
    q, k, v, _ = random_qkv(6, 1, 8, 8, 2, 2, 64, jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="implementation='cudnn'.*NVIDIA GPU"):
        jax_sdpa.dot_product_attention(q, k, v, implementation="cudnn")


def test_default_falls_back_silently_without_a_gpu():
    """As jax.nn picks XLA silently, so does the default call where there is no GPU to lose."""
    if jax_sdpa.limits.device.device_reason() is None:
        pytest.skip("a GPU is present")
    q, k, v, _ = random_qkv(7, 1, 8, 8, 2, 2, 16, jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax_sdpa.dot_product_attention(q, k, v)


def test_rows_without_keys_are_zero_for_a_zero_kv_length():
    q, k, v, _ = random_qkv(8, 2, 6, 6, 2, 2, 8, jnp.float32)
    out = ours(q, k, v, key_value_seq_lengths=jnp.array([0, 6], jnp.int32))
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_allclose(out[1], theirs(q, k, v)[1], rtol=1e-5, atol=1e-6)


def test_one_query_one_key_plans_a_reference_backward(monkeypatch):
    """cuDNN's backward refuses T = S = 1 (its frontend says so at graph build, inside jit):
    planned up front, the default call keeps cuDNN's forward and takes the reference backward
    with a warning; implementation='cudnn' raises before anything runs."""
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    q = jnp.zeros((4, 1, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="backward.*T = S = 1"):
        jax_sdpa.dot_product_attention(q, q, q, implementation="cudnn")
    grad = jax.grad(lambda q: jax_sdpa.dot_product_attention(q, q, q).astype(
        jnp.float32).sum())
    with pytest.warns(RuntimeWarning, match="backward.*reference path.*T = S = 1"):
        text = jax.jit(grad).trace(q).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_sdpa_dense_forward" in text and "jax_sdpa_dense_backward" not in text


@pytest.mark.parametrize("value", ["abc", "0", "-3"])
def test_a_bad_graph_cache_size_is_named_when_the_extension_loads(value):
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    script = "from jax_sdpa.cudnn import extension as _extension\n_extension.extension()"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**__import__("os").environ, "JAX_SDPA_GRAPH_CACHE_SIZE": value},
                            timeout=120)
    assert result.returncode != 0
    assert "ValueError: JAX_SDPA_GRAPH_CACHE_SIZE must be a whole number >= 1" in result.stderr


def test_without_cudnn_installed_the_library_answers(monkeypatch):
    """A CPU-only install (no nvidia wheels): loading cuDNN finds no 'nvidia' package, the
    extension cannot load, and the version and cache queries answer instead of raising."""
    import importlib.util  # noqa: PLC0415

    from jax_sdpa.cudnn import extension as _extension  # noqa: PLC0415

    def no_nvidia(name, *args):
        raise ModuleNotFoundError("No module named 'nvidia'")
    def no_maps(path, *args, **kwargs):
        raise OSError(path)  # as if no libcudnn were loaded yet
    monkeypatch.setattr(importlib.util, "find_spec", no_nvidia)
    monkeypatch.setattr(_extension, "open", no_maps, raising=False)
    _extension._preload_cudnn()  # no error: the extension's own load reports what is missing
    monkeypatch.setattr(_extension, "_load", lambda: (None, "no cuDNN (pip install 'jax_sdpa[cuda13]')"))
    assert jax_sdpa.cudnn_version() is None
    assert jax_sdpa.graph_cache_stats() == {}
    q, k, v, _ = random_qkv(9, 1, 8, 8, 2, 2, 16, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(jax_sdpa.dot_product_attention(
        q, k, v, implementation="xla"), np.float32),
                               np.asarray(theirs(q, k, v), np.float32), rtol=2e-2, atol=2e-2)


def test_tests_needing_the_devtools_build_skip_naming_it(monkeypatch):
    """A plain `pip install .` has no jax_sdpa._sdpa_devtools: the tests that need it (poisoned
    twins, graph files) skip and say which build they need, rather than fail."""
    import sys  # noqa: PLC0415

    from poisoning import devtools_extension  # noqa: PLC0415
    monkeypatch.setitem(sys.modules, "jax_sdpa._sdpa_devtools", None)  # import fails
    monkeypatch.delattr(jax_sdpa, "_sdpa_devtools", raising=False)  # (once imported here)
    with pytest.raises(pytest.skip.Exception, match="devtools build"):
        devtools_extension()
