"""max_document_length (and varlen_attention's max_seqlen_q/_kv): the caller states the packed
documents' bound, and cuDNN's ragged layout runs one plan with no check on the device. Rows that
keep the statement match the reference (values and gradients); rows that break it come back NaN
at their first token, never silently wrong, while the other rows stay right. On a GPU the real
ragged calls run; elsewhere the emulated ones (tests/ragged_emulator.py)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa.limits import device
from conftest import relative_error
from test_packing import (B, CROSS, N, ROWS, S, T, check, emulated_cudnn, qkv,  # noqa: F401
                          random_ids, runs)


@pytest.mark.parametrize("rows,kwargs", [
    ("contiguous", dict(is_causal=True)),
    ("unsorted_ids", dict(local_window_size=(5, 2))),
    ("padding_id_last", dict(is_causal=True, query_seq_lengths=jnp.array([40, 30], jnp.int32),
                             key_value_seq_lengths=jnp.array([40, 0], jnp.int32))),
    ("single_tokens", dict(is_causal=True)),
])
def test_kept_statement_matches_segment_semantics(rows, kwargs, emulated_cudnn):
    ids = jnp.asarray(np.stack(ROWS[rows]))
    longest = max(max(np.unique_counts(row).counts) for row in ROWS[rows])
    documents = max(len(np.unique(row)) for row in ROWS[rows])
    out, lse, lse_ref = check(*qkv(20), query_segment_ids=ids, max_segments=documents,
                              max_document_length=int(longest), **kwargs)
    if "query_seq_lengths" not in kwargs:  # (rows past a length: lse as the unstated path's)
        assert relative_error(lse, lse_ref) < 1e-2


def _bounds(ids):
    """(longest run, most runs in a row) of int ids [rows, tokens]: the tightest statement."""
    longest, documents = 0, 0
    for row in ids:
        starts = np.flatnonzero(np.concatenate([[True], row[1:] != row[:-1]]))
        lengths = np.diff(np.concatenate([starts, [len(row)]]))
        longest, documents = max(longest, int(lengths.max())), max(documents, len(starts))
    return longest, documents


@pytest.mark.parametrize("seed", range(8))
def test_random_kept_statements_match_segment_semantics(seed, emulated_cudnn):
    """Random packed calls whose statement holds, tight or with slack (self or cross ids, full,
    causal or window, lengths, GQA, sinks), against the reference."""
    rng = np.random.default_rng(900 + seed)
    q_ids = np.stack([random_ids(rng, T, reuse=False) for _ in range(B)])
    longest, documents = _bounds(q_ids)
    band = rng.choice(["full", "causal", "window"])
    kwargs = dict(query_segment_ids=jnp.asarray(q_ids), is_causal=bool(band == "causal"))
    if band == "window":
        kwargs["local_window_size"] = (int(rng.integers(0, 10)), int(rng.integers(0, 4)))
    kv_seq, slack = T, int(rng.integers(0, 3))
    bound = min(longest + slack, T)
    if band == "full" and rng.random() < 0.4:  # cross: keys hold the queries' ids, in order
        kv_seq = int(rng.choice([T, S]))
        kv_ids = np.stack([np.sort(rng.choice(np.unique(row), kv_seq)) for row in q_ids])
        kwargs["kv_segment_ids"] = jnp.asarray(kv_ids, jnp.int32)
        longest_kv, documents_kv = _bounds(kv_ids)
        documents = max(documents, documents_kv)
        bound = (bound, min(longest_kv + slack, kv_seq))
    if rng.random() < 0.5:
        kwargs["query_seq_lengths"] = jnp.asarray(rng.integers(1, T + 1, B), jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.asarray(rng.integers(1, kv_seq + 1, B), jnp.int32)
    if rng.random() < 0.3:
        kwargs["sinks"] = jnp.asarray(rng.normal(size=N), jnp.float32)
    check(*qkv(seed, kv_seq=kv_seq, kv_heads=int(rng.choice([1, 2, 4]))),
          max_segments=documents + slack, max_document_length=bound, **kwargs)


def test_kept_statement_with_gqa_and_cross_ids(emulated_cudnn):
    q_ids, kv_ids = (jnp.asarray(np.stack([row, row])) for row in CROSS["aligned"])
    check(*qkv(21, kv_seq=S, kv_heads=1, head_dim_v=16), query_segment_ids=q_ids,
          kv_segment_ids=kv_ids, is_causal=True, max_document_length=(20, 20))


def _broken_rows_case(rows, **kwargs):
    """(ours, reference, ours' gradient dq) for ids whose first row breaks the statement."""
    ids = jnp.asarray(np.stack(rows))
    q, k, v, d_out = qkv(22)

    def attention(q, implementation):
        k_, v_ = (x.astype(q.dtype) for x in (k, v))
        return jax_sdpa.dot_product_attention(q, k_, v_, query_segment_ids=ids,
                                              implementation=implementation, is_causal=True,
                                              **(kwargs if implementation == "cudnn" else {}))
    ours = jax.jit(attention, static_argnums=1)(q, "cudnn")
    ref = jax.jit(attention, static_argnums=1)(q.astype(jnp.float32), "xla")
    dq = jax.jit(jax.grad(lambda q: jnp.vdot(attention(q, "cudnn").astype(jnp.float32),
                                             d_out.astype(jnp.float32))))(q)
    return ours, ref, dq


@pytest.mark.parametrize("break_", ["reused_id", "too_long", "too_many"])
def test_broken_statement_is_nan_never_silently_wrong(break_, emulated_cudnn):
    kept_row = runs((10, 4), (20, 5), (18, 6))
    broken = {"reused_id": ROWS["reused_id"][0],            # one id in two runs
              "too_long": runs((30, 1), (18, 2)),           # a document past the bound
              "too_many": runs((10, 1), (10, 2), (10, 3), (10, 4), (8, 5))}[break_]
    ours, ref, dq = _broken_rows_case([broken, kept_row], max_document_length=20,
                                      max_segments=4)
    assert np.all(np.isnan(np.asarray(ours[0, 0], np.float32)))
    assert np.all(np.isnan(np.asarray(dq[0, 0], np.float32)))
    assert relative_error(ours[1], ref[1]) < 2e-2  # the row that kept it is right
    assert not np.any(np.isnan(np.asarray(ours[1], np.float32)))


def test_varlen_max_seqlen_is_the_statement(emulated_cudnn):
    cu = jnp.array([0, 5, 5, 17, 30], jnp.int32)
    q, k, v = (jax.random.normal(jax.random.key(i), (30, 4, 16)).astype(jnp.bfloat16)
               for i in range(3))

    @functools.partial(jax.jit, static_argnames=("implementation", "max_seqlen_q"))
    def varlen(q, k, v, implementation, max_seqlen_q=None):
        return jax_sdpa.varlen_attention(q, k, v, cu, is_causal=True,
                                         implementation=implementation, max_seqlen_q=max_seqlen_q)
    ref = varlen(q, k, v, "xla")
    kept = varlen(q, k, v, "cudnn", max_seqlen_q=13)
    assert relative_error(kept, ref) < 2e-2
    broken = varlen(q, k, v, "cudnn", max_seqlen_q=12)  # the last sequence holds 13
    assert np.all(np.isnan(np.asarray(broken[0], np.float32)))


def test_stated_bound_lowers_one_plan_and_no_switch(monkeypatch):
    """What the statement buys: the fwd+bwd for CUDA holds one ragged forward and one backward,
    sized by the bound, and no grid for the handler to wait for (nor, with lengths, the
    checked call's conditional, whose predicate the host would wait for too)."""
    monkeypatch.setattr(device, "device_reason", lambda: None)
    q = jnp.zeros((2, 1024, 2, 64), jnp.bfloat16)
    ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 256)[None].repeat(2, 0)

    def lowered(**kwargs):
        grad = jax.grad(lambda q: jax_sdpa.dot_product_attention(
            q, q, q, is_causal=True, query_segment_ids=ids, implementation="cudnn",
            **kwargs).astype(jnp.float32).sum())
        return jax.jit(grad).trace(q).lower(lowering_platforms=("cuda",)).as_text()
    stated = lowered(max_document_length=256, max_segments=4)
    assert "stablehlo.case" not in stated
    assert set(re.findall(r"max_document_length_q = (\d+)", stated)) == {"256"}
    assert len(re.findall(r"@jax_sdpa_\w+\(", stated)) == 2
    assert "device_grid = true" not in stated
    assert "device_grid = true" in lowered()  # unstated: the grid chosen on the device
    lengths = dict(query_seq_lengths=jnp.array([1024, 1000], jnp.int32))
    assert "stablehlo.case" not in lowered(max_document_length=256, max_segments=4, **lengths)
    assert "stablehlo.case" in lowered(**lengths)  # unstated: the checked cond


@pytest.mark.parametrize("value,error", [
    (0, ValueError), ((16, 0), ValueError), ((1, 2, 3), ValueError), (1.5, TypeError),
])
def test_max_document_length_refuses_bad_values(value, error):
    q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    ids = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(error, match="max_document_length"):
        jax_sdpa.dot_product_attention(q, q, q, query_segment_ids=ids, max_document_length=value)


def test_max_document_length_needs_segment_ids():
    q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="max_document_length.*query_segment_ids"):
        jax_sdpa.dot_product_attention(q, q, q, max_document_length=8)
    with pytest.raises(ValueError, match="max_seqlen_kv needs max_seqlen_q"):
        jax_sdpa.varlen_attention(q[0], q[0], q[0], jnp.array([0, 8], jnp.int32),
                                  max_seqlen_kv=8)


def test_stated_bound_under_vmap(emulated_cudnn):
    ids = jnp.asarray(np.stack(ROWS["contiguous"]))
    q, k, v, _ = qkv(23)
    stacked = [jnp.stack([x, -x]) for x in (q, k, v)]
    both_ids = jnp.stack([ids, ids[::-1]])

    def fn(implementation, **kwargs):
        return jax.jit(jax.vmap(lambda q, k, v, ids: jax_sdpa.dot_product_attention(
            q, k, v, query_segment_ids=ids, is_causal=True, implementation=implementation,
            **kwargs).astype(jnp.float32)))
    ours = fn("cudnn", max_document_length=48, max_segments=3)(*stacked, both_ids)
    ref = fn("xla")(*(x.astype(jnp.float32) for x in stacked), both_ids)
    assert relative_error(ours, ref) < 2e-2
    broken = fn("cudnn", max_document_length=20, max_segments=3)(*stacked, both_ids)
    broken = np.asarray(broken, np.float32)
    # The one-document row (48 tokens) breaks it: row 1 of the first slice, row 0 of the second.
    assert np.all(np.isnan(broken[0, 1, 0])) and np.all(np.isnan(broken[1, 0, 0]))
    assert not np.any(np.isnan(broken[0, 0])) and not np.any(np.isnan(broken[1, 1]))
