"""Long-sequence causal attention, forward + backward: ring attention over every visible GPU
(zigzag and contiguous layouts) against one GPU running the whole sequence.

    python -m benchmarks.ring [--seq 65536] [--heads 16] [--head-dim 128] [--rounds 5]

Reports ms per fwd+bwd, the speed-up over one GPU, and the ring's efficiency: (one GPU's time /
devices) / ring time, 1.0 when communication hides entirely behind compute and the causal work
is balanced.
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
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    devices = jax.devices()
    shape = (1, args.seq, args.heads, args.head_dim)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, d_out = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
                      for key in keys)
    single = fwd_bwd(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"))
    one_gpu = timed(single, (q, k, v, d_out), args.rounds)
    print(f"{time.strftime('%Y-%m-%d')}, {len(devices)} x {devices[0].device_kind}, cuDNN "
          f"{jax_sdpa.cudnn_version()}, B=1 S={args.seq} N={args.heads} H={args.head_dim} "
          "bf16 causal, fwd+bwd")
    print(f"| run | ms | speed-up over 1 GPU | ring efficiency |\n|---|---|---|---|\n"
          f"| 1 GPU, jax_sdpa | {one_gpu * 1e3:.2f} | 1.00 | – |")
    # Random data: the zigzag ring reads it in zigzag order, which changes the answer's layout
    # but not the work (tests/test_ring.py checks the answers).
    mesh = Mesh(np.array(devices), ("seq",))
    spec = NamedSharding(mesh, P(None, "seq"))
    sharded = [jax.device_put(x, spec) for x in (q, k, v, d_out)]
    for layout in ("zigzag", "contiguous"):
        ring = fwd_bwd(jax.shard_map(
            functools.partial(ring_attention, axis_name="seq", is_causal=True, layout=layout,
                              implementation="cudnn"),
            mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq")))
        seconds = timed(ring, sharded, args.rounds)
        print(f"| ring over {len(devices)} GPUs, {layout} | {seconds * 1e3:.2f} | "
              f"{one_gpu / seconds:.2f} | {one_gpu / len(devices) / seconds:.2f} |")


if __name__ == "__main__":
    main()
