"""The stated packed bound (max_document_length; varlen_attention's max_seqlen_q) compiles and
is right under every gradient pattern a user writes, for row lengths that are no multiple of
8/64/128, one row or several, and documents of one token; a row breaking the statement still
comes back NaN at its first token. Against the float32 reference. Skipped without a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import (assert_close_to_reference, gradient_patterns, random_qkv,
                      reference_gradients)

pytestmark = pytest.mark.gpu


def _ids(rows):
    """int32 [B, T] from each row's document lengths."""
    return jnp.asarray(np.stack([np.repeat(np.arange(len(r), dtype=np.int32), r)
                                 for r in rows]))


@pytest.mark.parametrize("rows", [
    [[700, 1, 1500, 300]],                                   # B = 1, T = 2501
    [[1, 400, 376], [777], [5, 1, 1, 770]],                  # B = 3, T = 777
], ids=["one_row_2501", "three_rows_777"])
def test_stated_bound_under_every_gradient_pattern(rows):
    ids = _ids(rows)
    batch, seq = ids.shape
    q, k, v, d_out = random_qkv(seq, batch, seq, seq, 8, 8, 128, jnp.bfloat16)
    longest = max(max(r) for r in rows)
    documents = max(len(r) for r in rows)

    def attention(implementation, **stated):
        return lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=ids, implementation=implementation,
            **stated)
    ref = reference_gradients(attention("xla"), q, k, v, d_out)
    ours = attention("cudnn", max_document_length=longest, max_segments=documents)
    for name, run in gradient_patterns(ours):
        assert_close_to_reference(run(q, k, v, d_out), ref, context=name)


@pytest.mark.parametrize("seed", [0, 1])
def test_varlen_stated_bound_under_every_gradient_pattern(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 1501, size=int(rng.integers(1, 12)))
    lengths[0] = 1  # a sequence of one token
    total = int(lengths.sum()) + 3  # and three padding tokens past the last sequence
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    q, k, v, d_out = (x[0] for x in random_qkv(seed, 1, total, total, 4, 2, 128,
                                                 jnp.bfloat16))
    d_out = jax.random.normal(jax.random.key(seed), (total, 4, 128)).astype(jnp.bfloat16)

    def attention(implementation, **stated):
        return lambda q, k, v: jax_sdpa.varlen_attention(
            q, k, v, cu, is_causal=True, implementation=implementation, **stated)
    ref = reference_gradients(attention("xla"), q, k, v, d_out)
    ours = attention("cudnn", max_seqlen_q=int(lengths.max()))
    for name, run in gradient_patterns(ours):
        assert_close_to_reference(run(q, k, v, d_out), ref, context=f"{name} {lengths}")


def test_broken_statement_on_one_row_is_nan_under_jit_grad():
    """One row (B = 1) that holds a document longer than stated: its first token's output and
    gradients are NaN in a jitted fwd+bwd, never a silently wrong value."""
    ids = _ids([[700, 1, 1500, 300]])
    q, k, v, d_out = random_qkv(7, 1, 2501, 2501, 8, 8, 128, jnp.bfloat16)

    def f(q, k, v):
        return jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=ids, implementation="cudnn",
            max_document_length=1024, max_segments=4)
    for name, run in gradient_patterns(f):
        out, dq, dk, dv = (np.asarray(x, np.float32) for x in run(q, k, v, d_out))
        for label, x in (("output", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert np.all(np.isnan(x[0, 0])), f"{name}: {label}'s first token is not NaN"
        assert np.isfinite(out[0, 1:700]).all(), f"{name}: the kept document is not finite"
