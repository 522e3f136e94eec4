"""GPU differential suite: random shapes and options, cuDNN against the float32 reference path,
outputs and all gradients. Skipped without a GPU.

Case i draws its problem from numpy's generator seeded with i, so a failure is reproduced by
its id alone (`-k "case[17]"`), keeps as a regression test by adding its number to
REGRESSIONS, and the cases spread over pytest-xdist workers (`-n 8`: compiling dominates).
JAX_SDPA_GPU_CASES sets the number of cases (default 300)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa.call import planning
from jax_sdpa.call.validation import validate
from conftest import assert_close_to_reference

pytestmark = pytest.mark.gpu
CASES = int(os.environ.get("JAX_SDPA_GPU_CASES", "300"))
# Case numbers that once failed, run whatever JAX_SDPA_GPU_CASES says: rows that see no key
# because of key lengths with a mask, segment ids or a window (cuDNN leaves them to the kernel;
# the fused path makes them uniform as in the reference path).
REGRESSIONS = [0, 2, 17, 118, 122, 125, 134, 181, 240, 266, 268]


def draw_problem(rng):
    """One random call: shapes (T, S from 1 to 4096, not only multiples of 64), MHA/GQA/MQA,
    head dims up to 256 (value dim sometimes different), dtypes, and any mix of the options."""
    b = int(rng.integers(1, 4))
    lengths = [1, 7, 64, 100, 129, 256, 333, 512, 1000, 2048, 4096]
    t, s = (int(rng.choice(lengths)) for _ in range(2))
    if t * s > 2048 * 1024:  # keep the reference's [B, N, T, S] float32 scores small
        b = 1
    kh = int(rng.choice([1, 2, 4]))
    n = kh * int(rng.choice([1, 2, 3]))
    h = int(rng.choice([32, 40, 64, 72, 96, 128, 192, 256]))
    hv = h if rng.random() < 0.7 else int(rng.choice([64, 128]))
    dtype = rng.choice([jnp.float16, jnp.bfloat16])
    q, k, v, d_out = (rng.normal(size=shape).astype(np.float32) for shape in
                      [(b, t, n, h), (b, s, kh, h), (b, s, kh, hv), (b, t, n, hv)])
    kwargs = dict(is_causal=bool(rng.random() < 0.5))
    if rng.random() < 0.3:
        kwargs["causal_alignment"] = "bottom_right"
    if rng.random() < 0.3:
        kwargs["bias"] = rng.normal(size=(int(rng.choice([1, b])), int(rng.choice([1, n])), t,
                                          s)).astype(np.float32)
    if rng.random() < 0.3:
        # Sometimes rows see no key at all: they average all values (the uniform-row contract).
        kwargs["mask"] = rng.random((int(rng.choice([1, b])), 1, t, s)) > rng.choice([0.4, 0.97])
    if rng.random() < 0.3:  # packed documents
        if t == s and rng.random() < 0.5:  # the keys share the queries' ids
            kwargs["query_segment_ids"] = np.sort(rng.integers(0, 6, (b, t)), 1).astype(np.int32)
            if rng.random() < 0.3:  # and some rows reuse an id further on
                kwargs["query_segment_ids"][:, t // 2:] %= 2
        else:  # ids of their own, contiguous runs
            kwargs["query_segment_ids"] = np.sort(rng.integers(0, 4, (b, t)), 1).astype(np.int32)
            kwargs["kv_segment_ids"] = np.sort(rng.integers(0, 4, (b, s)), 1).astype(np.int32)
    if rng.random() < 0.3:
        kwargs["query_seq_lengths"] = rng.integers(1, t + 1, size=b).astype(np.int32)
        kwargs["key_value_seq_lengths"] = rng.integers(1, s + 1, size=b).astype(np.int32)
    if rng.random() < 0.3:
        kwargs["local_window_size"] = (int(rng.integers(0, 300)), int(rng.integers(0, 300)))
        if "key_value_seq_lengths" in kwargs:
            # A row whose window lies past its keys' length sees nothing through padding, which
            # cuDNN and the reference treat differently: keep keys reachable.
            kwargs["key_value_seq_lengths"] = np.full(b, s, np.int32)
    return [x.astype(dtype) for x in (q, k, v, d_out)], kwargs


def cudnn_problem(case):
    """The first problem drawn from seed `case` that cuDNN can run (the others fall back to
    the reference path, which the CPU suite covers)."""
    rng = np.random.default_rng(case)
    while True:
        arrays, kwargs = draw_problem(rng)
        call_kwargs = dict(kwargs)
        bias, mask = call_kwargs.pop("bias", None), call_kwargs.pop("mask", None)
        call = validate(*arrays[:3], bias, mask, scale=None, implementation="cudnn",
                        **{"is_causal": False, "query_seq_lengths": None,
                           "key_value_seq_lengths": None, "local_window_size": None,
                           **call_kwargs})
        if planning.call_reason(call) is None:
            return arrays, kwargs


@pytest.mark.parametrize("case", sorted(set(range(CASES)) | set(REGRESSIONS)))
def test_cudnn_matches_reference(case):
    (q, k, v, d_out), kwargs = cudnn_problem(case)
    bias = kwargs.pop("bias", None)
    bias = None if bias is None else jnp.asarray(bias)

    def make(implementation, cast):
        return jax.jit(lambda q, k, v, bias: jax_sdpa.dot_product_attention(
            cast(q), cast(k), cast(v), bias=bias, implementation=implementation, **kwargs))
    out, vjp = jax.vjp(make("cudnn", lambda x: x), q, k, v, bias)
    ours = (out, *vjp(d_out))
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    out_ref, vjp_ref = jax.vjp(make("xla", up), q, k, v, bias)
    ref = (out_ref, *vjp_ref(up(d_out)))
    shapes = f"q {q.shape} k {k.shape} v {v.shape} {q.dtype}"
    options = {name: (value.shape if hasattr(value, "shape") else value)
               for name, value in kwargs.items()}
    assert_close_to_reference(ours, ref, context=f"case {case}: {shapes} {options}")
