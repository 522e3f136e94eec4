"""One process of scripts/multiprocess_check.py: joins the distributed run, then runs the
checks on a global mesh over every process's devices (see that script's docstring)."""

from __future__ import annotations

import itertools
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _join(index, processes, coordinator, platform):
    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=processes,
                               process_id=index)
    assert jax.process_count() == processes, jax.process_count()


def _global(array, sharding):
    """A global array from the host array every process holds: each keeps its own shards."""
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _gathered(x):
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.process_allgather(x, tiled=True), np.float64)


def _local(fn, *arrays):
    """fn on this process's first device alone (the single-device answer)."""
    device = jax.local_devices()[0]
    return jax.jit(fn)(*(None if a is None else jax.device_put(np.asarray(a), device)
                         for a in arrays))


def _relative_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values"
    scale = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (scale if scale > 0 else 1.0))


def _random(shape, seed, dtype):
    return np.asarray(jax.random.normal(jax.random.key(seed), shape, jnp.float32), dtype)


def check_sharding(platform):
    """Batch over "data", heads over "model" across the processes: per-device kernels, no
    collective (a broadcast bias's gradient aside), the single device's answer."""
    from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

    from jax_sdpa.kernels import vjp as kernel_vjp  # noqa: PLC0415
    from jax_sdpa.call.spec import CallSpec  # noqa: PLC0415

    kernel = "cudnn" if platform == "gpu" else "xla"
    dtype = jnp.bfloat16 if kernel == "cudnn" else np.float32
    n = len(jax.devices())
    model = 2 if n % 2 == 0 else 1
    mesh = jax.make_mesh((n // model, model), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    b, t, heads, kv_heads, d = 2 * (n // model), 128, 4 * model, 2 * model, 64
    q, d_out = (_random((b, t, heads, d), s, dtype) for s in (1, 4))
    k, v = (_random((b, t, kv_heads, d), s, dtype) for s in (2, 3))
    for bias_shape in (None, (1, heads, t, t)):
        bias = None if bias_shape is None else _random(bias_shape, 5, dtype)
        config = CallSpec(scale=d ** -0.5, window_right=0, implementation=kernel,
                              has_bias=bias is not None, bias_grad=bias is not None,
                              bias_heads_full=bias is not None)

        def step(q, k, v, d_out, bias):
            optional = {} if bias is None else dict(bias=bias)

            def attention(q, k, v, optional):
                return kernel_vjp.attention(config, dict(query=q, key=k, value=v,
                                                         **optional))[0]
            out, vjp = jax.vjp(attention, q, k, v, optional)
            d_q, d_k, d_v, d_optional = vjp(d_out)
            return out, d_q, d_k, d_v, d_optional.get("bias")
        spec = NamedSharding(mesh, P("data", None, "model"))
        bias_spec = NamedSharding(mesh, P(None, "model"))
        shardings = (spec,) * 4 + ((None,) if bias is None else (bias_spec,))
        args = [_global(x, s) for x, s in zip((q, k, v, d_out), shardings)]
        args.append(None if bias is None else _global(bias, bias_spec))
        compiled = jax.jit(step).lower(*args).compile().as_text()
        found = {op for op in COLLECTIVES if re.search(rf"\b{op}(-start)?\(", compiled)}
        allowed = set() if bias is None else {"all-reduce"}
        assert found <= allowed, f"unexpected collectives {found - allowed} (bias {bias_shape})"
        sharded = jax.jit(step)(*args)
        single = _local(step, q, k, v, d_out, bias)
        for name, a, e in zip(("out", "dq", "dk", "dv", "dbias"), sharded, single):
            if e is not None:
                tol = 2e-2 if (name == "dbias" and kernel == "cudnn") else 1e-5
                error = _relative_error(_gathered(a), e)
                assert error < tol, f"{name}: relative error {error:.2e} (bias {bias_shape})"
    return f"sharding: {kernel} kernels on a {dict(mesh.shape)} mesh, no collectives"


def check_ring(platform):
    """ring_attention over every device of every process against one device's answer."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: PLC0415

    import jax_sdpa  # noqa: PLC0415
    from jax_sdpa.ring import ring_attention, zigzag_permute, zigzag_unpermute  # noqa: PLC0415

    devices = jax.devices()
    size = len(devices)
    mesh = Mesh(np.array(devices), ("seq",))
    spec = NamedSharding(mesh, P(None, "seq"))
    dtype = jnp.bfloat16 if platform == "gpu" else np.float32
    head_dim = 128 if platform == "gpu" else 16
    tolerances = (1e-2, 2e-2) if platform == "gpu" else (1e-5, 1e-4)
    done = []
    cases = list(itertools.product(("ring", "all_gather"), ("zigzag", "contiguous"),
                                   (True, False)))
    if platform == "cpu":
        # Each strategy and layout once (tests/test_ring.py runs the whole matrix in one
        # process): on a CPU the compiles are most of the check's time.
        cases = [("ring", "zigzag", True), ("ring", "contiguous", False),
                 ("all_gather", "zigzag", True), ("all_gather", "contiguous", False)]
    for strategy, layout, is_causal in cases:
        seq = 128 * size
        q, d_out = (_random((2, seq, 8, head_dim), s, dtype) for s in (11, 14))
        k, v = (_random((2, seq, 2, head_dim), s, dtype) for s in (12, 13))
        blocks = jax.shard_map(
            lambda q, k, v: ring_attention(q, k, v, axis_name="seq", is_causal=is_causal,
                                           layout=layout, return_residual=True,
                                           strategy=strategy),
            mesh=mesh, in_specs=P(None, "seq"), out_specs=(P(None, "seq"),) * 2)

        def ring(q, k, v, d_out):
            out, vjp = jax.vjp(lambda q, k, v: blocks(q, k, v)[0], q, k, v)
            return (out, blocks(q, k, v)[1], *vjp(d_out))
        permute = (lambda x: zigzag_permute(x, size)) if layout == "zigzag" else np.asarray
        unpermute = ((lambda x: zigzag_unpermute(x, size)) if layout == "zigzag" else
                     (lambda x: x))
        results = jax.jit(ring)(*(_global(permute(x), spec) for x in (q, k, v, d_out)))
        results = [np.asarray(unpermute(_gathered(r))) for r in results]

        def single(q, k, v, d_out):
            def fn(q, k, v):
                return jax_sdpa.dot_product_attention(
                    q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                    is_causal=is_causal, implementation="xla", return_residual=True)
            (out, lse), vjp = jax.vjp(fn, q, k, v)
            return (out, lse, *vjp((d_out.astype(jnp.float32), jnp.zeros_like(lse))))
        expected = _local(single, q, k, v, d_out)
        for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), results, expected):
            tol = tolerances[0] if name in ("out", "lse") else tolerances[1]
            error = _relative_error(a, e)
            assert error < tol, f"{strategy} {layout} causal={is_causal} {name}: {error:.2e}"
        done.append(f"{strategy} {layout}{'/causal' if is_causal else ''}")
    return f"ring over {size} devices in {jax.process_count()} processes: " + ", ".join(done)


def check_example(platform):
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415

    import sharded_training  # noqa: PLC0415 - examples/

    summaries = []
    for mode in ("dp-tp", "sequence"):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            sharded_training.main(["--mode", mode, "--steps", "8", "--seq-len", "128",
                                   "--batch", "4"])
        last = text.getvalue().strip().splitlines()[-1]
        first, final = (float(x) for x in re.findall(r"loss ([\d.]+) -> ([\d.]+)", last)[0])
        assert final < first, f"{mode}: loss did not fall ({last})"
        summaries.append(f"{mode} {last}")
    return "example: " + "; ".join(summaries)


def run(index, processes, coordinator, platform, checks):
    _join(index, processes, coordinator, platform)
    print(f"process {jax.process_index()} of {jax.process_count()}: "
          f"{len(jax.local_devices())} local / {len(jax.devices())} global {platform} devices")
    failed = False
    for name in checks:
        try:
            print("ok", globals()[f"check_{name}"](platform), flush=True)
        except Exception:  # noqa: BLE001 - reported, and the exit status says it
            failed = True
            print(f"FAILED {name}:\n{traceback.format_exc()}", flush=True)
    jax.distributed.shutdown()
    return 1 if failed else 0
