"""Property-based differential test of the reference path's semantics: random shapes and options
against a float64 NumPy oracle written from the contract (README: API), independent of
jax_sdpa's code. The same function on a GPU routes these calls to cuDNN; tests/test_gpu.py holds
cuDNN against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import jax_sdpa  # noqa: E402


def oracle(q, k, v, bias, mask, scale, is_causal, q_lengths, kv_lengths, window,
           bottom_right=False, q_segments=None, kv_segments=None):
    """float64 attention from the written contract: (output [B,T,N,Hv], lse [B,T,N])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, _ = q.shape
    h = v.shape[-1]
    s, kh = k.shape[1], k.shape[2]
    k = np.repeat(k, n // kh, axis=2)
    v = np.repeat(v, n // kh, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        scores = scores + np.asarray(bias, np.float64)
    keep = np.ones((b, n, t, s), bool)
    if mask is not None:
        keep &= np.asarray(mask)
    if q_segments is not None:
        keep &= (q_segments[:, None, :, None] == kv_segments[:, None, None, :])
    # bottom-right: query i sits at key i + S - T
    i, j = np.arange(t)[:, None] + (s - t if bottom_right else 0), np.arange(s)[None, :]
    if is_causal:
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window[0]) & (j <= i + window[1])
    if q_lengths is not None:
        keep &= (np.arange(t)[None, :] < np.asarray(q_lengths)[:, None])[:, None, :, None]
    if kv_lengths is not None:
        keep &= (np.arange(s)[None, :] < np.asarray(kv_lengths)[:, None])[:, None, None, :]
    out = np.zeros((b, n, t, h))
    lse = np.zeros((b, n, t))
    for index in np.ndindex(b, n, t):
        row, visible = scores[index], keep[index]
        if not visible.any():  # nothing visible: a uniform average of the values
            weights = np.full(s, 1.0 / s)
            lse[index] = np.nan  # not part of the contract
        else:
            top = row[visible].max()
            exps = np.where(visible, np.exp(row - top), 0.0)
            weights = exps / exps.sum()
            lse[index] = top + np.log(exps.sum())
        out[index] = weights @ v[index[0], :, index[1], :]
    out = out.transpose(0, 2, 1, 3)
    if q_lengths is not None:
        out *= (np.arange(t)[None, :] < np.asarray(q_lengths)[:, None])[:, :, None, None]
    if kv_lengths is not None:
        out *= (np.asarray(kv_lengths) > 0)[:, None, None, None]
    return out, lse.transpose(0, 2, 1)


@st.composite
def attention_problems(draw):
    b = draw(st.integers(1, 3))
    t, s = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    kh = draw(st.sampled_from([1, 2]))
    n = kh * draw(st.sampled_from([1, 2, 3]))
    h = draw(st.sampled_from([8, 16, 24]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    k = rng.normal(size=(b, s, kh, h)).astype(np.float32)
    hv = draw(st.sampled_from([h, 8, 32]))  # the value head_dim may differ
    v = rng.normal(size=(b, s, kh, hv)).astype(np.float32)
    kwargs = dict(is_causal=draw(st.booleans()))
    if draw(st.booleans()):
        kwargs["causal_alignment"] = "bottom_right"
    if draw(st.booleans()):
        kwargs["query_segment_ids"] = np.sort(rng.integers(0, 3, (b, t)), 1).astype(np.int32)
        kwargs["kv_segment_ids"] = np.sort(rng.integers(0, 3, (b, s)), 1).astype(np.int32)
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.floats(0.05, 1.0))
    if draw(st.booleans()):
        shape = (draw(st.sampled_from([1, b])), draw(st.sampled_from([1, n])),
                 draw(st.sampled_from([1, t])), s)
        kwargs["bias"] = rng.normal(size=shape).astype(np.float32)
    if draw(st.booleans()):
        shape = (draw(st.sampled_from([1, b])), 1, draw(st.sampled_from([1, t])), s)
        kwargs["mask"] = rng.random(shape) > 0.3
    if draw(st.booleans()):
        kwargs["query_seq_lengths"] = rng.integers(0, t + 1, size=b).astype(np.int32)
    if draw(st.booleans()):
        kwargs["key_value_seq_lengths"] = rng.integers(0, s + 1, size=b).astype(np.int32)
    if draw(st.booleans()):
        kwargs["local_window_size"] = (draw(st.integers(0, 6)), draw(st.integers(0, 6)))
    return q, k, v, kwargs


@settings(max_examples=60, deadline=None, derandomize=True)
@given(attention_problems())
def test_reference_path_matches_the_contract(problem):
    q, k, v, kwargs = problem
    arrays = {name: x for name, x in kwargs.items() if isinstance(x, np.ndarray)}
    static = {name: x for name, x in kwargs.items() if name not in arrays}
    with jax.default_matmul_precision("float32"):  # one compile per example, not one per op
        out, lse = jax.jit(lambda q, k, v, arrays: jax_sdpa.dot_product_attention(
            q, k, v, implementation="xla", return_residual=True, residual_dtype=jnp.float32,
            **arrays, **static))(q, k, v, arrays)
    scale = kwargs.get("scale", 1.0 / np.sqrt(q.shape[-1]))
    expected, expected_lse = oracle(
        q, k, v, kwargs.get("bias"), kwargs.get("mask"), scale, kwargs["is_causal"],
        kwargs.get("query_seq_lengths"), kwargs.get("key_value_seq_lengths"),
        kwargs.get("local_window_size"), kwargs.get("causal_alignment") == "bottom_right",
        kwargs.get("query_segment_ids"), kwargs.get("kv_segment_ids"))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-4, atol=2e-5)
    defined = ~np.isnan(expected_lse)
    np.testing.assert_allclose(np.asarray(lse)[defined], expected_lse[defined], rtol=2e-4,
                               atol=2e-4)
