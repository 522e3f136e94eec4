"""fp8=True on cuDNN (sdpa_fp8 / sdpa_fp8_backward) against the FP8 reference (the XLA path's
same roundings) and against float32: output and every gradient, relative error norms printed
per config. Outputs are NaN-poisoned first, so every element must be written. Skipped without
a GPU."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import calls_to, gradient_patterns, random_qkv, relative_error
from poisoning import poison_outputs

pytestmark = pytest.mark.gpu

# Errors against float32 measured on an H200 (cuDNN 9.19, random normal inputs): output
# 5.5-6%, gradients 9-11% (e5m2 has two mantissa bits). The bounds leave a little room.
OUTPUT_BOUND = 0.08
GRADIENT_BOUND = 0.14
# cuDNN against the FP8 reference's own error: within this factor of it.
AGAINST_REFERENCE = 1.5

CONFIGS = {  # name: (batch, T, S, N, K, head_dim, causal, lengths)
    "full": (2, 512, 512, 4, 4, 128, False, None),
    "causal": (2, 512, 512, 4, 4, 128, True, None),
    "gqa-causal": (1, 384, 384, 8, 2, 128, True, None),
    "mqa-cross": (2, 256, 640, 4, 1, 128, False, None),
    "lengths-causal": (3, 257, 257, 4, 4, 128, True, (1, 200, 257)),
    "one-1": (1, 1, 1, 2, 2, 128, False, None),  # the FP8 reference: cuDNN has no engine
    "decode-1-300": (2, 1, 300, 4, 2, 128, False, None),  # for T = 1
    "odd-7": (1, 7, 7, 2, 2, 128, True, None),
    "short-64": (2, 64, 64, 2, 2, 128, True, None),
    "short-65-cross": (1, 65, 100, 2, 1, 128, False, None),
    "odd-2501": (1, 2501, 2501, 2, 2, 128, True, None),
}


def _attention(implementation, causal, lengths, cast=lambda x: x, fp8=True):
    def fn(q, k, v):
        return jax_sdpa.dot_product_attention(
            *(cast(x) for x in (q, k, v)), is_causal=causal, fp8=fp8,
            implementation=implementation, query_seq_lengths=lengths,
            key_value_seq_lengths=lengths)
    return fn


def _value_and_grads(fn, args, d_out):
    out, vjp = jax.vjp(jax.jit(fn), *args)
    return (out, *vjp(d_out))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.filterwarnings("ignore:jax_sdpa. the backward of this call")
@pytest.mark.filterwarnings("ignore:jax_sdpa. using the XLA reference path")
def test_fp8_matches_its_reference_and_float32(name):
    batch, t, s, n, kh, h, causal, lengths = CONFIGS[name]
    q, k, v, d_out = random_qkv(len(name), batch, t, s, n, kh, h, jnp.bfloat16)
    lengths = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    # Below 64 queries (and with GQA) the backward is cuDNN's half-precision one after the FP8
    # forward; T = 1 has no FP8 forward engine: None lets those take the FP8 reference.
    implementation = "cudnn" if min(t, s) >= 64 else None
    with poison_outputs():
        ours = _value_and_grads(_attention(implementation, causal, lengths), (q, k, v), d_out)
    fp8_ref = _value_and_grads(_attention("xla", causal, lengths), (q, k, v), d_out)
    exact = _value_and_grads(
        _attention("xla", causal, lengths, lambda x: x.astype(jnp.float32), fp8=False),
        (q, k, v), d_out.astype(jnp.float32))
    report = []
    for part, a, r, e in zip(("output", "dq", "dk", "dv"), ours, fp8_ref, exact):
        assert a.dtype == r.dtype == jnp.bfloat16 and a.shape == r.shape
        assert np.all(np.isfinite(np.asarray(a, np.float32))), f"{name} {part}: not finite"
        ours_error, ref_error = relative_error(a, e), relative_error(r, e)
        report.append(f"{part} {ours_error:.4f} (reference {ref_error:.4f})")
        bound = OUTPUT_BOUND if part == "output" else GRADIENT_BOUND
        assert ours_error < bound, f"{name} {part}: {ours_error:.4f} against float32"
        assert ours_error < AGAINST_REFERENCE * ref_error + 1e-3, (
            f"{name} {part}: {ours_error:.4f}, the FP8 reference's {ref_error:.4f}")
        assert ref_error > 0.01, f"{name} {part}: the reference did not round ({ref_error})"
    print(f"fp8 {name}: " + ", ".join(report))
    if lengths is not None:  # rows past the lengths stay zero, gradients too
        for x in ours:
            rows = np.arange(x.shape[1])[None, :] >= np.asarray(lengths)[:, None]
            assert np.all(np.asarray(x, np.float32)[rows] == 0)


def test_fp8_is_in_the_compiled_program_and_every_gradient_pattern_agrees():
    q, k, v, d_out = random_qkv(5, 2, 256, 256, 4, 4, 128, jnp.bfloat16)
    fn = _attention("cudnn", True, None)
    text = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * d_out), (0, 1, 2))).lower(
        q, k, v).as_text()
    assert calls_to(text, "forward") and calls_to(text, "backward")
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * d_out)  # noqa: E731
    patterns = {
        "jit(grad)": jax.jit(jax.grad(loss, (0, 1, 2))),
        "grad(jit)": jax.grad(jax.jit(loss), (0, 1, 2)),
        "vjp(jit)": lambda q, k, v: jax.vjp(jax.jit(fn), q, k, v)[1](d_out),
        "checkpoint": jax.jit(jax.grad(jax.checkpoint(loss), (0, 1, 2))),
    }
    results = {name: f(q, k, v) for name, f in patterns.items()}
    first = results["jit(grad)"]
    for name, grads in results.items():
        for a, b in zip(grads, first):
            # Each program computes its scales and roundings in its own fusions: an element on
            # a rounding boundary may land on either side (measured: 2.5e-3 for grad(jit)).
            assert relative_error(a, b) < 1e-2, name


def test_fp8_under_vmap_scales_each_slice():
    q, k, v, _ = random_qkv(6, 2, 128, 128, 2, 2, 128, jnp.bfloat16)
    stacked = [jnp.stack([x, 4 * x]) for x in (q, k, v)]  # slices with different amaxes
    fn = _attention("cudnn", True, None)
    batched = jax.jit(jax.vmap(fn))(*stacked)
    for i in range(2):
        alone = jax.jit(fn)(*(x[i] for x in stacked))
        assert relative_error(batched[i], alone) < 1e-6


def test_fp8_head_dim_64_backward_on_hopper_is_cudnns_half_precision_one():
    """Hopper's FP8 backward takes head_dim 128 only: at 64 the FP8 forward's backward is
    cuDNN's bfloat16 one from its output and statistics (limits/fp8.HALF_BACKWARD_ON_CUDNN),
    with no warning, and implementation="cudnn" runs it."""
    major = int(str(jax.devices()[0].compute_capability).split(".")[0])
    if major != 9:
        pytest.skip("Hopper's head_dim limit")
    q, k, v, d_out = random_qkv(7, 1, 128, 128, 2, 2, 64, jnp.bfloat16)
    fn = _attention("cudnn", True, None)
    text = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * d_out),
                            (0, 1, 2))).lower(q, k, v).as_text()
    assert calls_to(text, "forward", "fp8") and calls_to(text, "backward", "dense")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ours = _value_and_grads(fn, (q, k, v), d_out)
    exact = _value_and_grads(
        _attention("xla", True, None, lambda x: x.astype(jnp.float32), fp8=False), (q, k, v),
        d_out.astype(jnp.float32))
    for part, a, e in zip(("output", "dq", "dk", "dv"), ours, exact):
        error = relative_error(a, e)
        assert error < (OUTPUT_BOUND if part == "output" else GRADIENT_BOUND), part


@pytest.mark.parametrize("causal", [False, True])
def test_framework_convention_on_cudnn_matches_its_reference(causal):
    """jax_sdpa.fp8 (FP8 in and out, the caller's scales) on cuDNN against the same call on
    the XLA path and against float32, and the amaxes handed back as cotangents."""
    from fp8_params import quantized_problem  # noqa: PLC0415
    from jax_sdpa import fp8  # noqa: PLC0415

    q, k, v, d_out = random_qkv(9, 2, 512, 512, 8, 2, 128, jnp.bfloat16)
    scale = 128 ** -0.5
    q8, k8, v8, do8, params, exact = quantized_problem(q, k, v, d_out, causal=causal,
                                                       scale=scale)
    mask_type = "CAUSAL" if causal else "NO_MASK"

    def run(implementation):
        def fn(q8, k8, v8, params):
            return fp8.dot_product_attention(q8, k8, v8, fp8_params=params, scale=scale,
                                             mask_type=mask_type)
        if implementation == "xla":
            import unittest.mock  # noqa: PLC0415
            with unittest.mock.patch.object(fp8, "_implementation", lambda q, v: "xla"):
                (out8, amax_s, amax_o), vjp = jax.vjp(jax.jit(fn), q8, k8, v8, params)
                grads = vjp((do8, jnp.zeros_like(amax_s), jnp.zeros_like(amax_o)))
        else:
            (out8, amax_s, amax_o), vjp = jax.vjp(jax.jit(fn), q8, k8, v8, params)
            grads = vjp((do8, jnp.zeros_like(amax_s), jnp.zeros_like(amax_o)))
        scales = [params[n].reshape(()) for n in ("scale_o", "scale_dQ", "scale_dK",
                                                  "scale_dV")]
        values = [x.astype(jnp.float32) / s for x, s in zip((out8, *grads[:3]), scales)]
        return values, (amax_s, amax_o), grads[3]
    with poison_outputs():
        ours, ours_amax, ours_params = run("cudnn")
    ref, ref_amax, ref_params = run("xla")
    for part, a, r, e in zip(("output", "dq", "dk", "dv"), ours, ref, exact):
        ours_error, ref_error = relative_error(a, e), relative_error(r, e)
        print(f"fp8 framework {part}: {ours_error:.4f} (reference {ref_error:.4f})")
        assert ours_error < AGAINST_REFERENCE * ref_error + 1e-3, part
        assert ours_error < (OUTPUT_BOUND if part == "output" else GRADIENT_BOUND), part
    for a, b in zip(ours_amax, ref_amax):
        assert float(a.reshape(())) == pytest.approx(float(b.reshape(())), rel=0.05)
    for name in fp8.AMAXES:
        assert float(ours_params[name].reshape(())) == pytest.approx(
            float(ref_params[name].reshape(())), rel=0.1), name


HALF_BACKWARD_CONFIGS = {  # name: (batch, T, S, N, K, head_dim, causal, lengths)
    "gqa-causal": (1, 384, 384, 8, 2, 128, True, None),
    "gqa-lengths": (3, 257, 257, 8, 2, 128, True, (1, 200, 257)),
    "head_dim-64": (2, 256, 256, 4, 4, 64, True, None),  # no FP8 backward on Hopper
    "short-odd-7": (1, 7, 7, 2, 2, 128, True, None),  # the FP8 backward is wrong below 64
    "gqa-odd-2501": (1, 2501, 2501, 4, 2, 128, True, None),
}


@pytest.mark.parametrize("name", list(HALF_BACKWARD_CONFIGS))
def test_half_backward_after_the_fp8_forward(name, monkeypatch):
    """The FP8 forward with cuDNN's half-precision backward from its output and stats
    (limits/fp8.half_backward_reason): gradients within FP8's bounds of float32, no warning,
    every element written, our dense backward target in the program."""
    monkeypatch.setattr(jax_sdpa.limits.fp8, "HALF_BACKWARD_ON_CUDNN", True)
    batch, t, s, n, kh, h, causal, lengths = HALF_BACKWARD_CONFIGS[name]
    q, k, v, d_out = random_qkv(len(name) + 40, batch, t, s, n, kh, h, jnp.bfloat16)
    lengths = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    fn = _attention("cudnn", causal, lengths)
    text = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * d_out),
                            (0, 1, 2))).lower(q, k, v).as_text()
    assert calls_to(text, "forward", "fp8") and calls_to(text, "backward", "dense")
    with poison_outputs():
        ours = _value_and_grads(fn, (q, k, v), d_out)
    exact = _value_and_grads(
        _attention("xla", causal, lengths, lambda x: x.astype(jnp.float32), fp8=False),
        (q, k, v), d_out.astype(jnp.float32))
    report = []
    for part, a, e in zip(("output", "dq", "dk", "dv"), ours, exact):
        assert np.all(np.isfinite(np.asarray(a, np.float32))), f"{name} {part}: not finite"
        error = relative_error(a, e)
        report.append(f"{part} {error:.4f}")
        assert error < (OUTPUT_BOUND if part == "output" else GRADIENT_BOUND), (
            f"{name} {part}: {error:.4f} against float32")
    print(f"fp8 half backward {name}: " + ", ".join(report))
    if lengths is not None:  # rows past the lengths stay zero, gradients too
        for x in ours:
            rows = np.arange(x.shape[1])[None, :] >= np.asarray(lengths)[:, None]
            assert np.all(np.asarray(x, np.float32)[rows] == 0)


def test_half_backward_under_every_gradient_pattern(monkeypatch):
    monkeypatch.setattr(jax_sdpa.limits.fp8, "HALF_BACKWARD_ON_CUDNN", True)
    q, k, v, d_out = random_qkv(11, 2, 256, 256, 4, 2, 128, jnp.bfloat16)
    results = dict((name, pattern(q, k, v, d_out)) for name, pattern in
                   gradient_patterns(_attention("cudnn", True, None)))
    first = results["jit(grad)"]
    for name, values in results.items():
        for a, b in zip(values, first):
            # each program quantizes in its own fusions (see the FP8 backward's pattern test)
            assert relative_error(a, b) < 1e-2, name
