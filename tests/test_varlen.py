"""varlen_attention ([total_tokens, N, H] with cumulative lengths) against the same sequences
attended one by one: values and gradients, self and cross, padding past the last sequence,
empty sequences; on the cuDNN path (emulated ragged calls without a GPU) and the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import relative_error
from test_packing import emulated_cudnn  # noqa: F401 - the fixture

N, K, H = 4, 2, 16


def tokens(seed, total, heads, dtype):
    return jax.random.normal(jax.random.key(seed), (total, heads, H)).astype(dtype)


def one_by_one(q, k, v, cu_q, cu_kv, **kwargs):
    """Each sequence alone through dot_product_attention; rows past the last sequence 0."""
    out = jnp.zeros(q.shape[:2] + v.shape[2:], jnp.float32)
    for i in range(len(cu_q) - 1):
        (a, b), (c, d) = cu_q[i:i + 2], cu_kv[i:i + 2]
        if b == a:
            continue
        if d == c:  # no keys: the reference's zero rows (as key lengths of 0)
            continue
        piece = jax_sdpa.dot_product_attention(
            q[a:b][None].astype(jnp.float32), k[c:d][None].astype(jnp.float32),
            v[c:d][None].astype(jnp.float32), implementation="xla", **kwargs)[0]
        out = out.at[a:b].set(piece)
    return out


CASES = {
    "self_causal": (np.array([0, 5, 5, 17, 30], np.int32), None, dict(is_causal=True)),
    "self_window_padding": (np.array([0, 9, 21, 26], np.int32), None,
                            dict(local_window_size=(3, 0))),
    "cross": (np.array([0, 7, 16, 30], np.int32), np.array([0, 12, 13, 24], np.int32), {}),
}


@pytest.mark.parametrize("path", ["cudnn-emulated", "xla"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_varlen_matches_sequences_one_by_one(name, path, emulated_cudnn):  # noqa: F811
    cu_q, cu_kv, kwargs = CASES[name]
    total_q, total_kv = 32, 32 if cu_kv is None else 28
    q = tokens(1, total_q, N, jnp.bfloat16)
    k, v = tokens(2, total_kv, K, jnp.bfloat16), tokens(3, total_kv, K, jnp.bfloat16)
    d_out = tokens(4, total_q, N, jnp.float32)
    implementation = "cudnn" if path == "cudnn-emulated" else "xla"

    def ours(q, k, v):
        return jax_sdpa.varlen_attention(q, k, v, jnp.asarray(cu_q),
                                         None if cu_kv is None else jnp.asarray(cu_kv),
                                         implementation=implementation, **kwargs)

    def expected(q, k, v):
        return one_by_one(q, k, v, cu_q, cu_q if cu_kv is None else cu_kv, **kwargs)
    out, vjp = jax.vjp(jax.jit(ours), q, k, v)
    out_ref, vjp_ref = jax.vjp(jax.jit(expected), q, k, v)
    assert out.shape == (total_q, N, H) and out.dtype == jnp.bfloat16
    assert relative_error(out, out_ref) < 1e-2
    assert np.all(np.asarray(out, np.float32)[cu_q[-1]:] == 0)  # padding rows
    for a, b in zip(vjp(d_out.astype(jnp.bfloat16)), vjp_ref(d_out)):
        assert relative_error(a, b) < 2e-2


def test_varlen_refuses_bad_arguments():
    q = tokens(1, 8, N, jnp.bfloat16)
    k = tokens(2, 8, K, jnp.bfloat16)
    cu = jnp.array([0, 3, 8], jnp.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        jax_sdpa.varlen_attention(q, k, k, cu.astype(jnp.float32))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        jax_sdpa.varlen_attention(q, k, k, cu[None])
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        jax_sdpa.varlen_attention(q, k[:6], k[:6], cu)
    with pytest.raises(NotImplementedError, match="self-attention"):
        jax_sdpa.varlen_attention(q, k, k, cu, cu, is_causal=True)
    with pytest.raises(ValueError, match=r"\[total_q, N, H\]"):
        jax_sdpa.varlen_attention(q[None], k, k, cu)


@pytest.mark.gpu
def test_varlen_on_cudnn_runs_our_ragged_targets():
    """On a GPU: our ragged FFI calls run (compiled program), against one-by-one attention."""
    from conftest import target  # noqa: PLC0415

    cu = np.array([0, 300, 301, 1100, 2000], np.int32)
    q, k, v = (tokens(s, 2048, n, jnp.bfloat16) for s, n in ((1, 8), (2, 2), (3, 2)))
    d_out = tokens(4, 2048, 8, jnp.bfloat16)

    def ours(q, k, v):
        return jax_sdpa.varlen_attention(q, k, v, jnp.asarray(cu), is_causal=True,
                                         implementation="cudnn")
    text = jax.jit(jax.grad(lambda q: ours(q, k, v).astype(jnp.float32).sum())).lower(
        q).compile().as_text()
    assert target("forward") in text and target("backward") in text
    out, vjp = jax.vjp(jax.jit(ours), q, k, v)
    out_ref, vjp_ref = jax.vjp(lambda q, k, v: one_by_one(q, k, v, cu, cu, is_causal=True),
                               q, k, v)
    assert relative_error(out, out_ref) < 1e-2
    for a, b in zip(vjp(d_out), vjp_ref(d_out.astype(jnp.float32))):
        assert relative_error(a, b) < 2e-2
