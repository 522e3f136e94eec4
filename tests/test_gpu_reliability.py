"""Reliability on the GPU: many threads at once, the bounded graph cache, no memory growth over
10,000 calls, and a jax.export round trip run in a fresh process. Skipped without a GPU."""

import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import random_qkv

pytestmark = pytest.mark.gpu


def fwd_bwd(seq_len):
    """A jitted deterministic forward + backward at its own shape, and its inputs."""
    q, k, v, d_out = random_qkv(seq_len, 2, seq_len, seq_len, 4, 2, 64, jnp.bfloat16)

    @jax.jit
    def step(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, deterministic=True, implementation="cudnn"), q, k, v)
        return (out, *vjp(d_out))
    return step, (q, k, v)


def to_numpy(results):
    return [np.asarray(x, np.float32) for x in results]


def run_in_threads(worker, items):
    """worker(item) in one thread per item, all at once; returns [(item, error)] of failures."""
    failures = []

    def guarded(item):
        try:
            worker(item)
        except Exception as error:  # noqa: BLE001 - reported by the caller, with its item
            failures.append((item, repr(error)[:500]))
    threads = [threading.Thread(target=guarded, args=(item,)) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def test_threads_get_the_answers_of_one_thread():
    """8 threads, each at its own shape, 10 calls each: every result equals, bit for bit, the
    one computed alone (deterministic backward), and nothing crashes."""
    shapes = [64 + 48 * i for i in range(8)]
    steps = {s: fwd_bwd(s) for s in shapes}
    alone = {s: to_numpy(step(*args)) for s, (step, args) in steps.items()}

    def worker(seq_len):
        step, args = steps[seq_len]
        for _ in range(10):
            for got, want in zip(to_numpy(step(*args)), alone[seq_len]):
                np.testing.assert_array_equal(got, want)
    failures = run_in_threads(worker, shapes)
    assert not failures, failures


def resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_no_memory_growth_over_10000_calls():
    """10,000 calls over 5 rotating shapes (forward + backward, graphs cached): host RSS and
    device memory in use stay flat after warm-up."""
    steps = [fwd_bwd(s) for s in (64, 96, 128, 200, 256)]
    device = jax.devices()[0]

    def run(calls):
        for i in range(calls):
            step, args = steps[i % len(steps)]
            results = step(*args)
        jax.block_until_ready(results)
    run(1000)
    rss_before, device_before = resident_bytes(), device.memory_stats()["bytes_in_use"]
    run(9000)
    rss_growth = resident_bytes() - rss_before
    device_growth = device.memory_stats()["bytes_in_use"] - device_before
    print(f"RSS growth {rss_growth / 2**20:.1f} MiB, device growth {device_growth} bytes")
    assert rss_growth < 32 * 2**20
    assert device_growth <= 0


def run_script(script, **env):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                            text=True, timeout=600,
                            env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **env))
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_graph_cache_is_bounded_and_evicted_graphs_are_rebuilt():
    """JAX_SDPA_GRAPH_CACHE_SIZE=3 with 5 shapes in rotation, each call from a new executable
    (an executable holds the graphs it uses while it lives): at most 3 graphs cached, let-go
    graphs freed once their work has run, rebuilt on demand with the same answers, and host
    memory does not grow with the churn."""
    out = run_script("""
        import os
        import jax, jax.numpy as jnp, numpy as np
        import jax_sdpa

        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        def call(q):  # a new jitted function: a new executable, and a new per-call state
            fn = jax.jit(lambda q: jax_sdpa.dot_product_attention(
                q, q, q, is_causal=True, implementation="cudnn"))
            return np.asarray(fn(q), np.float32)
        inputs = [jax.random.normal(jax.random.key(s), (1, s, 2, 64)).astype(jnp.bfloat16)
                  for s in (64, 80, 96, 112, 128)]
        first = [call(q) for q in inputs]
        for round_ in range(10):
            if round_ == 4:
                rss_before = rss()
            for q, want in zip(inputs, first):
                np.testing.assert_array_equal(call(q), want)
            jax.clear_caches()  # frees the round's executables: their graphs are let go
        for _ in range(2):  # the first call records the sweep's events, the second frees
            jax.block_until_ready(call(inputs[0]))
        stats = jax_sdpa.graph_cache_stats()
        print(stats, "rss growth MiB", (rss() - rss_before) / 2**20)
        assert stats["capacity"] == 3 and stats["entries"] <= 3, stats
        assert stats["evictions"] >= 45 and stats["builds"] >= 50, stats
        assert stats["retired"] <= 3, stats
        assert rss() - rss_before < 64 * 2**20
        print("ok")
    """, JAX_SDPA_GRAPH_CACHE_SIZE="3")
    print(out)


def test_command_buffers_keep_their_graphs_when_the_cache_evicts_them():
    """JAX_SDPA_COMMAND_BUFFERS=1 with a one-graph cache and three live executables taking
    turns: XLA replays our calls from its CUDA graphs, so a graph evicted from the cache must
    stay alive with its executable. Every replay gives the first call's answers, and no graph
    is rebuilt after the first round (each executable finds its own)."""
    out = run_script("""
        import jax, jax.numpy as jnp, numpy as np
        import jax_sdpa
        from conftest import random_qkv

        def make(seq_len):
            q, k, v, d_out = random_qkv(seq_len, 2, seq_len, seq_len, 4, 2, 64, jnp.bfloat16)

            @jax.jit
            def step(q, k, v):
                out, vjp = jax.vjp(lambda q, k, v: jax_sdpa.dot_product_attention(
                    q * 1.5, k, v, is_causal=True, deterministic=True), q, k, v)
                return (jnp.tanh(out) * 2.0, *vjp(d_out))
            return step, (q, k, v)
        work = [make(s) for s in (128, 192, 256)]
        first = [[np.asarray(x, np.float32) for x in step(*args)] for step, args in work]
        builds = jax_sdpa.graph_cache_stats()["builds"]
        for _ in range(20):
            for (step, args), want in zip(work, first):
                for got, expected in zip(step(*args), want):
                    np.testing.assert_array_equal(np.asarray(got, np.float32), expected)
        stats = jax_sdpa.graph_cache_stats()
        print(stats)
        assert stats["builds"] == builds, stats
        print("ok")
    """, JAX_SDPA_COMMAND_BUFFERS="1", JAX_SDPA_GRAPH_CACHE_SIZE="1",
        PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    print(out)


def test_command_buffer_calls_in_one_executable_keep_their_own_workspaces(monkeypatch):
    """Four independent fwd+bwd calls of one shape in one jit with JAX_SDPA_COMMAND_BUFFERS=1:
    XLA orders the commands of its CUDA graphs only by the buffers it sees, so the calls may run
    at the same time and each needs its own workspace. Every output and gradient equals, bit
    for bit, the one computed without command buffers (deterministic backward)."""
    inputs = [random_qkv(60 + i, 2, 256, 256, 4, 2, 64, jnp.bfloat16) for i in range(4)]

    def step(inputs):
        results = []
        for q, k, v, d_out in inputs:
            out, vjp = jax.vjp(lambda q, k, v: jax_sdpa.dot_product_attention(
                q, k, v, is_causal=True, deterministic=True, implementation="cudnn"), q, k, v)
            results.append((out, *vjp(d_out)))
        return results
    want = to_numpy(jax.tree.leaves(jax.jit(step)(inputs)))
    monkeypatch.setenv("JAX_SDPA_COMMAND_BUFFERS", "1")
    recorded = jax.jit(lambda inputs: step(inputs))  # a new function: traced in this mode
    assert "jax_sdpa_dense_backward_cmdbuf" in recorded.lower(inputs).as_text()
    for _ in range(3):
        for got, expected in zip(to_numpy(jax.tree.leaves(recorded(inputs))), want):
            np.testing.assert_array_equal(got, expected)


def test_export_round_trip_runs_in_a_fresh_process(tmp_path):
    q, k, v, _ = random_qkv(31, 2, 128, 128, 4, 2, 64, jnp.bfloat16)

    def step(q, k, v):
        return jax.grad(lambda q: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, deterministic=True).astype(jnp.float32).sum())(q)
    exported = jax.export.export(jax.jit(step),
                                 disabled_checks=jax_sdpa.export_disabled_checks())(q, k, v)
    (tmp_path / "step.bin").write_bytes(exported.serialize())
    for name, x in zip("qkv", (q, k, v)):
        np.save(tmp_path / f"{name}.npy", np.asarray(x, np.float32))
    expected = np.asarray(jax.jit(step)(q, k, v), np.float32)
    run_script(f"""
        import jax, jax.numpy as jnp, numpy as np
        import jax_sdpa
        jax_sdpa.register_ffi_targets()  # this process never traced our attention
        restored = jax.export.deserialize(open("{tmp_path}/step.bin", "rb").read())
        args = [jnp.asarray(np.load(f"{tmp_path}/{{n}}.npy"), jnp.bfloat16) for n in "qkv"]
        np.save("{tmp_path}/out.npy", np.asarray(restored.call(*args), np.float32))
    """)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), expected)


def test_two_gpus_at_once_keep_their_own_graphs_and_handles():
    """On a machine with two or more GPUs: each GPU runs its own shape from its own thread at
    the same time; each gets the answer it gets alone (graphs and cuDNN handles are per device:
    a handle bound to the other GPU's stream would fail or corrupt)."""
    gpus = jax.devices()
    if len(gpus) < 2:
        pytest.skip("needs two GPUs (nvidia-h200-x2)")
    work = {}
    for index, (device, seq_len) in enumerate(zip(gpus[:2], (192, 320))):
        step, args = fwd_bwd(seq_len)
        args = tuple(jax.device_put(x, device) for x in args)
        work[index] = (step, args, to_numpy(step(*args)))

    def worker(index):
        step, args, alone = work[index]
        for _ in range(20):
            results = step(*args)
            assert all(x.devices() == {args[0].devices().pop()} for x in results)
            for got, want in zip(to_numpy(results), alone):
                np.testing.assert_array_equal(got, want)
    failures = run_in_threads(worker, list(work))
    assert not failures, failures
