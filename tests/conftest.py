import os

# On a GPU machine, tests share the card with subprocesses they start: no preallocation.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Eight host devices, for the multi-device tests (sharding, ring attention) on CPU.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
# Without a GPU the suite's time is XLA's CPU compiles of small programs: LLVM's cheaper passes
# compile them ~1.6x faster, and the tests' arrays are too small for the faster code to matter.
# (Subprocesses the tests start inherit the flags.)
if not os.path.exists("/dev/nvidiactl") and "xla_backend_optimization_level" not in \
        os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += (" --xla_backend_optimization_level=0"
                                " --xla_llvm_disable_expensive_passes=true")
    # One compilation cache for the whole run (its workers and the subprocesses they start):
    # many tests compile the same reference programs.
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the process that made it removes it
        import atexit  # noqa: PLC0415
        import shutil  # noqa: PLC0415
        import tempfile  # noqa: PLC0415
        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_sdpa_tests_")
        atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jax_sdpa.limits import device  # noqa: E402


def pytest_collection_modifyitems(config, items):
    reason = device.device_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU with cuDNN: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_traces():
    """JAX's caches cleared before and after the test: our kernels' traces are cached by their
    config, so a test that patches what a trace reads (the workspace's size, the GPU) must trace
    afresh, and must leave no patched trace behind for the tests after it in its worker."""
    jax.clear_caches()
    yield
    jax.clear_caches()


def pytest_terminal_summary(terminalreporter):
    """Skips counted by reason, one line each (without a GPU hundreds share one reason)."""
    counts = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        reason = str(reason).removeprefix("Skipped: ")
        counts[reason] = counts.get(reason, 0) + 1
    if counts:
        terminalreporter.section("skipped, by reason")
        for reason, count in sorted(counts.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{count:4d}  {reason}")


def pytest_runtest_logreport(report):
    """With JAX_SDPA_FAILURES_FILE set (scripts/gpu_check.sh), each failed test's name goes to
    that file as it fails: a device call cut by its time limit loses pytest's summary, and with
    it the names."""
    path = os.environ.get("JAX_SDPA_FAILURES_FILE")
    if path and report.failed:
        with open(path, "a") as failures:
            failures.write(f"{report.nodeid} ({report.when})\n")


def random_qkv(seed, batch, q_seq, kv_seq, q_heads, kv_heads, head_dim, dtype):
    """Random normal q [B,T,N,H], k/v [B,S,K,H] and an output cotangent, never zeros."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, q_seq, q_heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (batch, kv_seq, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (batch, kv_seq, kv_heads, head_dim), jnp.float32).astype(dtype)
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32).astype(dtype)
    return q, k, v, d_out


def relative_error(actual, expected):
    """||actual - expected|| / ||expected||; the RMS difference where expected is all zeros
    (e.g. dq when every query sees a single key)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert np.all(np.isfinite(actual)), "non-finite values in the result"
    difference = np.linalg.norm(actual - expected)
    reference = np.linalg.norm(expected)
    if reference <= 1e-6 * np.sqrt(expected.size):
        return float(difference / np.sqrt(expected.size))
    return float(difference / reference)


def assert_close_to_reference(ours, ref, context="", out_tol=1e-2, grad_tol=2e-2):
    """(output, dq, dk, dv[, dbias]) against the float32 reference's, by relative error norm;
    a None entry (no bias) is skipped."""
    for name, a, b in zip(("output", "dq", "dk", "dv", "dbias"), ours, ref):
        if a is None:
            continue
        tol = out_tol if name == "output" else grad_tol
        error = relative_error(a, b)
        assert error < tol, f"{context} {name}: relative error {error:.2e} >= {tol}".strip()


def assert_same_function(fn_a, fn_b, args, d_out, tol=1e-5):
    """fn_a and fn_b agree on `args`: output shape, dtype and values, and every gradient, by
    relative error. Full float32 matmuls on both sides (a GPU's default precision is TF32).
    Both jitted: op-by-op dispatch would compile every primitive on its own (eager calls have
    tests of their own, tests/test_api_cpu.py)."""
    with jax.default_matmul_precision("float32"):
        out_a, vjp_a = jax.vjp(jax.jit(fn_a), *args)
        out_b, vjp_b = jax.vjp(jax.jit(fn_b), *args)
        pairs = [(out_a, out_b), *zip(vjp_a(d_out), vjp_b(d_out))]
    assert out_a.shape == out_b.shape and out_a.dtype == out_b.dtype
    for a, b in pairs:
        assert relative_error(a, b) < tol


def kernel_attention(query, key, value, config, **optional):
    """The kernels' custom_vjp called directly (below dot_product_attention's checks):
    (output, lse [B, N, T]). optional: the config's other inputs by name."""
    from jax_sdpa.kernels import vjp as kernel_vjp  # noqa: PLC0415

    return kernel_vjp.attention(config, dict(query=query, key=key, value=value, **optional))


def twins(role, job=None):
    """The names of our targets of a role ("forward" or "backward"), of every job or of one
    ("dense", "ragged", "paged", "fp8"), each with its command-buffer twin: which twin a call
    lowers to depends on JAX_SDPA_COMMAND_BUFFERS (jax_sdpa/cudnn/command_buffers.py)."""
    from jax_sdpa.cudnn.targets import TARGETS  # noqa: PLC0415

    return tuple(name for target in TARGETS if target.name.endswith("_" + role) and
                 (job is None or target.name == f"jax_sdpa_{job}_{role}")
                 for name in (target.name, target.command_buffer_name))


def calls_to(text, role, job=None):
    """The lines of `text` (lowered StableHLO or compiled HLO) that call our targets of this
    role (and job), either twin, or their poisoned twins (tests/poisoning.py)."""
    names = set()
    for name in twins(role, job):
        plain = name.removesuffix("_cmdbuf")
        names |= {name, f"{plain}_poisoned" + name[len(plain):]}
    return [line for line in text.splitlines()
            if any(f"@{name}(" in line or f'custom_call_target="{name}"' in line
                   for name in names)]


def lowers_to(text, role, job=None) -> bool:
    """Whether lowered `text` calls one of our targets of this role (and job)."""
    return bool(calls_to(text, role, job))


def gradient_patterns(f):
    """(name, fn(q, k, v, d_out) -> (output, dq, dk, dv)) for the ways users take gradients."""
    def loss(f_):
        return lambda q, k, v, d_out: jnp.vdot(f_(q, k, v).astype(jnp.float32),
                                               d_out.astype(jnp.float32))

    def with_output(grad_fn, f_):
        def run(q, k, v, d_out):
            return (f_(q, k, v), *grad_fn(q, k, v, d_out))
        return run

    def vjp_of_jit(q, k, v, d_out):
        out, vjp = jax.vjp(jax.jit(f), q, k, v)
        return (out, *vjp(d_out))
    grads = lambda g: lambda q, k, v, d: g(q, k, v, d)  # noqa: E731
    return [
        ("jit(grad)", with_output(grads(jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))),
                                  jax.jit(f))),
        ("vjp(jit)", vjp_of_jit),
        ("grad(jit)", with_output(grads(jax.grad(loss(jax.jit(f)), argnums=(0, 1, 2))), f)),
        ("jit(grad(checkpoint))",
         with_output(grads(jax.jit(jax.grad(loss(jax.checkpoint(f)), argnums=(0, 1, 2)))),
                     jax.jit(f))),
    ]


def reference_gradients(f_ref, q, k, v, d_out):
    """(output, dq, dk, dv) of f_ref on the float32 upcast inputs."""
    up = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    out, vjp = jax.vjp(jax.jit(f_ref), *up[:3])
    return (out, *vjp(up[3]))


def directional_derivative_error(f, args, step=0.01):
    """Relative gap between f's gradient along itself and f's central difference along the
    same (rounded) step: a backward that drops other weights than its forward (dropout) points
    elsewhere than the function rises, a gap of order one. f: half-precision arrays -> float32
    scalar, deterministic (a fixed dropout key)."""
    grads = jax.jit(jax.grad(f, argnums=tuple(range(len(args)))))(*args)
    rms = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads) /
                   sum(g.size for g in grads))
    plus, minus = [], []
    for g, x in zip(grads, args):
        direction = step * g.astype(jnp.float32) / rms
        plus.append((x.astype(jnp.float32) + direction).astype(x.dtype))
        minus.append((x.astype(jnp.float32) - direction).astype(x.dtype))
    predicted = sum(jnp.vdot(g.astype(jnp.float32), p.astype(jnp.float32) - m.astype(jnp.float32))
                    for g, p, m in zip(grads, plus, minus))
    measured = jax.jit(f)(*plus) - jax.jit(f)(*minus)
    return float(abs(predicted - measured) / abs(measured))
