"""Side-by-side attention benchmark: jax_sdpa against jax.nn (cudnn, xla) and flash-attn3-jax.

    python -m benchmarks.attention [--config name:B,S,Nq,Nkv,H,bf16,causal ...] [--out DIR]

Method (docs/DEVELOPING.md): every implementation runs inside one
jit as a straight line of CALLS independent calls on different inputs (no fori_loop, no cache
reuse), warm-up excluded; rounds interleave the implementations; the figure is the median
round's time per call. Forward and forward+backward are timed separately.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.configs import ANCHOR_CONFIGS, Config, parse_config, published_rows
from benchmarks.implementations import available
from benchmarks.report import chart, markdown, memory_markdown

CALLS = 8


def make_inputs(config, seed):
    keys = jax.random.split(jax.random.key(seed), 4 * CALLS)
    q_shape = (config.batch, config.seq, config.q_heads, config.head_dim)
    kv_shape = (config.batch, config.seq, config.kv_heads, config.head_dim)
    shapes = [q_shape, kv_shape, kv_shape, q_shape]

    def one(i):
        return tuple(jax.random.normal(keys[4 * i + j], shape, jnp.float32).astype(config.dtype)
                     for j, shape in enumerate(shapes))
    return [one(i) for i in range(CALLS)]


def timed_functions(attention, causal):
    def forward(inputs):
        return [attention(q, k, v, causal) for q, k, v, _ in inputs]

    def forward_backward(inputs):
        results = []
        for q, k, v, d_out in inputs:
            out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal), q, k, v)
            results.append((out, *vjp(d_out)))
        return results
    return {"fwd": jax.jit(forward), "fwd+bwd": jax.jit(forward_backward)}


def time_once(fn, inputs):
    start = time.perf_counter()
    jax.block_until_ready(fn(inputs))
    return (time.perf_counter() - start) / CALLS


def interleaved_rounds(fns, inputs_of, rounds):
    """{key: [seconds per call, one per round]}: every round times every function once, in turn,
    so that drift in clocks or temperature falls on all of them alike. inputs_of(key) gives the
    function's inputs."""
    samples = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            samples[key].append(time_once(fn, inputs_of(key)))
    return samples


def warm_up(fns, inputs) -> dict:
    """Runs each function once (compile and graph build, kept out of the timed rounds); those
    that raise leave `fns` and come back as {key: the error's first line}, for a row saying
    why rather than a lost table."""
    failed = {}
    for key, fn in list(fns.items()):
        try:
            jax.block_until_ready(fn(inputs))
        except Exception as error:  # noqa: BLE001 - reported as a row
            failed[key] = str(error).splitlines()[0][:200]
            del fns[key]
    return failed


def relative_error(a, b):
    a, b = (jnp.asarray(x, jnp.float32) for x in (a, b))
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def bench_config(config, rounds, command_buffers=False):
    inputs = make_inputs(config, seed=0)
    impls = available(config, command_buffers)
    fns = {(name, mode): fn for name, attention in impls.items()
           for mode, fn in timed_functions(attention, config.causal).items()}
    first_call, first_out = {}, {}
    for key, fn in fns.items():
        start = time.perf_counter()
        # compile + graph build, excluded from the rounds; the answer is checked below
        first_out[key] = jax.block_until_ready(fn(inputs))[0]
        first_call[key] = time.perf_counter() - start
        jax.block_until_ready(fn(inputs))
    samples = interleaved_rounds(fns, lambda key: inputs, rounds)
    rows = []
    for (name, mode), times in samples.items():
        seconds = statistics.median(times)
        flops = config.forward_flops() * (1 if mode == "fwd" else 3.5)
        # Correct first: every implementation's first output against jax.nn's cuDNN path's.
        ours, base = first_out[(name, mode)], first_out[("jax.nn cudnn", mode)]
        rows.append(dict(config=config.name, impl=name, mode=mode, ms=seconds * 1e3,
                         tflops=flops / seconds / 1e12, spread=(max(times) - min(times)) / seconds,
                         first_call_s=first_call[(name, mode)],
                         error_vs_jax_nn=relative_error(jax.tree.leaves(ours)[0],
                                                        jax.tree.leaves(base)[0])))
    for row in rows:
        base = next(r for r in rows if r["impl"] == "jax.nn cudnn" and r["mode"] == row["mode"])
        fa3 = [r for r in rows if r["impl"] == "flash-attn3-jax" and r["mode"] == row["mode"]]
        row["vs_jax_nn_cudnn"] = row["ms"] / base["ms"]
        row["vs_flash_attn3"] = row["ms"] / fa3[0]["ms"] if fa3 else None
    return rows + published_rows(config, rows)


def memory_rows(config):
    """fwd+bwd temporary device memory, from XLA's analysis of the compiled step (nothing runs:
    the XLA path's [B, N, S, S] scores would not fit at long S)."""
    shapes = [jax.ShapeDtypeStruct((config.batch, config.seq, heads, config.head_dim),
                                   config.dtype)
              for heads in (config.q_heads, config.kv_heads, config.kv_heads, config.q_heads)]
    rows = []
    for name, attention in available(config).items():
        if name == "flash-attn3-jax":
            continue
        fn = timed_functions(attention, config.causal)["fwd+bwd"]
        try:
            # No autotuning: it would run (and allocate) the XLA path's [N, S, S] scores.
            compiled = fn.lower([tuple(shapes)]).compile(
                compiler_options={"xla_gpu_autotune_level": 0})
            temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
        except Exception as error:  # noqa: BLE001 - reported in the table
            print(f"memory analysis of {name} failed: {str(error)[:200]}", file=sys.stderr)
            temp = float("nan")
        rows.append(dict(config=config.name, impl=name, temp_gib=temp))
    return rows


MEMORY_CONFIG = Config("d128-s32k-causal", 1, 32768, 16, 16, 128, jnp.bfloat16, True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[],
                        help="extra config name:B,S,Nq,Nkv,H,fp16|bf16,causal|full")
    parser.add_argument("--only", action="append", default=[], help="run only these configs")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--label", default="", help="appended to the header, e.g. XLA flags")
    parser.add_argument("--command-buffers", action="store_true",
                        help="also time jax_sdpa with JAX_SDPA_COMMAND_BUFFERS=1 (every call "
                             "recorded) and =0 (none)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the S=32k peak-memory comparison")
    args = parser.parse_args(argv)
    configs = ANCHOR_CONFIGS + [parse_config(text) for text in args.config]
    if args.only:
        configs = [c for c in configs if c.name in args.only]
    device = jax.devices()[0]
    header = (f"{time.strftime('%Y-%m-%d')}, {device.device_kind}, JAX {jax.__version__}, "
              f"cuDNN {__import__('jax_sdpa').cudnn_version()}"
              f"{' ' + args.label if args.label else ''}")
    rows = []
    for index, config in enumerate(configs):
        print(f"[{index + 1}/{len(configs)}] {config.name}", file=sys.stderr, flush=True)
        rows.extend(bench_config(config, args.rounds, args.command_buffers))
    table = markdown(rows)

    def write(memory):
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(dict(header=header, calls_per_round=CALLS, rows=rows, memory=memory), f,
                      indent=1)
        with open(os.path.join(args.out, "bench.md"), "w") as f:
            f.write(header + "\n\n" + table + "\n")
    write([])  # the timings are safe on disk before the memory analysis compiles anything big
    memory = [] if args.no_memory else memory_rows(MEMORY_CONFIG)
    if memory:
        table += "\n\n" + memory_markdown(memory)
        write(memory)
    try:
        chart(rows, header, os.path.join(args.out, "bench.png"))
    except ImportError as error:
        print(f"no chart: {error}", file=sys.stderr)
    print(header)
    print(table)


if __name__ == "__main__":
    main()
