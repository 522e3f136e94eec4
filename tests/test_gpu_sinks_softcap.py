"""Attention sinks and logit soft-capping on cuDNN against the float32 reference: outputs,
every gradient (d sinks included) and the log-sum-exp, over the options they combine with.
Outputs are NaN-poisoned first, so every element must be written. Skipped without a GPU."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import assert_close_to_reference, random_qkv, relative_error, lowers_to
from poisoning import poison_outputs
from test_gpu import B, H, K, N, S, T, option_kwargs

pytestmark = pytest.mark.gpu

CAP = 5.0


def check(option, cap=None, with_sinks=False, dtype=jnp.bfloat16, deterministic=False,
          head_dim=H, implementation="cudnn"):
    """cuDNN (poisoned outputs) against the float32 reference for one option set."""
    rng = np.random.default_rng(zlib.crc32(f"{option}{cap}{with_sinks}".encode()))
    q, k, v, d_out = random_qkv(len(option), B, T, S, N, K, head_dim, dtype)
    q = q * 2  # scores past the cap, so that soft-capping changes the answer
    if option == "packed+causal":  # self-attention packing: T = S, the queries' ids only
        q, d_out = q[:, :S // 2], d_out[:, :S // 2]
        k, v = k[:, :S // 2], v[:, :S // 2]
        ids = np.sort(rng.integers(0, 4, size=(B, S // 2)), axis=1).astype(np.int32)
        kwargs = dict(is_causal=True, query_segment_ids=jnp.asarray(ids))
    else:
        kwargs = option_kwargs(option, rng)
    bias = kwargs.pop("bias", None)
    sinks = jnp.asarray(rng.normal(size=N) * 2, jnp.float32) if with_sinks else None

    def make(implementation, cast):
        def fn(q, k, v, bias, sinks):
            return jax_sdpa.dot_product_attention(
                *(cast(x) for x in (q, k, v)), bias=bias, sinks=sinks, logits_soft_cap=cap,
                implementation=implementation, deterministic=deterministic,
                return_residual=True, **kwargs)
        return jax.jit(fn)

    def run(fn, cotangent):
        (out, lse), vjp = jax.vjp(fn, q, k, v, bias, sinks)
        return out, lse, vjp((cotangent, jnp.zeros_like(lse)))
    with poison_outputs():
        out, lse, grads = run(make(implementation, lambda x: x), d_out)
    out_ref, lse_ref, grads_ref = run(make("xla", lambda x: x.astype(jnp.float32)),
                                      d_out.astype(jnp.float32))
    context = f"{option} cap={cap} sinks={with_sinks}"
    assert_close_to_reference((out, *grads[:4]), (out_ref, *grads_ref[:4]), context=context)
    if with_sinks:
        error = relative_error(grads[4], grads_ref[4])
        assert error < 2e-2, f"{context} d_sinks: relative error {error:.2e}"
    rows = np.ones(lse_ref.shape, bool)  # the residual of rows inside the lengths
    if "query_seq_lengths" in kwargs:
        rows &= (np.arange(lse_ref.shape[1])[None, :] <
                 np.asarray(kwargs["query_seq_lengths"])[:, None])[..., None]
    if "key_value_seq_lengths" in kwargs:
        rows &= (np.asarray(kwargs["key_value_seq_lengths"]) > 0)[:, None, None]
    if with_sinks or option not in ("maskrows", "kvzero"):
        lse_error = relative_error(np.asarray(lse)[rows], np.asarray(lse_ref)[rows])
        assert lse_error < 1e-2, f"{context} lse: relative error {lse_error:.2e}"


SOFT_CAP_OPTIONS = ["causal", "window32_0+causal", "window16_8", "lengths", "lengths+causal",
                    "kvzero", "maskrows", "causalBR", "segments+causal"]
SINK_OPTIONS = ["causal", "window16_8+causal", "lengths+causal", "kvzero", "maskrows",
                "bias1NTS", "segments", "segments+causal", "packed+causal"]


@pytest.mark.parametrize("option", SOFT_CAP_OPTIONS)
def test_soft_cap_on_cudnn(option):
    check(option, cap=CAP)


def test_soft_cap_with_a_bias_gradient_takes_the_reference_backward():
    """cuDNN 9.19 gave a wrong dbias under the soft-cap score modifier: by default the backward
    takes the reference path (warning), implementation="cudnn" refuses before running."""
    with pytest.warns(RuntimeWarning, match="bias gradient under logits_soft_cap"):
        check("bias1NTS+causal", cap=CAP, with_sinks=True, implementation=None)
    q, k, v, _ = random_qkv(7, B, T, S, N, K, H, jnp.bfloat16)
    bias = jnp.zeros((1, N, T, S), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="logits_soft_cap"):
        jax.grad(lambda q: jax_sdpa.dot_product_attention(
            q, k, v, bias=bias, logits_soft_cap=CAP, implementation="cudnn").astype(
                jnp.float32).sum())(q)


@pytest.mark.parametrize("option", SINK_OPTIONS)
def test_sinks_on_cudnn(option):
    check(option, with_sinks=True)


@pytest.mark.parametrize("option", ["causal", "lengths+causal", "segments+causal"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
def test_both_on_cudnn(option, dtype):
    check(option, cap=CAP, with_sinks=True, dtype=dtype)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_soft_cap_head_dims_and_deterministic(head_dim):
    check("causal", cap=CAP, with_sinks=True, head_dim=head_dim, deterministic=True)


def test_soft_cap_runs_on_our_targets():
    q, k, v, _ = random_qkv(3, B, T, S, N, K, H, jnp.bfloat16)
    sinks = jnp.zeros((N,), jnp.float32)
    text = jax.jit(jax.grad(lambda q, k, v, s: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=True, logits_soft_cap=CAP, sinks=s,
        implementation="cudnn").astype(jnp.float32).sum(), argnums=(0, 3))).lower(
            q, k, v, sinks).compile().as_text()
    assert lowers_to(text, "forward") and lowers_to(text, "backward")
    assert "__cudnn$fmha" not in text


def test_sinks_with_dropout_run_and_average_out():
    """Dropout drops weights after the sink's share is taken: averaged over keys, the output
    is the undropped one."""
    q, k, v, _ = random_qkv(4, B, T, S, N, K, H, jnp.bfloat16)
    sinks = jnp.ones((N,), jnp.float32)
    fn = jax.jit(jax.vmap(lambda key: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=True, sinks=sinks, dropout_rate=0.2, dropout_rng=key,
        implementation="cudnn").astype(jnp.float32)))
    mean = jnp.mean(fn(jax.random.split(jax.random.key(0), 64)), axis=0)
    plain = jax_sdpa.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                           is_causal=True, sinks=sinks, implementation="xla")
    assert relative_error(mean, plain) < 0.1


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_with_sinks_and_soft_cap_on_cudnn_blocks(layout):
    """Every visible GPU in the ring, bf16 blocks on our cuDNN kernels, against float32."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: PLC0415

    from jax_sdpa.ring import ring_attention, zigzag_permute, zigzag_unpermute  # noqa: PLC0415
    devices = jax.devices()
    size = len(devices)
    mesh = Mesh(np.array(devices), ("seq",))
    q, k, v, d_out = random_qkv(6, 2, 512 * size, 512 * size, 8, 2, 128, jnp.bfloat16)
    q = q * 2
    sinks = jnp.linspace(-2.0, 3.0, 8, dtype=jnp.float32)
    spec = P(None, "seq")
    blocks = jax.shard_map(
        lambda q, k, v, s: ring_attention(q, k, v, axis_name="seq", is_causal=True,
                                          layout=layout, logits_soft_cap=CAP, sinks=s,
                                          implementation="cudnn"),
        mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=spec)

    def ring(q, k, v, s):
        if layout == "zigzag":
            q, k, v = (zigzag_permute(x, size) for x in (q, k, v))
        out = blocks(q, k, v, s)
        return zigzag_unpermute(out, size) if layout == "zigzag" else out

    def single(q, k, v, s):
        return jax_sdpa.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                              is_causal=True, logits_soft_cap=CAP, sinks=s,
                                              implementation="xla")
    q, k, v, d_out = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, d_out))
    out, vjp = jax.vjp(jax.jit(ring), q, k, v, sinks)
    out_ref, vjp_ref = jax.vjp(jax.jit(single), q, k, v, sinks)
    grads, grads_ref = vjp(d_out), vjp_ref(d_out.astype(jnp.float32))
    assert_close_to_reference((out, *grads[:3]), (out_ref, *grads_ref[:3]), context=layout)
    assert relative_error(grads[3], grads_ref[3]) < 2e-2
