"""Attention sinks and logit soft-capping on CPU: the reference path against a float64 NumPy
oracle written from the contract (values, log-sum-exp and every gradient, d sinks included,
with masks that empty rows), the kernel path (jax_sdpa/sink_softmax.py on the kernels' output) against
the reference, jit / vmap / checkpoint, the sharding rules, ring attention, and bad arguments.
The GPU file (test_gpu_sinks_softcap.py) holds cuDNN against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_sdpa
from jax_sdpa.call.spec import CallSpec
from jax_sdpa.ring import ring_attention, zigzag_permute, zigzag_unpermute
from conftest import kernel_attention, relative_error

B, T, S, N, K, H = 2, 10, 12, 4, 2, 8
CAP = 2.5


def oracle(q, k, v, d_out, *, scale, keep, cap=None, sinks=None, bias=None, q_lengths=None,
           kv_lengths=None):
    """float64 attention and its gradients from the contract: (out [B,T,N,Hv], lse [B,T,N],
    dq, dk, dv, d_sinks). keep: bool [B, N, T, S] (every mask, band and length)."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    b, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    kr, vr = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    raw = np.einsum("btnh,bsnh->bnts", q, kr) * scale
    tanh = np.tanh(raw / cap) if cap else None
    scores = cap * tanh if cap else raw
    if bias is not None:
        scores = scores + np.asarray(bias, np.float64)
    sink = (np.zeros(n) if sinks is None else np.asarray(sinks, np.float64))[None, :, None]
    seen = keep.any(-1)
    top = np.where(keep, scores, -np.inf).max(-1)
    if sinks is not None:
        top = np.maximum(top, sink)
    top = np.where(np.isfinite(top), top, 0.0)
    exps = np.where(keep, np.exp(scores - top[..., None]), 0.0)
    total = exps.sum(-1) + (np.exp(sink - top) if sinks is not None else 0.0)
    probs = np.where(total[..., None] > 0, exps / np.maximum(total, 1e-300)[..., None], 0.0)
    uniform = ~seen & (sinks is None)  # nothing visible, no sink: the values' plain average
    probs = np.where(uniform[..., None], 1.0 / s, probs)
    lse = np.where(seen | (sinks is not None), top + np.log(np.maximum(total, 1e-300)), np.nan)
    out = np.einsum("bnts,bsnh->bnth", probs, vr)
    valid = np.ones((b, 1, t, 1))
    if q_lengths is not None:
        valid = valid * (np.arange(t)[None, :] < np.asarray(q_lengths)[:, None])[:, None, :, None]
    if kv_lengths is not None:
        valid = valid * (np.asarray(kv_lengths) > 0)[:, None, None, None]
    d_o = d_out.transpose(0, 2, 1, 3) * valid  # [B, N, T, Hv]
    dv = np.einsum("bnts,bnth->bsnh", probs, d_o)
    dp = np.einsum("bnth,bsnh->bnts", d_o, vr)
    row_dot = (d_o * out).sum(-1)  # D, [B, N, T]
    ds = np.where(uniform[..., None], 0.0, probs * (dp - row_dot[..., None]))
    if cap:
        ds = ds * (1.0 - tanh * tanh)
    dq = np.einsum("bnts,bsnh->btnh", ds, kr) * scale
    dk = np.einsum("bnts,btnh->bsnh", ds, q) * scale
    fold = lambda x: x.reshape(b, s, kh, groups, x.shape[-1]).sum(3)  # noqa: E731
    d_sinks = None
    if sinks is not None:
        d_sinks = -(np.exp(sink - np.where(np.isnan(lse), 0, lse)) * row_dot).sum((0, 2))
    out = (out * valid).transpose(0, 2, 1, 3)
    return out, lse.transpose(0, 2, 1), dq, fold(dk), fold(dv), d_sinks


def inputs(seed=0, q_heads=N, kv_heads=K):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (B, T, q_heads, H)) * 1.5
    k = jax.random.normal(keys[1], (B, S, kv_heads, H)) * 1.5
    v = jax.random.normal(keys[2], (B, S, kv_heads, H))
    d_out = jax.random.normal(keys[3], (B, T, q_heads, H))
    sinks = jax.random.normal(keys[4], (q_heads,)) * 2.0
    return q, k, v, d_out, sinks


def case(name):
    """(keyword arguments, keep mask [B, N, T, S]) of a named option set."""
    rng = np.random.default_rng(3)
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    full = np.ones((B, N, T, S), bool)
    if name == "plain":
        return {}, full
    if name == "causal":
        return dict(is_causal=True), full & (j <= i)
    if name == "window_lengths":  # a window and key lengths that leave some rows no key
        q_len, kv_len = np.array([T, 6], np.int32), np.array([9, 3], np.int32)
        keep = full & (j >= i - 2) & (j <= i + 1)
        keep &= (np.arange(T)[None, :] < q_len[:, None])[:, None, :, None]
        keep &= (np.arange(S)[None, :] < kv_len[:, None])[:, None, None, :]
        return dict(local_window_size=(2, 1), query_seq_lengths=q_len,
                    key_value_seq_lengths=kv_len), keep
    if name == "mask_empties_rows":
        mask = rng.random((B, 1, T, S)) > 0.4
        mask[:, :, 3] = False  # row 3 sees nothing
        return dict(mask=mask), full & mask
    if name == "zero_kv_length":
        kv_len = np.array([0, 7], np.int32)
        keep = full & (np.arange(S)[None, :] < kv_len[:, None])[:, None, None, :]
        return dict(key_value_seq_lengths=kv_len), keep
    if name == "segments_bias":
        ids_q = np.sort(rng.integers(0, 3, (B, T)), 1).astype(np.int32)
        ids_kv = np.sort(rng.integers(0, 3, (B, S)), 1).astype(np.int32)
        bias = rng.normal(size=(1, N, T, S)).astype(np.float32)
        keep = full & (ids_q[:, None, :, None] == ids_kv[:, None, None, :])
        return dict(query_segment_ids=ids_q, kv_segment_ids=ids_kv, bias=bias), keep
    raise ValueError(name)


CASES = ["plain", "causal", "window_lengths", "mask_empties_rows", "zero_kv_length",
         "segments_bias"]
FEATURES = {"sinks": dict(sinks=True), "soft_cap": dict(cap=CAP),
            "both": dict(sinks=True, cap=CAP)}


@pytest.mark.parametrize("features", sorted(FEATURES))
@pytest.mark.parametrize("name", CASES)
def test_reference_matches_the_oracle(name, features):
    q, k, v, d_out, sinks = inputs()
    kwargs, keep = case(name)
    use_sinks, cap = FEATURES[features].get("sinks", False), FEATURES[features].get("cap")
    sinks = sinks if use_sinks else None

    def fn(q, k, v, sinks):
        return jax_sdpa.dot_product_attention(q, k, v, logits_soft_cap=cap, sinks=sinks,
                                              implementation="xla", return_residual=True,
                                              **kwargs)
    with jax.default_matmul_precision("float32"):
        (out, lse), vjp = jax.vjp(fn, q, k, v, sinks)
        dq, dk, dv, d_sinks = vjp((d_out, jnp.zeros_like(lse)))
    expected = oracle(q, k, v, d_out, scale=1 / np.sqrt(H), keep=keep, cap=cap, sinks=sinks,
                      bias=kwargs.get("bias"), q_lengths=kwargs.get("query_seq_lengths"),
                      kv_lengths=kwargs.get("key_value_seq_lengths"))
    np.testing.assert_allclose(out, expected[0], rtol=1e-4, atol=1e-5)
    defined = ~np.isnan(expected[1])
    if "key_value_seq_lengths" in kwargs or "query_seq_lengths" in kwargs:
        # rows past a query length, and batch entries without keys: outside the contract
        q_len = np.asarray(kwargs.get("query_seq_lengths", np.full(B, T)))
        kv_len = np.asarray(kwargs.get("key_value_seq_lengths", np.full(B, S)))
        defined &= ((np.arange(T)[None, :] < q_len[:, None]) & (kv_len[:, None] > 0))[..., None]
    np.testing.assert_allclose(np.asarray(lse)[defined], expected[1][defined], rtol=1e-4,
                               atol=1e-4)
    for got, want, grad in zip((dq, dk, dv), expected[2:5], ("dq", "dk", "dv")):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5, err_msg=grad)
    if use_sinks:
        assert d_sinks.dtype == sinks.dtype
        np.testing.assert_allclose(d_sinks, expected[5], rtol=1e-4, atol=2e-5)


def test_sinks_take_the_whole_weight_of_rows_that_see_nothing():
    q, k, v, _, sinks = inputs()
    mask = np.ones((B, 1, T, S), bool)
    mask[:, :, 4] = False
    out = jax_sdpa.dot_product_attention(q, k, v, mask=mask, sinks=sinks, implementation="xla")
    assert np.all(np.asarray(out)[:, 4] == 0)
    assert np.all(np.abs(np.asarray(out)[:, 3]) > 0)


def test_soft_cap_bounds_the_scores():
    """With huge scores and a small cap the weights stay those of scores within +-cap."""
    q, k, v, _, _ = inputs()
    out = jax_sdpa.dot_product_attention(q * 100, k, v, logits_soft_cap=0.5,
                                         implementation="xla", return_residual=True)[1]
    assert float(jnp.max(out)) <= 0.5 + np.log(S) + 1e-5


def call_spec(**overrides):
    return CallSpec(scale=1 / np.sqrt(H), window_right=0, implementation="xla",
                        logits_soft_cap=CAP, has_sinks=True, **overrides)


def test_kernel_path_matches_the_reference():
    """The kernels' custom_vjp (the sinks applied to a kernel's output, d sinks from the
    output and lse) against the reference path."""
    q, k, v, d_out, sinks = inputs(1)

    def kernel(q, k, v, sinks):
        return kernel_attention(q, k, v, call_spec(), sinks=sinks)[0]

    def reference(q, k, v, sinks):
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=CAP,
                                              sinks=sinks, implementation="xla")
    with jax.default_matmul_precision("float32"):
        out, vjp = jax.vjp(jax.jit(kernel), q, k, v, sinks)
        out_ref, vjp_ref = jax.vjp(reference, q, k, v, sinks)
        pairs = [(out, out_ref), *zip(vjp(d_out), vjp_ref(d_out))]
    for a, b in pairs:
        assert relative_error(a, b) < 1e-5


def test_sinks_under_jit_vmap_and_checkpoint():
    q, k, v, d_out, sinks = inputs(2)
    stack = lambda x: jnp.stack([x, x * 0.5])  # noqa: E731

    def loss(q, k, v, sinks):
        out = jax_sdpa.dot_product_attention(q, k, v, is_causal=True, sinks=sinks,
                                             logits_soft_cap=CAP, implementation="xla")
        return jnp.sum(out * d_out)
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    checkpointed = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    for a, b in zip(grads, checkpointed):
        assert relative_error(a, b) < 1e-5
    batched = jax.vmap(jax.grad(loss, argnums=3), in_axes=(0, 0, 0, None))(
        stack(q), stack(k), stack(v), sinks)
    assert relative_error(batched[0], grads[3]) < 1e-5
    # per-example sinks under vmap
    per_example = jax.vmap(loss, in_axes=(None, None, None, 0))(q, k, v, stack(sinks))
    assert relative_error(per_example[0], loss(q, k, v, sinks)) < 1e-6


@pytest.mark.parametrize("layout", ["heads", "batch"])
def test_sinks_follow_the_head_sharding(layout):
    """Heads sharded: each device's sinks are its heads' and nothing is exchanged; batch
    sharded: d sinks is summed over the devices (the only collective)."""
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    keys = jax.random.split(jax.random.key(4), 5)
    q = jax.random.normal(keys[0], (8, 16, 8, H))
    k = jax.random.normal(keys[1], (8, 16, 8, H))
    v = jax.random.normal(keys[2], (8, 16, 8, H))
    d_out = jax.random.normal(keys[3], (8, 16, 8, H))
    sinks = jax.random.normal(keys[4], (8,))

    def step(q, k, v, sinks, d_out):
        out, vjp = jax.vjp(lambda *a: kernel_attention(*a[:3], call_spec(), sinks=a[3])[0],
                           q, k, v, sinks)
        return (out, *vjp(d_out))
    spec = P(None, None, "x") if layout == "heads" else P("x")
    sink_spec = P("x") if layout == "heads" else P()
    shardings = (NamedSharding(mesh, spec),) * 3 + (NamedSharding(mesh, sink_spec),
                                                    NamedSharding(mesh, spec))
    text = jax.jit(step, in_shardings=shardings).lower(q, k, v, sinks, d_out).compile().as_text()
    collectives = {op for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute")
                   if f" {op}(" in text or f" {op}-start(" in text}
    assert collectives <= (set() if layout == "heads" else {"all-reduce"}), collectives
    sharded = jax.jit(step, in_shardings=shardings)(q, k, v, sinks, d_out)
    single = jax.jit(step)(q, k, v, sinks, d_out)
    for a, b in zip(sharded, single):
        assert relative_error(a, b) < 1e-5


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_joins_the_sink_once(layout, strategy):
    """Ring attention (both strategies) with sinks and soft-cap on 4 host devices against one
    device: output, lse and the gradients of q, k, v and the sinks."""
    devices = jax.devices("cpu")[:4]
    mesh = Mesh(np.array(devices), ("seq",))
    keys = jax.random.split(jax.random.key(5), 5)
    q = jax.random.normal(keys[0], (2, 32, 4, H))
    k = jax.random.normal(keys[1], (2, 32, 2, H))
    v = jax.random.normal(keys[2], (2, 32, 2, H))
    d_out = jax.random.normal(keys[3], (2, 32, 4, H))
    sinks = jax.random.normal(keys[4], (4,)) * 2
    spec = P(None, "seq")
    blocks = jax.shard_map(
        lambda q, k, v, s: ring_attention(q, k, v, axis_name="seq", is_causal=True,
                                          layout=layout, logits_soft_cap=CAP, sinks=s,
                                          return_residual=True, strategy=strategy),
        mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=(spec, spec))

    def ring(q, k, v, s):
        if layout == "zigzag":
            q, k, v = (zigzag_permute(x, 4) for x in (q, k, v))
        out, lse = blocks(q, k, v, s)
        if layout == "zigzag":
            out, lse = zigzag_unpermute(out, 4), zigzag_unpermute(lse, 4)
        return out, lse

    def single(q, k, v, s):
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=CAP,
                                              sinks=s, implementation="xla",
                                              return_residual=True)
    with jax.default_matmul_precision("float32"):
        (out, lse), vjp = jax.vjp(jax.jit(ring), q, k, v, sinks)
        (out_ref, lse_ref), vjp_ref = jax.vjp(jax.jit(single), q, k, v, sinks)
        grads = vjp((d_out, jnp.zeros_like(lse)))
        grads_ref = vjp_ref((d_out, jnp.zeros_like(lse_ref)))
    assert relative_error(out, out_ref) < 1e-5
    assert relative_error(lse, lse_ref) < 1e-5
    for name, a, b in zip(("dq", "dk", "dv", "d_sinks"), grads, grads_ref):
        assert relative_error(a, b) < 1e-4, name


@pytest.mark.parametrize("cap,error", [(0.0, ValueError), (-1.0, ValueError),
                                       (float("nan"), ValueError), (float("inf"), ValueError),
                                       (True, TypeError), ("1", TypeError),
                                       (np.ones(2), TypeError)])
def test_bad_soft_cap_is_refused(cap, error):
    q, k, v, _, _ = inputs()
    with pytest.raises(error, match="logits_soft_cap"):
        jax_sdpa.dot_product_attention(q, k, v, logits_soft_cap=cap)


@pytest.mark.parametrize("sinks,error", [
    (np.zeros(N + 1, np.float32), ValueError), (np.zeros((1, N), np.float32), ValueError),
    (np.zeros(N, np.int32), TypeError), (np.zeros(N, np.float16), TypeError),
    (np.zeros(N, np.float64), TypeError)])
def test_bad_sinks_are_refused(sinks, error):
    q, k, v, _, _ = inputs()
    with pytest.raises(error, match="sinks"):
        jax_sdpa.dot_product_attention(q, k, v, sinks=sinks)


def test_sinks_may_have_the_inputs_dtype():
    q, k, v, d_out, sinks = (x.astype(jnp.bfloat16) for x in inputs())
    grad = jax.grad(lambda s: jnp.sum(jax_sdpa.dot_product_attention(
        q, k, v, sinks=s, implementation="xla").astype(jnp.float32)))(sinks)
    assert grad.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(grad, np.float32)))
