"""Packed segment ids on the cuDNN path: the document table (jax_sdpa/packing/documents.py) and the
packed kernels (jax_sdpa/packing/). On a GPU the real ragged calls run; without one, our
ragged FFI calls are replaced by a pure-JAX stand-in that reads the ragged operands as cuDNN
does (tests/ragged_emulator.py). Every case is checked against the reference path's segment-id
semantics (which test_properties.py checks against a float64 oracle), values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa.packing import grids
from jax_sdpa.reference import empty_rows
from jax_sdpa.packing import documents as packing
from jax_sdpa.limits import device, packed
import ragged_emulator
from conftest import (directional_derivative_error, gradient_patterns, random_qkv,
                      reference_gradients, relative_error)

B, T, N, K, H = 2, 48, 4, 2, 32


def _emulate_cudnn(monkeypatch, every_bound):
    """dot_product_attention(implementation="cudnn"): cuDNN on a GPU, with document length
    bounds down to 4 tokens, so that these short rows exercise the choice among bounds
    (jax_sdpa/packing/grids.py) too; elsewhere the emulated ragged calls, where each bound is one
    more emulation for XLA to compile, so only tests asking for every_bound get them all."""
    if device.device_reason() is None or every_bound:
        monkeypatch.setattr(grids, "SHORTEST_BOUND", 4)
    if device.device_reason() is None:
        return
    monkeypatch.setattr(device, "device_reason", lambda: None)
    ragged_emulator.emulate(monkeypatch)


@pytest.fixture
def emulated_cudnn(monkeypatch):
    _emulate_cudnn(monkeypatch, every_bound=False)


@pytest.fixture
def emulated_cudnn_every_bound(monkeypatch):
    _emulate_cudnn(monkeypatch, every_bound=True)


def runs(*lengths_and_ids):
    """A row of ids from (length, id) pairs."""
    return np.concatenate([np.full(n, i, np.int32) for n, i in lengths_and_ids])


ROWS = {
    "contiguous": [runs((10, 1), (20, 2), (18, 3)), runs((48, 7))],
    "padding_id_last": [runs((15, 1), (25, 2), (8, 0)), runs((30, 1), (18, 0))],
    "unsorted_ids": [runs((12, 9), (12, 3), (24, 5)), runs((1, 4), (1, 2), (46, 8))],
    "single_tokens": [np.arange(48, dtype=np.int32), runs((24, 0), (24, 1))],
    "reused_id": [runs((10, 1), (10, 2), (28, 1)), runs((48, 3))],  # not one run: fallback
}


def qkv(seed, kv_seq=T, kv_heads=K, head_dim_v=H):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, T, N, H)).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, kv_seq, kv_heads, H)).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, kv_seq, kv_heads, head_dim_v)).astype(jnp.bfloat16)
    d_out = jax.random.normal(keys[3], (B, T, N, head_dim_v)).astype(jnp.bfloat16)
    return q, k, v, d_out


def check(q, k, v, d_out, **kwargs):
    """Packed cuDNN (emulated) against the reference on the upcast inputs: output, lse and
    every gradient."""
    def make(implementation, cast):
        def fn(q, k, v):
            out, lse = jax_sdpa.dot_product_attention(
                cast(q), cast(k), cast(v), implementation=implementation, return_residual=True,
                **kwargs)
            return out, lse
        return jax.jit(fn)
    (out, lse), vjp = jax.vjp(make("cudnn", lambda x: x), q, k, v)
    ours = (out, *vjp((d_out, jnp.zeros_like(lse))))
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    (out_ref, lse_ref), vjp_ref = jax.vjp(make("xla", up), q, k, v)
    ref = (out_ref, *vjp_ref((up(d_out), jnp.zeros_like(lse_ref))))
    for name, a, b in zip(("output", "dq", "dk", "dv"), ours, ref):
        assert relative_error(a, b) < 2e-2, f"{name}: {relative_error(a, b):.2e}"
    return out, lse, lse_ref


@pytest.mark.parametrize("rows,mask", [(rows, "causal") for rows in sorted(ROWS)] + [
    ("contiguous", "full"), ("unsorted_ids", "full"), ("padding_id_last", "window"),
    ("single_tokens", "window"), ("reused_id", "window")])
def test_self_packed_matches_segment_semantics(rows, mask, emulated_cudnn_every_bound):
    ids = jnp.asarray(np.stack(ROWS[rows]))
    kwargs = dict(query_segment_ids=ids, is_causal=mask == "causal",
                  local_window_size=(5, 2) if mask == "window" else None)
    out, lse, lse_ref = check(*qkv(len(rows)), **kwargs)
    assert relative_error(lse, lse_ref) < 1e-2


FALLBACK_CASES = {
    "reused_id_causal": dict(rows="reused_id", is_causal=True),
    "reused_id_gqa_full": dict(rows="reused_id", kv_heads=1, head_dim_v=16),
    # Rows whose keys the key lengths cut off: the values' mean; rows past the query lengths
    # and an entry without keys: zeros.
    "cross_window_lengths": dict(
        rows="reused_id", kv_row=runs((10, 1), (10, 2), (20, 3)), local_window_size=(6, 2),
        query_seq_lengths=jnp.array([40, 30], jnp.int32),
        key_value_seq_lengths=jnp.array([12, 0], jnp.int32)),
    # More documents than slots, with sinks: rows cut off by the key lengths are the sink's.
    "too_many_documents_sinks": dict(
        rows="contiguous", max_segments=2, is_causal=True,
        key_value_seq_lengths=jnp.array([8, 48], jnp.int32),
        sinks=jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32)),
}


@pytest.mark.parametrize("case", sorted(FALLBACK_CASES))
def test_fallback_matches_segment_semantics(case, emulated_cudnn):
    """The exact fallback (jax_sdpa/packed_fallback.py: ids the table cannot express, one
    dense call masking them, its empty rows left NaN as cuDNN leaves them): output, lse and
    every gradient are the reference's, rows that see no key included."""
    kwargs = dict(FALLBACK_CASES[case])
    ids = jnp.asarray(np.stack(ROWS[kwargs.pop("rows")]))
    kv_row = kwargs.pop("kv_row", None)
    shape = {name: kwargs.pop(name) for name in ("kv_heads", "head_dim_v") if name in kwargs}
    if kv_row is not None:
        kwargs["kv_segment_ids"] = jnp.asarray(np.stack([kv_row, kv_row[::-1]]))
        shape["kv_seq"] = len(kv_row)
    _, lse, lse_ref = check(*qkv(12, **shape), query_segment_ids=ids, **kwargs)
    assert relative_error(lse, lse_ref) < 1e-2


@pytest.mark.parametrize("t", [1, 7])
def test_fallback_at_one_row_under_every_gradient_pattern(t, emulated_cudnn):
    """B = 1 and T = 1 or 7, ids only the exact fallback computes (T = 7: an id reused after a
    gap; T = 1: keys whose ids do): jit(grad), vjp(jit), grad(jit) and checkpoint all give the
    reference's values and gradients."""
    kv_ids = jnp.asarray([[1, 2, 1, 1, 2, 2, 1]], jnp.int32)
    kwargs = (dict(query_segment_ids=jnp.asarray([[1]], jnp.int32), kv_segment_ids=kv_ids)
              if t == 1 else dict(query_segment_ids=kv_ids, is_causal=True))
    q, k, v, d_out = random_qkv(t, 1, t, 7, N, K, H, jnp.bfloat16)

    def attention(implementation):
        return lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, implementation=implementation, **kwargs)
    ref = reference_gradients(attention("xla"), q, k, v, d_out)
    for name, run in gradient_patterns(attention("cudnn")):
        for label, a, b in zip(("output", "dq", "dk", "dv"), run(q, k, v, d_out), ref):
            assert relative_error(a, b) < 2e-2, f"{name} {label}: {relative_error(a, b):.2e}"


@pytest.mark.parametrize("t", [2, 7])
def test_checked_ragged_call_at_one_row_under_every_gradient_pattern(t, emulated_cudnn):
    """B = 1, T = 2 or 7 (T = S = 1 has no cuDNN backward: planning refuses it), contiguous
    documents (a ragged branch of the checked call, its
    operands the first rows of the most entries'): jit(grad), vjp(jit), grad(jit) and
    checkpoint give the reference's values and gradients."""
    ids = jnp.asarray([[1, 1, 1, 2, 2, 3, 3][:t]], jnp.int32)
    q, k, v, d_out = random_qkv(t, 1, t, t, N, K, H, jnp.bfloat16)

    def attention(implementation):
        return lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=ids, implementation=implementation)
    ref = reference_gradients(attention("xla"), q, k, v, d_out)
    for name, run in gradient_patterns(attention("cudnn")):
        for label, a, b in zip(("output", "dq", "dk", "dv"), run(q, k, v, d_out), ref):
            assert relative_error(a, b) < 2e-2, f"{name} {label}: {relative_error(a, b):.2e}"


def test_fallback_dropout_backward_drops_what_its_forward_dropped(emulated_cudnn):
    """Dropout in the exact fallback: one key gives one output, and the gradient agrees with
    the output's central difference (a backward dropping other weights than its forward's
    gives a gap of ~0.4)."""
    q, k, v, d_out = (x.astype(jnp.float16) for x in qkv(21))
    ids = jnp.asarray(np.stack(ROWS["reused_id"]))

    def loss(q, k, v):
        out = jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=ids, dropout_rate=0.3,
            dropout_rng=jax.random.key(4), implementation="cudnn")
        return jnp.vdot(out.astype(jnp.float32), d_out.astype(jnp.float32))
    assert float(jax.jit(loss)(q, k, v)) == float(jax.jit(loss)(q, k, v))
    assert directional_derivative_error(loss, (q, k, v)) < 0.05


def random_ids(rng, length, reuse):
    """A row of runs of random lengths and ids; with reuse, an id may come back after a gap
    (what only the exact fallback computes)."""
    row, next_id = [], 1
    while len(row) < length:
        same = reuse and next_id > 2 and rng.random() < 0.3
        run_id = int(rng.integers(1, next_id)) if same else next_id
        next_id += not same
        row += [run_id] * int(rng.integers(1, max(2, length // 3) + 1))
    return np.array(row[:length], np.int32)


@pytest.mark.parametrize("seed", range(8))
def test_random_packed_calls_match_segment_semantics(seed, emulated_cudnn):
    """Random packed calls (ids reused or not, self or cross, causal, window, lengths, GQA,
    sinks, few or many slots) against the reference: whatever branch the device picks, the
    segment-id semantics."""
    rng = np.random.default_rng(100 + seed)
    reuse = bool(rng.random() < 0.6)
    q_ids = np.stack([random_ids(rng, T, reuse) for _ in range(B)])
    kwargs = dict(query_segment_ids=jnp.asarray(q_ids),
                  max_segments=int(rng.choice([2, 4, 64])))
    kv_seq = T
    if rng.random() < 0.4:  # cross: keys with ids of their own
        kv_seq = int(rng.choice([T, S]))
        kv_ids = np.stack([random_ids(rng, kv_seq, reuse) for _ in range(B)])
        kwargs["kv_segment_ids"] = jnp.asarray(kv_ids)
    band = rng.choice(["full", "causal", "window"])
    kwargs["is_causal"] = bool(band == "causal")
    if band == "window":
        kwargs["local_window_size"] = (int(rng.integers(0, 10)), int(rng.integers(0, 4)))
    if rng.random() < 0.5:
        kwargs["query_seq_lengths"] = jnp.asarray(rng.integers(0, T + 1, B), jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.asarray(rng.integers(0, kv_seq + 1, B),
                                                      jnp.int32)
    if rng.random() < 0.3:
        kwargs["sinks"] = jnp.asarray(rng.normal(size=N), jnp.float32)
    shape = dict(kv_seq=kv_seq, kv_heads=int(rng.choice([1, 2, 4])))
    check(*qkv(seed, **shape), **kwargs)


def test_document_table_of_runs():
    ids = jnp.asarray(np.stack(ROWS["contiguous"]))
    docs = packing.documents(ids, None, max_segments=4)
    assert bool(docs.ok)
    np.testing.assert_array_equal(docs.q_start, [[0, 10, 30, 48], [0, 48, 48, 48]])
    np.testing.assert_array_equal(docs.q_len, [[10, 20, 18, 0], [48, 0, 0, 0]])
    np.testing.assert_array_equal(docs.kv_len, docs.q_len)


@pytest.mark.parametrize("rows,max_segments,ok", [
    ("contiguous", 3, True), ("contiguous", 2, False), ("reused_id", 8, False),
    ("single_tokens", 48, True), ("single_tokens", 47, False), ("unsorted_ids", 3, True)])
def test_document_table_says_when_it_cannot_hold_the_ids(rows, max_segments, ok):
    docs = packing.documents(jnp.asarray(np.stack(ROWS[rows])), None,
                             max_segments=max_segments)
    assert bool(docs.ok) == ok


@pytest.mark.parametrize("max_segments", [2, 64])
def test_rows_with_more_documents_than_slots_are_exact(max_segments,
                                                     emulated_cudnn_every_bound):
    ids = jnp.asarray(np.stack(ROWS["contiguous"]))
    check(*qkv(3), query_segment_ids=ids, is_causal=True, max_segments=max_segments)


def test_lengths_with_segments_zero_padded_rows(emulated_cudnn):
    ids = jnp.asarray(np.stack(ROWS["padding_id_last"]))
    out, _, _ = check(*qkv(4), query_segment_ids=ids, is_causal=True,
                      query_seq_lengths=jnp.array([40, 30], jnp.int32),
                      key_value_seq_lengths=jnp.array([40, 0], jnp.int32))
    assert not np.any(np.asarray(out[0, 40:], np.float32))
    assert not np.any(np.asarray(out[1], np.float32))  # no keys at all: zeros, as jax.nn's


@pytest.mark.parametrize("mask", ["causal", "full", "window"])
def test_one_lengths_array_for_both_sides_needs_no_row_repair(mask, emulated_cudnn,
                                                              monkeypatch):
    """Self-attention with one lengths array for queries and keys (varlen_attention's case):
    every row within its length sees its own key, so the packed path repairs no row (the
    repair would cost passes over the output and value gradients) and stays exact."""
    def no_repair(*args, **kwargs):
        raise AssertionError("a row repair ran")
    monkeypatch.setattr(empty_rows, "packed_rows", no_repair)
    lengths = jnp.array([37, 22], jnp.int32)
    ids = jnp.asarray(np.stack(ROWS["padding_id_last"]))
    out, _, _ = check(*qkv(11), query_segment_ids=ids, query_seq_lengths=lengths,
                      key_value_seq_lengths=lengths, is_causal=mask == "causal",
                      local_window_size=(4, 1) if mask == "window" else None)
    assert not np.any(np.asarray(out[0, 37:], np.float32))
    assert not np.any(np.asarray(out[1, 22:], np.float32))


def test_kv_lengths_cutting_a_document_leave_uniform_rows(emulated_cudnn):
    """Documents whose keys are all past the key length see nothing: the mean of all values."""
    ids = jnp.asarray(np.stack(ROWS["contiguous"]))
    check(*qkv(5), query_segment_ids=ids, key_value_seq_lengths=jnp.array([8, 48], jnp.int32))
    check(*qkv(6), query_segment_ids=ids, local_window_size=(3, 0),
          query_seq_lengths=jnp.array([48, 20], jnp.int32),
          key_value_seq_lengths=jnp.array([12, 10], jnp.int32))


S = 40
CROSS = {
    "aligned": (runs((10, 1), (20, 2), (18, 3)), runs((10, 1), (20, 2), (10, 3))),
    "id_missing_in_keys": (runs((10, 1), (20, 2), (18, 3)), runs((10, 1), (30, 3))),
    "misaligned": (runs((10, 1), (20, 2), (18, 3)), runs((5, 1), (20, 2), (15, 3))),
    "keys_out_of_order": (runs((24, 1), (24, 2)), runs((20, 2), (20, 1))),
}


@pytest.mark.parametrize("case", sorted(CROSS))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_cross_segments(case, is_causal, emulated_cudnn):
    q_row, kv_row = CROSS[case]
    q_ids = jnp.asarray(np.stack([q_row, q_row[::-1]]))
    kv_ids = jnp.asarray(np.stack([kv_row, kv_row[::-1]]))
    check(*qkv(7, kv_seq=S), query_segment_ids=q_ids, kv_segment_ids=kv_ids,
          is_causal=is_causal)


@pytest.mark.parametrize("kv_heads,head_dim_v", [(1, 32), (4, 64)], ids=["mqa", "hv64"])
def test_gqa_and_value_head_dim(kv_heads, head_dim_v, emulated_cudnn):
    ids = jnp.asarray(np.stack(ROWS["unsorted_ids"]))
    check(*qkv(8, kv_heads=kv_heads, head_dim_v=head_dim_v), query_segment_ids=ids,
          is_causal=True)


@pytest.mark.parametrize("second", ["contiguous", "reused_id"])
def test_vmap_folds_into_one_packed_call(second, emulated_cudnn):
    """Two stacks of rows in one call; with one the table cannot hold, both run the fallback."""
    ids = jnp.asarray(np.stack(ROWS["contiguous"]))
    q, k, v, _ = qkv(9)
    stacked = [jnp.stack([x, -x]) for x in (q, k, v)]
    both_ids = jnp.stack([ids, jnp.asarray(np.stack(ROWS[second]))[::-1]])

    def fn(implementation):
        return jax.jit(jax.vmap(lambda q, k, v, ids: jax_sdpa.dot_product_attention(
            q, k, v, query_segment_ids=ids, is_causal=True,
            implementation=implementation).astype(jnp.float32)))
    ours = fn("cudnn")(*stacked, both_ids)
    ref = fn("xla")(*(x.astype(jnp.float32) for x in stacked), both_ids)
    assert relative_error(ours, ref) < 2e-2
    text = jax.jit(jax.vmap(lambda q, k, v, ids: jax_sdpa.dot_product_attention(
        q, k, v, query_segment_ids=ids, implementation="cudnn"))).lower(
        *stacked, both_ids).as_text()
    # the handler chooses between grid and fallback: no cond, no select of two calls
    assert text.count("stablehlo.case") + text.count("mhlo.case") == 0


def test_packed_lowering_has_no_score_sized_array(monkeypatch):
    """No [T, S] intermediate anywhere in the packed fwd+bwd for CUDA: the ragged branch works
    per token, the exact fallback masks the ids inside cuDNN. And no matmul of ours: every
    branch is cuDNN (a reference's matmuls would cost XLA's autotuning in every checked
    call's compile)."""
    monkeypatch.setattr(device, "device_reason", lambda: None)
    t = 8192
    q = jnp.zeros((1, t, 4, 64), jnp.bfloat16)
    ids = jnp.zeros((1, t), jnp.int32)
    grad = jax.grad(lambda q: jax_sdpa.dot_product_attention(
        q, q, q, is_causal=True, query_segment_ids=ids,
        implementation="cudnn").astype(jnp.float32).sum())
    text = jax.jit(grad).trace(q).lower(lowering_platforms=("cuda",)).as_text()
    assert f"x{t}x{t}x" not in text and f"{t}x{t}xi1" not in text
    assert "dot_general" not in text


@pytest.mark.parametrize("case", ["self_causal", "cross_window_lengths"])
def test_blockwise_fallback_is_the_reference(case):
    """The blockwise reference (a packed call's backward where cuDNN has none), block by block
    (a block that does not divide T), against the whole reference: values and gradients."""
    from jax_sdpa.reference import kernel as reference_kernel  # noqa: PLC0415
    from jax_sdpa.call.spec import CallSpec  # noqa: PLC0415
    q, k, v, d_out = (x.astype(jnp.float32) for x in qkv(10, kv_seq=S))
    q_ids = jnp.asarray(np.stack(ROWS["reused_id"]))
    inputs = dict(query=q, key=k[:, :T] if case == "self_causal" else k,
                  value=v[:, :T] if case == "self_causal" else v, q_segment_ids=q_ids)
    if case == "self_causal":
        inputs = dict(inputs, key=q[:, :, :K], value=q[:, :, :K])
        config = CallSpec(0.2, window_right=0, segments="self", max_segments=4)
    else:
        kv_row = runs((10, 1), (10, 2), (20, 3))
        inputs["kv_segment_ids"] = jnp.asarray(np.stack([kv_row, kv_row]))
        inputs["q_lengths"] = jnp.array([40, 30], jnp.int32)
        inputs["kv_lengths"] = jnp.array([35, 40], jnp.int32)
        config = CallSpec(0.2, window_left=6, window_right=2, has_lengths=True,
                              segments="cross", max_segments=4)
    whole = lambda q: reference_kernel.forward(config, dict(inputs, query=q))  # noqa: E731
    blocks = lambda q: reference_kernel.blockwise_forward(  # noqa: E731
        config, dict(inputs, query=q), block=7)
    (out_a, lse_a), vjp_a = jax.vjp(whole, q)
    (out_b, lse_b), vjp_b = jax.vjp(blocks, q)
    assert relative_error(out_b, out_a) < 1e-5 and relative_error(lse_b, lse_a) < 1e-5
    cot = (d_out, jnp.zeros_like(lse_a))
    assert relative_error(vjp_b(cot)[0], vjp_a(cot)[0]) < 1e-5


@pytest.mark.parametrize("version", [90800, 90900])
def test_checked_packed_calls_need_the_segment_mask_cudnn(version, monkeypatch):
    """The checked call's exact fallback masks ids inside cuDNN (9.9 and newer): with an older
    cuDNN a checked call takes the dense bias, naming the version; a stated bound (no
    fallback) keeps the ragged layout either way."""
    from jax_sdpa.cudnn import extension as _extension  # noqa: PLC0415
    from jax_sdpa.call.validation import validate  # noqa: PLC0415
    monkeypatch.setattr(device, "device_reason", lambda: None)
    monkeypatch.setattr(device, "capability", lambda: (9, 0))
    monkeypatch.setattr(_extension, "cudnn_version", lambda: version)
    q = jnp.zeros((2, 64, 2, 16), jnp.bfloat16)
    ids = jnp.asarray(np.repeat(np.arange(4), 16)[None].repeat(2, 0), jnp.int32)
    options = dict(scale=None, is_causal=True, query_seq_lengths=None,
                   key_value_seq_lengths=None, local_window_size=None, implementation="cudnn",
                   query_segment_ids=ids)
    checked = packed.ragged_reason(validate(q, q, q, None, None, **options))
    stated = packed.ragged_reason(validate(q, q, q, None, None, max_document_length=16,
                                             max_segments=4, **options))
    assert stated is None
    if version < packed.MIN_SEGMENT_MASK_CUDNN_VERSION:
        assert "9.9" in checked and str(version) in checked
    else:
        assert checked is None
