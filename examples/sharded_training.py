"""Train the GPT-2 example's model on every visible device through JAX's own sharding.

    python examples/sharded_training.py --mode dp-tp      # batch over "data", heads over "model"
    python examples/sharded_training.py --mode sequence   # long context: the sequence over "seq"

dp-tp: parameters are split tensor-parallel (attention heads and MLP columns over "model"), the
batch data-parallel over "data"; plain jit + NamedSharding, and jax_sdpa's sharding rules keep
each device's attention on its own heads and batch entries, with no collective around it.
sequence: every device holds a slice of each sequence; attention is jax_sdpa.ring.ring_attention
in shard_map with the zigzag layout (tokens, targets and positions permuted to match).
Runs on one device too (every mesh axis of size 1).
"""

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_model  # noqa: E402
from gpt2_model import GPT, GPTConfig  # noqa: E402
from stdlib_text import load_stdlib_bytes, random_batch, train_validation_split  # noqa: E402
from train_gpt2 import make_train_step  # noqa: E402

from jax_sdpa.ring import ring_attention, zigzag_permute  # noqa: E402

# Tensor-parallel split of each parameter, by its name: column-parallel into a block, row-parallel
# out of it (Megatron's layout); everything else is replicated.
TENSOR_PARALLEL = {("qkv", "kernel"): P(None, "model"), ("qkv", "bias"): P("model"),
                   ("proj", "kernel"): P("model", None), ("fc", "kernel"): P(None, "model"),
                   ("fc", "bias"): P("model"), ("out", "kernel"): P("model", None)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["dp-tp", "sequence"], default="dp-tp")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--model-parallel", type=int, default=None,
                        help="devices on the 'model' axis (dp-tp); default 2 when possible")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on a GPU, else float32")
    parser.add_argument("--lr", type=float, default=2e-3)
    return parser.parse_args(argv)


def auto_mesh(shape, names):
    """A mesh whose axes the compiler propagates shardings along (jit + NamedSharding)."""
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def parameter_sharding(mesh, path, leaf):
    names = [str(getattr(key, "key", getattr(key, "name", key))) for key in path]
    names = [name for name in names if name != "value"]  # nnx.Param's own attribute
    spec = TENSOR_PARALLEL.get(tuple(names[-2:]), P())
    return NamedSharding(mesh, spec if len(spec) in (0, leaf.ndim) else P())


def ring_attention_over(mesh, q, k, v, segment_ids=None):
    if segment_ids is not None:
        raise NotImplementedError("the ring example trains on unpacked rows")
    spec = P(None, "seq")
    return jax.shard_map(
        functools.partial(ring_attention, axis_name="seq", is_causal=True, layout="zigzag"),
        mesh=mesh, in_specs=spec, out_specs=spec)(q, k, v)


def main(argv=None):
    args = parse_args(argv)
    devices = jax.devices()
    n = len(devices)
    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    if args.mode == "dp-tp":
        model_parallel = args.model_parallel or (2 if n % 2 == 0 and args.n_head % 2 == 0 else 1)
        mesh = auto_mesh((n // model_parallel, model_parallel), ("data", "model"))
        batch_spec, attention = P("data"), "jax_sdpa"
    else:
        mesh = auto_mesh((n,), ("seq",))
        batch_spec, attention = P(None, "seq"), "ring"
        gpt2_model.ATTENTION["ring"] = functools.partial(ring_attention_over, mesh)
    config = GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                       d_model=args.d_model, dtype=dtype, attention=attention)
    graphdef, params = nnx.split(GPT(config, nnx.Rngs(0)))
    if args.mode == "dp-tp":
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: jax.device_put(x, parameter_sharding(mesh, path, x)), params)
    else:
        params = jax.device_put(params, NamedSharding(mesh, P()))
    optimizer = optax.adamw(args.lr, b1=0.9, b2=0.95, weight_decay=0.1)
    opt_state = optimizer.init(params)
    # zigzag: device d holds chunks d and 2P-1-d of each sequence, so that causal work balances.
    permute = ((lambda x: zigzag_permute(x, n)) if args.mode == "sequence" else (lambda x: x))
    positions = permute(jnp.arange(args.seq_len)[None])[0]

    train_step, _ = make_train_step(graphdef, optimizer, positions)

    data, _ = train_validation_split(load_stdlib_bytes(4 * 2**20))
    rng = np.random.default_rng(0)
    batch_sharding = NamedSharding(mesh, batch_spec)
    print(f"{args.mode} on {n} x {devices[0].device_kind}, mesh {dict(mesh.shape)}, "
          f"{sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M parameters, {dtype}")
    losses, times = [], []
    for step in range(1, args.steps + 1):
        x, y = (jax.device_put(permute(jnp.asarray(a)), batch_sharding)
                for a in random_batch(data, args.batch, args.seq_len, rng))
        start = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, x, y)
        losses.append(float(loss))
        if step > 2:
            times.append(time.perf_counter() - start)
        if step % 10 == 0 or step == args.steps:
            print(f"step {step}: loss {losses[-1]:.3f}")
    rate = args.batch * args.seq_len / np.median(times) if times else float("nan")
    print(f"done: loss {losses[0]:.3f} -> {losses[-1]:.3f}, {rate:,.0f} tokens/s")


if __name__ == "__main__":
    main()
