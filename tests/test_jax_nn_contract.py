"""jax.nn.dot_product_attention's contract, held by jax_sdpa.dot_product_attention where a CPU
runs it (the reference path, and the fused path through the emulated ragged calls): the
residual's dtype, shape, values and gradient; transposed operands inside jit; strict dtype
promotion; float32 accuracy; float64; vmap in any position; errors for the inputs jax.nn
rejects; and no warning where jax.nn gives none."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa.limits import device
from conftest import random_qkv
from test_packing import emulated_cudnn  # noqa: F401

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}


def _residual_case(dtype):
    """q, k, v with a mask that hides row 3 entirely, and query lengths cutting rows."""
    q, k, v, _ = random_qkv(1, 2, 12, 10, 4, 2, 16, dtype)
    mask = np.ones((2, 1, 12, 10), bool)
    mask[:, :, 3] = False
    return q, k, v, dict(mask=jnp.asarray(mask), is_causal=True,
                         query_seq_lengths=jnp.array([12, 7], jnp.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_residual_is_jax_nns(dtype):
    q, k, v, kwargs = _residual_case(dtype)
    with jax.default_matmul_precision("float32"):  # (a GPU's default for float32 is TF32)
        out, lse = jax_sdpa.dot_product_attention(q, k, v, return_residual=True, **kwargs)
        out_nn, lse_nn = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kwargs)
    assert lse.shape == lse_nn.shape == (2, 12, 4) and lse.dtype == lse_nn.dtype == dtype
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_nn, np.float32),
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(lse, np.float32), np.asarray(lse_nn, np.float32),
                               rtol=tol, atol=tol)
    # Three-axis inputs: the residual is [T, N], as jax.nn's.
    _, lse3 = jax_sdpa.dot_product_attention(q[0], k[0], v[0], return_residual=True)
    assert lse3.shape == (12, 4) and lse3.dtype == dtype


def test_residual_dtype_opts_into_float32():
    q, k, v, kwargs = _residual_case(jnp.bfloat16)
    _, lse = jax_sdpa.dot_product_attention(q, k, v, return_residual=True,
                                            residual_dtype=jnp.float32, **kwargs)
    _, lse_f32 = jax_sdpa.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                return_residual=True, **kwargs)
    assert lse.dtype == jnp.float32
    np.testing.assert_allclose(lse, lse_f32, rtol=1e-2, atol=1e-2)
    with pytest.raises(TypeError, match="residual_dtype"):
        jax_sdpa.dot_product_attention(q, k, v, return_residual=True, residual_dtype=jnp.int32)


@pytest.mark.parametrize("path", ["xla", "packed"])
def test_a_residual_cotangent_in_the_inputs_dtype_is_taken_and_ignored(path, emulated_cudnn):
    """Differentiating through both outputs, as JAX's own attention tests do: the residual's
    cotangent comes in the inputs' dtype and, under stop_gradient, changes nothing."""
    q, k, v, d_out = random_qkv(2, 2, 48, 48, 4, 2, 32, jnp.bfloat16)
    extra = {} if path == "xla" else dict(
        query_segment_ids=jnp.repeat(jnp.arange(4, dtype=jnp.int32), 12)[None].repeat(2, 0))

    def f(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=True, return_residual=True,
                                              implementation="xla" if path == "xla" else
                                              "cudnn", **extra)
    (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v)
    assert lse.dtype == jnp.bfloat16
    with_lse = vjp((d_out, jnp.ones_like(lse)))
    without = vjp((d_out, jnp.zeros_like(lse)))
    for a, b in zip(with_lse, without):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_transposed_operands_inside_jit(dtype):
    """[B, N, T, H] arrays swapped to [B, T, N, H] inside jit: XLA's CPU backend has no dot of
    transposed 16-bit operands with a float32 result."""
    q = jax.random.normal(jax.random.key(3), (2, 4, 16, 8)).astype(dtype)

    def make(fn):
        return lambda q: fn(*(jnp.swapaxes(q, 1, 2),) * 3, is_causal=True, implementation="xla")
    ours = jax.jit(make(jax_sdpa.dot_product_attention))(q)
    theirs = make(jax.nn.dot_product_attention)(q)  # (jax.nn's float16 fails under jit on CPU)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32),
                               rtol=tol, atol=tol)
    grad = jax.jit(jax.grad(lambda q: make(jax_sdpa.dot_product_attention)(q).astype(
        jnp.float32).sum()))(q)
    assert grad.dtype == dtype and np.isfinite(np.asarray(grad, np.float32)).all()


STRICT_OPTIONS = {
    "lengths": dict(query_seq_lengths=jnp.array([16, 9], jnp.int32),
                    key_value_seq_lengths=jnp.array([5, 16], jnp.int32)),
    "mask_bias": dict(mask=jnp.tril(jnp.ones((16, 16), bool))[None, None],
                      bias=jnp.full((1, 1, 16, 16), 0.5, jnp.bfloat16)),
    "window": dict(local_window_size=(3, 1)),
    "bottom_right": dict(is_causal=True, causal_alignment="bottom_right"),
    "soft_cap_sinks": dict(logits_soft_cap=5.0, sinks=jnp.zeros((4,), jnp.float32)),
    "dropout": dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    "segments": dict(query_segment_ids=jnp.repeat(jnp.arange(2, dtype=jnp.int32), 8)[None]
                     .repeat(2, 0), is_causal=True),
    "stated_segments": dict(query_segment_ids=jnp.repeat(jnp.arange(2, dtype=jnp.int32), 8)
                            [None].repeat(2, 0), max_document_length=8, max_segments=2),
}


@pytest.mark.parametrize("path", ["xla", "cudnn"])
@pytest.mark.parametrize("option", sorted(STRICT_OPTIONS))
def test_strict_dtype_promotion(option, path, emulated_cudnn):
    """Under jax.numpy_dtype_promotion("strict") every option runs, forward and backward (on
    CPU the fused path's kernels are the emulated ones)."""
    kwargs = STRICT_OPTIONS[option]
    q, k, v, d_out = random_qkv(4, 2, 16, 16, 4, 2, 16, jnp.bfloat16)
    with jax.numpy_dtype_promotion("strict"):
        f = jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, implementation=path, return_residual=True, **kwargs))
        (out, lse), vjp = jax.vjp(f, q, k, v)
        grads = vjp((d_out, jnp.zeros_like(lse)))
    for x in (out, *grads):
        assert np.isfinite(np.asarray(x, np.float32)).all()


def _float64_oracle(q, k, v, d_out):
    """(output, dq, dk, dv) in float64 numpy, non-causal, GQA by repeating K/V."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    groups = q.shape[2] // k.shape[2]
    k_rep, v_rep = np.repeat(k, groups, 2), np.repeat(v, groups, 2)
    scale = 1 / np.sqrt(q.shape[-1])
    s = np.einsum("btnh,bsnh->bnts", q, k_rep) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", p, v_rep)
    dv = np.einsum("bnts,btnh->bsnh", p, d_out)
    dp = np.einsum("btnh,bsnh->bnts", d_out, v_rep)
    ds = p * (dp - np.einsum("btnh,btnh->bnt", d_out, out)[..., None])
    dq = np.einsum("bnts,bsnh->btnh", ds, k_rep) * scale
    dk = np.einsum("bnts,btnh->bsnh", ds, q) * scale
    fold = lambda x: x.reshape(*k.shape[:3], groups, k.shape[3]).sum(3)  # noqa: E731
    return out, dq, fold(dk), fold(dv)


@pytest.mark.parametrize("heads,kv_heads,head_dim,magnitude", [
    (4, 4, 32, 3.0), (8, 2, 64, 1.0), (2, 2, 128, 2.0)])
def test_float32_accuracy_is_jax_nns(heads, kv_heads, head_dim, magnitude):
    """Against a float64 oracle at T = 256, S = 8: every element's error at most jax.nn's
    largest (with a margin of a few ulps)."""
    errors = {}
    for seed in range(3):
        q, k, v, d_out = random_qkv(seed, 2, 256, 8, heads, kv_heads, head_dim, jnp.float32)
        q, k = q * magnitude, k * magnitude
        expected = _float64_oracle(q, k, v, d_out)
        for name, fn in (("ours", jax_sdpa.dot_product_attention),
                         ("jax.nn", jax.nn.dot_product_attention)):
            out, vjp = jax.vjp(fn, q, k, v)
            got = (out, *vjp(d_out))
            errors.setdefault(name, []).append(
                [np.max(np.abs(np.asarray(g, np.float64) - e)) for g, e in zip(got, expected)])
    ours, theirs = (np.max(np.array(errors[name]), axis=0) for name in ("ours", "jax.nn"))
    for label, a, b in zip(("output", "dq", "dk", "dv"), ours, theirs):
        assert a <= 1.05 * b + 1e-7, f"{label}: {a:.2e} vs jax.nn's {b:.2e}"


def test_float64_under_x64():
    with jax.enable_x64(True):
        q, k, v, d_out = random_qkv(5, 2, 20, 12, 4, 2, 16, jnp.float64)
        out, lse = jax_sdpa.dot_product_attention(q, k, v, return_residual=True)
        _, lse_nn = jax.nn.dot_product_attention(q, k, v, return_residual=True)
        assert out.dtype == lse.dtype == lse_nn.dtype == jnp.float64
        grads = jax.grad(lambda q, k, v: jnp.vdot(jax_sdpa.dot_product_attention(q, k, v),
                                                  d_out), argnums=(0, 1, 2))(q, k, v)
        expected = _float64_oracle(q, k, v, d_out)
        for got, want in zip((out, *grads), expected):
            assert got.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("in_axes", [0, 1, 2, 4], ids=lambda a: f"axis{a}")
def test_vmap_in_any_position(in_axes):
    """vmap over any axis of five-axis arrays: the same as jax.nn under the same vmap."""
    q, k, v, _ = random_qkv(6, 2, 8, 8, 4, 2, 16, jnp.float32)
    stack = lambda x: jnp.stack([x, 2 * x, -x], axis=in_axes)  # noqa: E731
    q5, k5, v5 = (stack(x) for x in (q, k, v))
    if in_axes == 4:  # the vmapped axis past the head axis: heads stay where jax.nn expects
        q5, k5, v5 = (jnp.moveaxis(x, 4, 3) for x in (q5, k5, v5))
        in_axes = 3
    kwargs = dict(is_causal=True)
    with jax.default_matmul_precision("float32"):
        ours = jax.vmap(lambda q, k, v: jax_sdpa.dot_product_attention(q, k, v, **kwargs),
                        in_axes=in_axes)(q5, k5, v5)
        theirs = jax.vmap(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kwargs),
                          in_axes=in_axes)(q5, k5, v5)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def _bad_inputs():
    q, k, v, _ = random_qkv(7, 2, 8, 8, 4, 2, 16, jnp.float32)
    lengths = jnp.array([8, 8], jnp.int32)
    return {
        "key dtype": ((q, k.astype(jnp.bfloat16), v), {}),
        "value dtype": ((q, k, v.astype(jnp.float16)), {}),
        "head_dim": ((q, k[..., :8], v), {}),
        "heads": ((q[:, :, :3], k, v), {}),
        "batch": ((q[:1], k, v), {}),
        "mask dtype": ((q, k, v), dict(mask=jnp.ones((1, 1, 8, 8), jnp.int32))),
        "lengths dtype": ((q, k, v), dict(query_seq_lengths=lengths.astype(jnp.float32))),
        "lengths shape": ((q, k, v), dict(key_value_seq_lengths=lengths[:1])),
        "implementation": ((q, k, v), dict(implementation="triton")),
    }


@pytest.mark.parametrize("case", sorted(_bad_inputs()))
def test_the_inputs_jax_nn_rejects_raise_a_value_error(case):
    args, kwargs = _bad_inputs()[case]
    with pytest.raises(ValueError):
        jax.nn.dot_product_attention(*args, **kwargs)
    with pytest.raises(ValueError):
        jax_sdpa.dot_product_attention(*args, **kwargs)


def test_no_warning_without_a_gpu():
    if device.device_reason() is None:
        pytest.skip("a GPU is present")
    q, k, v, _ = random_qkv(8, 1, 8, 8, 2, 2, 12, jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (jnp.bfloat16, jnp.float32):
            args = [x.astype(dtype) for x in (q, k, v)]
            jax_sdpa.dot_product_attention(*args, is_causal=True)
            jax.jit(jax.grad(lambda q: jax_sdpa.dot_product_attention(
                q, *args[1:]).astype(jnp.float32).sum()))(args[0])


def test_a_gpu_fallback_warns_at_the_callers_line(monkeypatch):
    """With a GPU (patched in), a float16/bfloat16 call that cuDNN cannot take warns, naming
    this file's line; float32 inputs and implementation='xla' stay silent, as in jax.nn."""
    monkeypatch.setattr(device, "device_reason", lambda: None)
    q, k, v, _ = random_qkv(9, 1, 8, 8, 2, 2, 12, jnp.bfloat16)  # head_dim 12: not for cuDNN
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax_sdpa.dot_product_attention(q, k, v)
        jax_sdpa.dot_product_attention(q, k, v, implementation="xla")
        jax_sdpa.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)))
    ours = [w for w in caught if "jax_sdpa" in str(w.message)]
    assert len(ours) == 1 and "head_dim 12" in str(ours[0].message)
    assert ours[0].filename == __file__
    with pytest.raises(NotImplementedError, match="head_dim 12"):
        jax_sdpa.dot_product_attention(q, k, v, implementation="cudnn")
