"""Packed segment ids on cuDNN's ragged layout at training sizes, against the float32 reference.
(tests/test_packing.py runs the small cases on the GPU too.) Skipped without a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import (assert_close_to_reference, directional_derivative_error,
                      gradient_patterns, random_qkv, reference_gradients, relative_error)
from poisoning import poison_outputs

pytestmark = pytest.mark.gpu


def packed_ids(rng, batch, seq_len, low=16, high=None, padding=0):
    """Rows of documents with lengths drawn from [low, high], ids 1.. and `padding` trailing
    tokens with id 0."""
    high = high or seq_len
    rows = []
    for _ in range(batch):
        row, next_id = [], 1
        while len(row) < seq_len - padding:
            length = int(rng.integers(low, high + 1))
            row += [next_id] * length
            next_id += 1
        rows.append(np.array(row[:seq_len - padding] + [0] * padding, np.int32))
    return jnp.asarray(np.stack(rows))


def check(q, k, v, d_out, context, **kwargs):
    def make(implementation, cast):
        return jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
            cast(q), cast(k), cast(v), implementation=implementation, **kwargs))
    out, vjp = jax.vjp(make("cudnn", lambda x: x), q, k, v)
    ours = (out, *vjp(d_out))
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    out_ref, vjp_ref = jax.vjp(make("xla", up), q, k, v)
    assert_close_to_reference(ours, (out_ref, *vjp_ref(up(d_out))), context=context)
    return ours


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["causal", "full", "window", "gqa", "lengths", "padding",
                                  "one_document", "short_documents", "value_head_dim"])
def test_packed_rows_match_reference(case, dtype):
    rng = np.random.default_rng(len(case))
    b, t, n, kh, h = 2, 1024, 8, 8, 64
    if case == "gqa":
        kh = 2
    ids = packed_ids(rng, b, t, low=64, high=400, padding=100 if case == "padding" else 0)
    if case == "one_document":
        ids = jnp.ones((b, t), jnp.int32)
    if case == "short_documents":
        ids = packed_ids(rng, b, t, low=1, high=9)
    q, k, v, d_out = random_qkv(len(case), b, t, t, n, kh, h, dtype)
    if case == "value_head_dim":
        v = jax.random.normal(jax.random.key(1), (b, t, kh, 128)).astype(dtype)
        d_out = jax.random.normal(jax.random.key(2), (b, t, n, 128)).astype(dtype)
    kwargs = dict(query_segment_ids=ids, is_causal=case != "full", max_segments=256)
    if case == "window":
        kwargs["local_window_size"] = (100, 0)
    if case == "lengths":
        kwargs["query_seq_lengths"] = jnp.array([t, 700], jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.array([900, t], jnp.int32)
    check(q, k, v, d_out, case, **kwargs)


def test_every_packed_output_element_is_written():
    """Self-attention packing without lengths covers every token: nothing is zero-filled
    first, so NaN-poisoned outputs prove cuDNN wrote them all."""
    rng = np.random.default_rng(3)
    q, k, v, d_out = random_qkv(31, 2, 512, 512, 4, 4, 64, jnp.bfloat16)
    ids = packed_ids(rng, 2, 512, low=30, high=200)
    with poison_outputs():
        fn = jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=ids, implementation="cudnn",
            return_residual=True))
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        grads = vjp((d_out, jnp.zeros_like(lse)))
    for name, x in zip(("output", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert np.all(np.isfinite(np.asarray(x, np.float32))), f"{name} kept poisoned elements"


def test_every_varlen_element_is_written():
    """varlen (self-attention, one lengths array for both sides): the handler zero-fills only
    the padding past the last sequence, after cuDNN ran; everything before it is cuDNN's."""
    q, k, v, d_out = random_qkv(33, 1, 2501, 2501, 4, 2, 64, jnp.bfloat16)
    flat = [x[0] for x in (q, k, v, d_out)]
    cu = jnp.array([0, 1, 700, 707, 1900, 2390], jnp.int32)  # 111 tokens of padding
    with poison_outputs():
        fn = jax.jit(lambda q, k, v: jax_sdpa.varlen_attention(
            q, k, v, cu, is_causal=True, max_seqlen_q=1193, implementation="cudnn"))
        out, vjp = jax.vjp(fn, *flat[:3])
        grads = vjp(flat[3])
    for name, x in zip(("output", "dq", "dk", "dv"), (out, *grads)):
        x = np.asarray(x, np.float32)
        assert np.all(np.isfinite(x)), f"{name} kept poisoned elements"
        assert not np.any(x[2390:]), f"{name}: padding not zero"

    def reference(q, k, v):
        return jax_sdpa.varlen_attention(q, k, v, cu, is_causal=True, implementation="xla")
    up = [x.astype(jnp.float32) for x in flat]
    ref_out, ref_vjp = jax.vjp(jax.jit(reference), *up[:3])
    assert_close_to_reference((out, *grads), (ref_out, *ref_vjp(up[3])), "varlen")


def test_packed_lse_and_deterministic_backward():
    rng = np.random.default_rng(4)
    q, k, v, d_out = random_qkv(32, 2, 768, 768, 4, 2, 128, jnp.bfloat16)
    ids = packed_ids(rng, 2, 768, low=50, high=300)
    _, lse = jax_sdpa.dot_product_attention(q, k, v, is_causal=True, query_segment_ids=ids,
                                            implementation="cudnn", return_residual=True,
                                            residual_dtype=jnp.float32)
    _, lse_ref = jax_sdpa.dot_product_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True, query_segment_ids=ids,
        implementation="xla", return_residual=True)
    assert relative_error(lse, lse_ref) < 1e-3
    runs = [check(q, k, v, d_out, "deterministic", query_segment_ids=ids, is_causal=True,
                  deterministic=True) for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("rows", ["contiguous", "reused_id"])
def test_packed_dropout_keeps_its_rate_and_its_mask(rows):
    """Dropout on the ragged layout, and (an id reused after a gap) in the exact fallback: the
    same key gives the same bits, outputs average to the undropped one over keys,
    and the backward drops what the forward dropped (its gradient agrees with the output's
    central difference)."""
    rng = np.random.default_rng(5)
    q, k, v, d_out = random_qkv(33, 1, 512, 512, 4, 4, 64, jnp.float16)
    ids = np.array(packed_ids(rng, 1, 512, low=60, high=200))
    if rows == "reused_id":
        ids[0, 300:350] = ids[0, 0]

    def attention(q, k, v, key):
        return jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=jnp.asarray(ids), dropout_rate=0.2,
            dropout_rng=key, implementation="cudnn").astype(jnp.float32)
    fn = jax.jit(lambda key: attention(q, k, v, key))
    a, b = fn(jax.random.key(1)), fn(jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    many = jax.vmap(fn)(jax.random.split(jax.random.key(2), 128))
    plain = jax_sdpa.dot_product_attention(q, k, v, is_causal=True,
                                           query_segment_ids=jnp.asarray(ids),
                                           implementation="cudnn")
    assert relative_error(many.mean(0), plain) < 0.08

    def loss(q, k, v):
        return jnp.vdot(attention(q, k, v, jax.random.key(3)), d_out.astype(jnp.float32))
    assert directional_derivative_error(loss, (q, k, v)) < 0.05


def test_non_contiguous_ids_take_the_exact_path():
    """The same id in two separate runs, and more documents than slots: segment-id semantics
    (checked on the device, computed by the exact fallback)."""
    rng = np.random.default_rng(6)
    q, k, v, d_out = random_qkv(34, 2, 512, 512, 4, 4, 64, jnp.bfloat16)
    ids = np.array(packed_ids(rng, 2, 512, low=40, high=100))
    ids[0, 300:350] = ids[0, 0]  # reuses the first document's id
    check(q, k, v, d_out, "reused id", query_segment_ids=jnp.asarray(ids), is_causal=True)
    check(q, k, v, d_out, "too many documents", query_segment_ids=jnp.asarray(ids),
          is_causal=True, max_segments=2)


def test_vmapped_checked_call_with_one_slice_the_table_cannot_hold():
    """vmap over two stacks of rows, one of contiguous documents and one reusing an id: the
    handler runs the exact fallback for both (one call folds the slices), poisoned."""
    rng = np.random.default_rng(11)
    q, k, v, d_out = (x.reshape(2, 2, *x.shape[1:])
                      for x in random_qkv(39, 4, 300, 300, 4, 2, 64, jnp.bfloat16))
    ids = np.stack([np.array(packed_ids(rng, 2, 300, low=30, high=90)) for _ in range(2)])
    ids[1, :, 200:240] = ids[1, :, :1]  # the second stack reuses each row's first id

    def attention(implementation):
        return jax.vmap(lambda q, k, v, ids: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=ids, implementation=implementation),
            in_axes=(0, 0, 0, 0))
    ids = jnp.asarray(ids)
    ref = reference_gradients(lambda q, k, v: attention("xla")(q, k, v, ids), q, k, v, d_out)
    with poison_outputs():
        out, vjp = jax.vjp(jax.jit(lambda q, k, v: attention("cudnn")(q, k, v, ids)), q, k, v)
        ours = (out, *vjp(d_out))
    assert_close_to_reference(ours, ref, context="vmapped, one slice on the fallback")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["causal", "window_gqa", "key_lengths", "sinks", "large_ids"])
def test_exact_fallback(case, dtype):
    """The exact fallback (jax_sdpa/packed_fallback.py: one dense call, the ids masking inside
    cuDNN), poisoned: every element written, and the reference's values and gradients, rows
    that see no key (cut off by the key lengths: the values' mean, or the sink's) included.
    large_ids: ids 2^24 apart, which a float32 comparison would take for one document."""
    rng = np.random.default_rng(7)
    kv_heads = 2 if case == "window_gqa" else 4
    q, k, v, d_out = random_qkv(36, 2, 520, 520, 4, kv_heads, 64, dtype)
    ids = np.array(packed_ids(rng, 2, 520, low=40, high=100))
    ids[:, 300:350] = ids[:, :1]  # reuses each row's first id: the table cannot hold it
    kwargs = dict(query_segment_ids=jnp.asarray(ids), is_causal=case != "window_gqa")
    if case == "window_gqa":
        kwargs["local_window_size"] = (70, 10)
    if case in ("key_lengths", "sinks"):
        kwargs["query_seq_lengths"] = jnp.array([520, 400], jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.array([200, 450], jnp.int32)
    if case == "sinks":
        kwargs["sinks"] = jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32)
    if case == "large_ids":
        kwargs["query_segment_ids"] = jnp.asarray(ids + (ids % 2) * (1 << 24))
    with poison_outputs():
        ours = check(q, k, v, d_out, case, **kwargs)
    for name, x in zip(("output", "dq", "dk", "dv"), ours):
        assert np.all(np.isfinite(np.asarray(x, np.float32))), f"{name} kept poisoned elements"


@pytest.mark.parametrize("t", [7, 2501])
def test_exact_fallback_at_one_row_under_every_gradient_pattern(t):
    """B = 1, T = 7 or 2501, an id reused after a gap: jit(grad), vjp(jit), grad(jit) and
    checkpoint against the float32 reference."""
    ids = np.array(packed_ids(np.random.default_rng(8), 1, t, low=1, high=max(2, t // 5)))
    ids[0, t // 2:] = ids[0, 0]  # the first document's id again, after a gap
    q, k, v, d_out = random_qkv(37, 1, t, t, 4, 2, 64, jnp.bfloat16)

    def attention(implementation):
        return lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=jnp.asarray(ids),
            implementation=implementation)
    ref = reference_gradients(attention("xla"), q, k, v, d_out)
    for name, run in gradient_patterns(attention("cudnn")):
        assert_close_to_reference(run(q, k, v, d_out), ref, context=f"{name} T={t}")


@pytest.mark.parametrize("t", [7, 2501])
def test_checked_ragged_call_at_one_row_under_every_gradient_pattern(t):
    """B = 1, T = 7 or 2501 (T = S = 1 has no cuDNN backward), contiguous documents (the ragged
    branch the documents fit, its operands the first rows of the most entries'): jit(grad),
    vjp(jit), grad(jit) and checkpoint against the float32 reference."""
    ids = jnp.asarray(packed_ids(np.random.default_rng(9), 1, t, low=1, high=max(2, t // 3)))
    q, k, v, d_out = random_qkv(38, 1, t, t, 4, 2, 64, jnp.bfloat16)

    def attention(implementation):
        return lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=ids, implementation=implementation)
    ref = reference_gradients(attention("xla"), q, k, v, d_out)
    for name, run in gradient_patterns(attention("cudnn")):
        assert_close_to_reference(run(q, k, v, d_out), ref, context=f"{name} T={t}")


def test_one_query_one_key_backward_takes_the_reference():
    """cuDNN's backward refuses T = S = 1: the default call's backward runs the reference (with
    a warning); implementation='cudnn' refuses up front."""
    q, k, v, d_out = random_qkv(35, 8, 1, 1, 4, 4, 64, jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match="T = S = 1"):
        fn = jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(q, k, v))
        out, vjp = jax.vjp(fn, q, k, v)
        grads = vjp(d_out)
    ref_fn = jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, implementation="xla"))
    up = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    out_ref, vjp_ref = jax.vjp(ref_fn, *up[:3])
    assert_close_to_reference((out, *grads), (out_ref, *vjp_ref(up[3])), context="T=S=1")
    with pytest.raises(NotImplementedError, match="T = S = 1"):
        jax_sdpa.dot_product_attention(q, k, v, implementation="cudnn")
