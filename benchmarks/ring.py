"""Long-sequence causal attention, forward + backward: ring attention over every visible GPU
(zigzag and contiguous layouts; strategies ring and all_gather) against one GPU running the
whole sequence.

    python -m benchmarks.ring [--seq 65536] [--heads 16] [--kv-heads 16] [--head-dim 128]
                              [--rounds 5] [--trace DIR] [--strategy ring --strategy all_gather]

Reports ms per fwd+bwd, the speed-up over one GPU, and the ring's efficiency: (one GPU's time /
devices) / ring time, 1.0 when communication hides entirely behind compute and the causal work
is balanced. With --trace, a jax.profiler trace of each ring's step goes to DIR and the GPU
time per kernel name (both GPUs' timelines summed) is printed.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_sdpa
from jax_sdpa.ring import ring_attention
from benchmarks.traces import kernel_table, kernel_times


def fwd_bwd(attention):
    def step(q, k, v, d_out):
        out, vjp = jax.vjp(attention, q, k, v)
        return (out, *vjp(d_out))
    return jax.jit(step)


def timed(fn, args, rounds):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--implementation", default="cudnn", help="xla: a CPU dry run")
    parser.add_argument("--strategy", action="append", default=[],
                        help="ring, all_gather (repeatable; default both)")
    args = parser.parse_args(argv)
    devices = jax.devices()
    kv_heads = args.kv_heads or args.heads
    q_shape = (1, args.seq, args.heads, args.head_dim)
    kv_shape = (1, args.seq, kv_heads, args.head_dim)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, d_out = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
                      for key, shape in zip(keys, (q_shape, kv_shape, kv_shape, q_shape)))
    single = fwd_bwd(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=True, implementation=args.implementation))
    one_gpu = timed(single, (q, k, v, d_out), args.rounds)
    print(f"{time.strftime('%Y-%m-%d')}, {len(devices)} x {devices[0].device_kind}, cuDNN "
          f"{jax_sdpa.cudnn_version()}, B=1 S={args.seq} N={args.heads} K={kv_heads} "
          f"H={args.head_dim} "
          "bf16 causal, fwd+bwd")
    print(f"| run | ms | speed-up over 1 GPU | ring efficiency |\n|---|---|---|---|\n"
          f"| 1 GPU, jax_sdpa | {one_gpu * 1e3:.2f} | 1.00 | – |")
    # Random data: the zigzag ring reads it in zigzag order, which changes the answer's layout
    # but not the work (tests/test_ring.py checks the answers).
    mesh = Mesh(np.array(devices), ("seq",))
    spec = NamedSharding(mesh, P(None, "seq"))
    sharded = [jax.device_put(x, spec) for x in (q, k, v, d_out)]
    for strategy in args.strategy or ["ring", "all_gather"]:
        for layout in ("zigzag", "contiguous"):
            ring = fwd_bwd(jax.shard_map(
                functools.partial(ring_attention, axis_name="seq", is_causal=True,
                                  layout=layout, implementation=args.implementation,
                                  strategy=strategy),
                mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq")))
            seconds = timed(ring, sharded, args.rounds)
            print(f"| {strategy} over {len(devices)} GPUs, {layout} | {seconds * 1e3:.2f} | "
                  f"{one_gpu / seconds:.2f} | {one_gpu / len(devices) / seconds:.2f} |",
                  flush=True)
            if args.trace:
                print_trace(ring, sharded, f"{args.trace}/{strategy}-{layout}", seconds)


def print_trace(fn, args, directory, seconds):
    """One traced step: GPU time per kernel name, summed over every GPU's timeline, against
    the step's wall time on each GPU. (On the H200 each kernel shows on two GPU lines of the
    trace, so these sums are twice the kernels' time: halve them, as docs/PERFORMANCE.md
    does.)"""
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        jax.block_until_ready(fn(*args))
    totals, counts = kernel_times(directory)
    devices = len(jax.devices())
    print(f"  trace: kernels {sum(totals.values()) / 1e3 / devices:.2f} ms per GPU against a "
          f"{seconds * 1e3:.2f} ms step")
    print("\n".join(kernel_table(totals, counts, per=devices, limit=14, unit="ms")))


if __name__ == "__main__":
    main()
