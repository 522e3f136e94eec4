"""fp8=True on the XLA path (jax_sdpa/fp8_reference.py with fp8_scaling.py's scales):
saturating quantization, current and bounded scaling, and attention whose error against float32
is FP8's, measured per config; the options FP8 does not take are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa.reference import fp8_scaling as scaling
from conftest import random_qkv, relative_error


def test_quantize_saturates_and_rounds_to_the_format():
    x = jnp.array([1e4, -1e4, 448.0, 0.3, -7.1, 0.0], jnp.float32).reshape(1, 1, 1, 6)
    q = scaling.quantize(x, jnp.float32(1.0), "e4m3")
    assert q.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(q, np.float32).ravel(),
                                  [448, -448, 448, 0.3125, -7, 0])
    big = scaling.quantize(jnp.full((1, 1, 1, 1), 1e6), jnp.float32(1.0), "e5m2")
    assert float(big.astype(jnp.float32)[0, 0, 0, 0]) == 57344.0


def test_current_scale_maps_each_slices_amax_onto_the_largest_value():
    slices = jnp.array([3.0, 0.5])[:, None, None, None, None]
    x = jax.random.normal(jax.random.key(0), (2, 1, 16, 4, 8)) * slices
    scales = scaling.forward_scales(x, x, x)
    assert scales.q.shape == (2,)  # one per vmapped slice
    np.testing.assert_allclose(scaling.amax(x) * scales.q, 448.0, rtol=1e-6)
    trip = scaling.round_trip(x, scales.q, "e4m3")
    assert relative_error(trip, x) < 0.04  # e4m3: 3 mantissa bits


def _attention(causal, fp8, lengths=None, cast=lambda x: x):
    def fn(q, k, v):
        return jax_sdpa.dot_product_attention(*(cast(x) for x in (q, k, v)), is_causal=causal,
                                              fp8=fp8, implementation="xla",
                                              query_seq_lengths=lengths,
                                              key_value_seq_lengths=lengths)
    return fn


@pytest.mark.parametrize("is_causal", [False, True])
def test_fp8_error_is_fp8s(is_causal):
    """Output and every gradient against float32 attention on the same inputs: within FP8's
    error (measured here: output 5.6-6.4%, gradients 9-10.5% in e5m2) and far above
    bfloat16's (0.2-0.3%), so the roundings do happen."""
    q, k, v, d_out = random_qkv(3, 2, 256, 256, 4, 2, 64, jnp.bfloat16)
    up = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    out_ref, vjp_ref = jax.vjp(jax.jit(_attention(is_causal, False)), *up[:3])
    ref = (out_ref, *vjp_ref(up[3]))
    out, vjp = jax.vjp(jax.jit(_attention(is_causal, True)), q, k, v)
    ours = (out, *vjp(d_out))
    for name, a, b, x in zip(("output", "dq", "dk", "dv"), ours, ref, (q, q, k, v)):
        assert a.dtype == x.dtype and a.shape == b.shape
        error = relative_error(a, b)
        assert 0.02 < error < (0.08 if name == "output" else 0.14), f"{name}: {error:.3f}"


def test_fp8_gradient_bounds_hold():
    """The backward's scales come from bounds: the true gradients never exceed them (else
    quantizing would saturate). dK's and dV's are the loosest, by up to T x g (the query rows
    a key may see) times the looseness of |dO . V| <= |dO| |V| (about 17 here); e5m2's range
    takes that."""
    q, k, v, d_out = random_qkv(4, 1, 128, 128, 4, 2, 64, jnp.float32)
    scale = 0.125

    def loss(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True) * d_out)
    grads = jax.grad(loss, (0, 1, 2))(q, k, v)
    back = scaling.backward_scales(q, k, v, d_out, scale, "e5m2")
    top = scaling.largest("e5m2")
    for name, g, s in zip(("dq", "dk", "dv"), grads, (back.dq, back.dk, back.dv)):
        actual, bound = float(scaling.amax(g)), top / float(s)
        assert actual < bound < actual * 128 * 2 * 64, f"{name}: {actual} vs bound {bound}"


def test_fp8_lengths_zero_the_rows_past_them():
    q, k, v, d_out = random_qkv(5, 2, 64, 64, 2, 2, 32, jnp.bfloat16)
    lengths = jnp.array([17, 64], jnp.int32)
    out, vjp = jax.vjp(jax.jit(_attention(True, True, lengths)), q, k, v)
    dq, dk, dv = vjp(d_out)
    for x in (out, dq, dk, dv):
        assert np.all(np.asarray(x[0, 17:], np.float32) == 0)
        assert np.any(np.asarray(x[0, :17], np.float32) != 0)
    ref = jax.jit(_attention(True, False, lengths, lambda x: x.astype(jnp.float32)))(q, k, v)
    assert relative_error(out, ref) < 0.08


@pytest.mark.parametrize("option", [dict(bias=jnp.zeros((1, 1, 8, 8))),
                                    dict(local_window_size=(2, 0)),
                                    dict(logits_soft_cap=5.0),
                                    dict(is_causal=True, causal_alignment="bottom_right")])
def test_fp8_refuses_what_it_does_not_take_by_name(option):
    q = jnp.ones((1, 4, 2, 16), jnp.bfloat16)
    k = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    name = next(n for n in option if n != "is_causal")
    with pytest.raises(ValueError, match=name):
        jax_sdpa.dot_product_attention(q, k, k, fp8=True, **option)


def test_fp8_refuses_deterministic():
    q = jnp.ones((1, 4, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="deterministic"):
        jax_sdpa.dot_product_attention(q, q, q, fp8=True, deterministic=True)


def test_fp8_must_be_a_bool():
    q = jnp.ones((1, 4, 2, 16), jnp.bfloat16)
    with pytest.raises(TypeError, match="fp8"):
        jax_sdpa.dot_product_attention(q, q, q, fp8="e4m3")


def _framework_call(q8, k8, v8, do8, params, causal, scale):
    from jax_sdpa import fp8  # noqa: PLC0415

    def fn(q8, k8, v8, params):
        return fp8.dot_product_attention(q8, k8, v8, fp8_params=params, scale=scale,
                                         mask_type="CAUSAL" if causal else "NO_MASK")
    (out8, amax_s, amax_o), vjp = jax.vjp(jax.jit(fn), q8, k8, v8, params)
    dq8, dk8, dv8, d_params = vjp((do8, jnp.zeros_like(amax_s), jnp.zeros_like(amax_o)))
    return out8, amax_s, amax_o, (dq8, dk8, dv8), d_params


@pytest.mark.parametrize("is_causal", [False, True])
def test_framework_convention_matches_float32_and_hands_back_the_amaxes(is_causal):
    """jax_sdpa.fp8 in JAX's use_fp8 convention: FP8 in and out, the amaxes as the scale
    parameters' cotangents; dequantized, within FP8's error of float32 (e4m3 throughout:
    output ~5%, gradients ~7%)."""
    from fp8_params import quantized_problem  # noqa: PLC0415

    q, k, v, d_out = random_qkv(8, 2, 128, 128, 4, 2, 64, jnp.bfloat16)
    scale = 0.125
    q8, k8, v8, do8, params, exact = quantized_problem(q, k, v, d_out, causal=is_causal,
                                                       scale=scale)
    out8, amax_s, amax_o, grads8, d_params = _framework_call(q8, k8, v8, do8, params,
                                                             is_causal, scale)
    assert out8.dtype == jnp.float8_e4m3fn and amax_s.shape == (1, 1, 1, 1)
    out = out8.astype(jnp.float32) / params["scale_o"].reshape(())
    assert 0.02 < relative_error(out, exact[0]) < 0.08
    assert float(amax_o.reshape(())) == pytest.approx(float(jnp.max(jnp.abs(exact[0]))),
                                                      rel=0.1)
    largest_weight = float(amax_s.reshape(()))  # causal: the first row's only weight is 1
    assert largest_weight == 1.0 if is_causal else 0 < largest_weight < 1.0
    for name, g8, e in zip(("dQ", "dK", "dV"), grads8, exact[1:]):
        assert g8.dtype == jnp.float8_e4m3fn
        g = g8.astype(jnp.float32) / params[f"scale_{name}"].reshape(())
        assert 0.02 < relative_error(g, e) < 0.12, name
        assert float(d_params[f"amax_{name}"].reshape(())) == pytest.approx(
            float(jnp.max(jnp.abs(e))), rel=0.15), name
    assert float(d_params["amax_dP"].reshape(())) > 0
    assert float(jnp.abs(d_params["scale_o"]).max()) == 0  # only the amaxes get cotangents


def test_framework_convention_takes_the_heads_first_layout():
    """qkv_layout="BNTH" ([B, N, T, H], as JAX's FP8 tests use it): the BTNH call's output
    and gradients, transposed."""
    from fp8_params import quantized_problem  # noqa: PLC0415
    from jax_sdpa import fp8  # noqa: PLC0415

    q, k, v, d_out = random_qkv(9, 2, 16, 16, 4, 2, 32, jnp.bfloat16)
    q8, k8, v8, do8, params, _ = quantized_problem(q, k, v, d_out, causal=True, scale=0.5)
    swap = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731

    def run(layout, *arrays):
        fn = lambda q8, k8, v8: fp8.dot_product_attention(  # noqa: E731
            q8, k8, v8, fp8_params=params, scale=0.5, mask_type="CAUSAL", qkv_layout=layout)
        (out8, amax_s, amax_o), vjp = jax.vjp(jax.jit(fn), *arrays[:3])
        return (out8, amax_s, amax_o, *vjp((arrays[3], jnp.zeros_like(amax_s),
                                            jnp.zeros_like(amax_o))))
    ours = run("BNTH", *(swap(x) for x in (q8, k8, v8, do8)))
    theirs = run("BTNH", q8, k8, v8, do8)
    for name, a, b in zip(("out", "amax_s", "amax_o", "dq", "dk", "dv"), ours, theirs):
        if a.ndim == 4 and a.shape != (1, 1, 1, 1):
            a = swap(a)
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=name)
    with pytest.raises(ValueError, match="qkv_layout"):
        fp8.dot_product_attention(q8, k8, v8, fp8_params=params, qkv_layout="NTBH")


def test_framework_convention_refuses_by_name():
    from jax_sdpa import fp8  # noqa: PLC0415

    q8 = jnp.ones((1, 8, 2, 16), jnp.float8_e4m3fn)
    params = {name: jnp.ones((1, 1, 1, 1)) for name in fp8.FP8_PARAMS}
    with pytest.raises(ValueError, match="bias"):
        fp8.dot_product_attention(q8, q8, q8, bias=jnp.zeros((1, 2, 8, 8)), fp8_params=params)
    with pytest.raises(ValueError, match="score_mod"):  # JAX 0.12's arguments, by position too
        fp8.dot_product_attention(q8, q8, q8, None, None, None, None, None, None, params,
                                  (jnp.ones(2),), score_mod=lambda s, table: s + table[0])
    with pytest.raises(ValueError, match="scale_dV"):
        fp8.dot_product_attention(q8, q8, q8, fp8_params={k: v for k, v in params.items()
                                                           if k != "scale_dV"})
    with pytest.raises(ValueError, match="query must be a float8_e4m3fn"):
        fp8.dot_product_attention(q8.astype(jnp.bfloat16), q8, q8, fp8_params=params)
    with pytest.raises(ValueError, match="q_seqlen"):
        fp8.dot_product_attention(q8, q8, q8, fp8_params=params, mask_type="PADDING")


@pytest.mark.parametrize("kv_seq_len", [1, 7])
def test_a_single_query_is_planned_off_cudnn(kv_seq_len, monkeypatch):
    """cuDNN 9.19 has no FP8 forward engine for one query (T = 1): planning names it (an error
    under implementation="cudnn") instead of letting the graph build fail inside XLA."""
    from jax_sdpa.cudnn import extension  # noqa: PLC0415
    from jax_sdpa.limits import device, fp8 as fp8_limits  # noqa: PLC0415
    monkeypatch.setattr(device, "device_reason", lambda: None)
    monkeypatch.setattr(device, "capability", lambda: (9, 0))
    monkeypatch.setattr(extension, "cudnn_version", lambda: 91900)
    q, k, v, _ = random_qkv(0, 1, 1, kv_seq_len, 2, 2, 128, jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="single query"):
        jax_sdpa.dot_product_attention(q, k, v, fp8=True, implementation="cudnn")
    assert fp8_limits.fp8_reason(128, 128, 2, kv_seq_len) is None


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_the_framework_convention_at_unit_scales_stays_near_half_precision(dtype):
    """JAX's FP8 training test's setting (every scale 1, inputs already representable in e4m3)
    at the size where the reference once rounded a row's normalised weights and put one dq
    element off by 4 from the half-precision attention: within that test's tolerances (output
    atol = rtol = 0.5; dq, dk atol 3, rtol 0.5)."""
    from jax_sdpa import fp8  # noqa: PLC0415

    keys = jax.random.split(jax.random.key(0), 4)
    shape = (2, 128, 8, 128)
    q, k, v, g = (jax.random.normal(key, shape, dtype).astype(jnp.float8_e4m3fn)
                  for key in keys)
    params = {name: jnp.ones((1, 1, 1, 1), jnp.float32) for name in fp8.FP8_PARAMS}

    def ours(q, k, v, params):
        return fp8.dot_product_attention(q, k, v, fp8_params=params, scale=1.0)
    out, vjp = jax.vjp(jax.jit(ours), q, k, v, params)
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    grads = vjp((g, one, one))[:3]

    def half(q, k, v):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v,
                          preferred_element_type=jnp.float32).astype(dtype)
    up = [x.astype(dtype) for x in (q, k, v, g)]
    ref_out, ref_vjp = jax.vjp(jax.jit(half), *up[:3])
    for got, want, atol in zip((out[0], *grads), (ref_out, *ref_vjp(up[3])), (0.5, 3, 3, 0.5)):
        got, want = (np.asarray(x.astype(jnp.float32)) for x in (got, want))
        assert np.all(np.abs(got - want) <= atol + 0.5 * np.abs(want))
